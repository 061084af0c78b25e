"""Run by vLLM's own interpreter (tests/methods/test_model_free_moe.py): what vLLM's loader would make of a
compressed-tensors MoE artifact, from vLLM's own code, without loading the model (its CPU build has no fp8-block,
NVFP4 or MXFP4 kernels, so nothing here runs one); one JSON line on stdout per artifact.

For every linear layer vLLM builds (q/k/v, gate/up and MLA's q_a/kv_a fused as the model's packed_modules_mapping
says) and every fused-experts layer, from the artifact's quantization_config through
`CompressedTensorsConfig.from_config`:

- the scheme vLLM resolves (`get_scheme_dict`, then `_get_scheme_from_parts` for a linear layer and
  `CompressedTensorsMoEMethod.get_moe_method` for the experts: the class names), or None where it is ignored;
- the parameters that scheme creates (`create_weights` on an empty module; kernel and backend selection stubbed
  out, which is the only part that needs a GPU) and for each stored tensor the parameter it loads into: a
  linear layer's shard, or for an expert the fused parameter through vLLM's own expert-parameter mapping
  (`RoutedExperts.build_expert_params_mapping`, as the model's load_weights uses it), with the shape of that
  expert's (and shard's) slice;
- `problems`: every stored tensor no parameter takes, every parameter slice whose shape or dtype family differs
  from the stored tensor, every parameter of a quantized layer nothing stores.

    python vllm_moe_probe.py ARTIFACT [ARTIFACT ...] PORT
"""

import json
import re
import sys
from unittest import mock

import torch

FUSED_MOE = {  # the model's packed_modules_mapping (DeepseekV2ForCausalLM, Qwen3MoeForCausalLM / its weights mapper,
    # Glm4MoeForCausalLM, GraniteMoeHybridForCausalLM)
    "deepseek_v3": {"gate_up_proj": ["gate_proj", "up_proj"], "fused_qkv_a_proj": ["q_a_proj", "kv_a_proj_with_mqa"]},
    "qwen3_moe": {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]},
    "glm4_moe": {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]},
    "granitemoehybrid": {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "in_proj": ["in_proj"],
                         "input_linear": ["input_linear"]},
}
# a layer's routed experts: `<layer>.mlp.experts`, Granite 4's `<layer>.block_sparse_moe.experts`
EXPERTS = r"(.*\.(?:mlp|block_sparse_moe)\.experts)\.(\d+)\."
PARAM_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale", "weight_zero_point", "weight_shape",
                  "input_global_scale", "input_scale", "weight")


def family(name: str) -> str:
    return "float" if name.startswith(("float", "bfloat")) else name


def stub_kernels():
    """Kernel and backend choices replaced by stand-ins: the CPU build has none of these kernels, and what is checked
    here (scheme, parameters) does not depend on them."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w4a4_nvfp4 as nvfp4_moe,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_w8a8_fp8 as fp8_moe,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        compressed_tensors_moe_wna16 as wna16_moe,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w4a4_mxfp4 as mxfp4,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w4a4_nvfp4 as nvfp4,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_w8a8_fp8 as fp8,
    )
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        compressed_tensors_wNa16 as wna16,
    )

    patches = [mock.patch.object(nvfp4, "init_nvfp4_linear_kernel", lambda **kw: None),
               mock.patch.object(nvfp4, "expose_input_quant_key", lambda *a, **kw: None),
               mock.patch.object(nvfp4_moe, "select_nvfp4_moe_backend", lambda **kw: (None, None)),
               mock.patch.object(nvfp4_moe, "is_global_sf_supported_for_nvfp4_backend", lambda backend: False),
               mock.patch.object(fp8_moe, "select_fp8_moe_backend", lambda **kw: (None, None)),
               # the GPU's Triton backend for W4A16 experts (the parameters it loads are every backend's)
               mock.patch.object(wna16_moe, "select_wna16_moe_backend",
                                 lambda **kw: (wna16_moe.WNA16MoEBackend.TRITON, None)),
               # a kernel class by name (the WNA16 scheme logs it), built on the layer's config as any stand-in
               mock.patch.object(wna16, "choose_mp_linear_kernel",
                                 lambda config: type("StubKernel", (mock.MagicMock,), {}))]
    from types import SimpleNamespace

    config = SimpleNamespace(model_config=SimpleNamespace(dtype=torch.bfloat16))  # the model's dtype, as served
    patches.append(mock.patch.object(fp8, "get_current_vllm_config", lambda: config))
    for module in (mxfp4, fp8):
        for name in dir(module):
            if re.match(r"(init|choose|select)_.*kernel", name):
                patches.append(mock.patch.object(module, name, lambda *a, **kw: mock.MagicMock()))
    return patches


def params_of(layer) -> dict:
    return {name: (str(p.dtype).removeprefix("torch."), list(p.shape)) for name, p in layer.named_parameters()}


def linear_layers(stored: dict, fused: dict) -> dict[str, list[str]]:
    """{vLLM layer name: its shards' checkpoint module names} for every non-expert module with a stored weight."""
    modules = sorted({n.rsplit(".", 1)[0] for n in stored if n.rsplit(".", 1)[1] in PARAM_SUFFIXES
                      and len(stored[n][1]) == 2 and not re.search(r"\.experts\.\d+\.", n)})
    shard_of = {shard: (fused_name, shards) for fused_name, shards in fused.items() for shard in shards}
    layers: dict[str, list[str]] = {}
    for module in modules:
        parent, _, leaf = module.rpartition(".")
        if leaf in shard_of:
            fused_name, shards = shard_of[leaf]
            layers[f"{parent}.{fused_name}"] = [f"{parent}.{s}" for s in shards]
        else:
            layers[module] = [module]
    return layers


def out_rows(stored: dict, module: str) -> tuple[int, int]:
    """(out, in) of a module's original weight: its stored `weight`, the values of its `weight_shape` (packed ints)
    or, packed FP4, its `weight_packed` unpacked."""
    if f"{module}.weight" in stored:
        return tuple(stored[f"{module}.weight"][1])
    if f"{module}.weight_shape" in stored:
        return tuple(stored[f"{module}.weight_shape"][2])
    rows, cols = stored[f"{module}.weight_packed"][1]
    return rows, cols * 2  # two FP4 values a byte


def stub(name: str):
    """An empty module of the class vLLM builds for `name` (get_scheme_dict matches targets against the class name):
    VocabParallelEmbedding for the token embedding, ParallelLMHead for the head, a LinearBase otherwise."""
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    base = (VocabParallelEmbedding if name.endswith("embed_tokens") else ParallelLMHead if name.endswith("lm_head")
            else LinearBase)
    cls = type(base.__name__ if base is not LinearBase else "StubLinear", (base,),
               {"__init__": lambda self: torch.nn.Module.__init__(self)})
    return cls()


def check_linear(config, name: str, shards: list[str], stored: dict, problems: list) -> str | None:
    """The scheme of one linear layer (or the embedding, the head), each shard's stored tensors checked against the
    parameters it creates."""
    try:
        parts = config.get_scheme_dict(stub(name), name)
    except ValueError as exc:  # shards of one layer with different schemes
        problems.append(f"{name}: {exc}")
        return "error"
    if parts is None:
        for shard in shards:
            if f"{shard}.weight" not in stored or any(f"{shard}.{s}" in stored for s in PARAM_SUFFIXES[:-1]):
                problems.append(f"{shard}: ignored by the config but not stored as a plain weight")
        return None
    scheme = config._get_scheme_from_parts(parts["weights"], parts["input_activations"],
                                           parts.get("output_activations"), parts.get("format"), layer_name=name)
    for shard in shards:
        out, width = out_rows(stored, shard)
        layer = torch.nn.Module()
        scheme.create_weights(layer=layer, input_size=width, output_partition_sizes=[out], output_size=out,
                              input_size_per_partition=width, params_dtype=torch.bfloat16,
                              weight_loader=lambda *a, **kw: None)
        for param, (dtype, shape) in params_of(layer).items():
            found = stored.get(f"{shard}.{param}")
            if found is None:
                problems.append(f"{shard}.{param}: vLLM's {type(scheme).__name__} creates it, the artifact lacks it")
            elif list(found[1]) != shape or family(found[0]) != family(dtype):
                problems.append(f"{shard}.{param}: stored {found}, vLLM creates {dtype} {shape}")
        for key in [k for k in stored if k.rsplit(".", 1)[0] == shard]:
            # a bias is the linear layer's own parameter, not its scheme's (GLM-4.5's q/k/v biases)
            if key.rsplit(".", 1)[1] not in (*params_of(layer), "bias"):
                problems.append(f"{key}: no parameter of vLLM's {type(scheme).__name__} takes it")
    return type(scheme).__name__


def check_experts(config, layer_name: str, experts: dict, stored: dict, hidden: int, problems: list) -> str | None:
    """The fused-experts method vLLM picks for `layer_name` (`<layer>.mlp.experts`, EXPERTS) and every stored expert
    tensor mapped into its parameters by vLLM's expert-parameter mapping."""
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors_moe import (
        CompressedTensorsMoEMethod,
    )

    layer = RoutedExperts.__new__(RoutedExperts)
    torch.nn.Module.__init__(layer)
    layer.ckpt_gate_proj_name, layer.ckpt_up_proj_name, layer.ckpt_down_proj_name = "gate_proj", "up_proj", "down_proj"
    layer.moe_config = SimpleNamespace(is_act_and_mul=True, w13_num_shards=2, moe_backend="auto", swiglu_limit=None,
                                       has_bias=False)
    with mock.patch.object(FusedMoEMethodBase, "__init__", lambda self, moe: setattr(self, "moe", moe)):
        method = CompressedTensorsMoEMethod.get_moe_method(config, layer, layer_name)
    count = max(experts) + 1
    intermediate = out_rows(stored, f"{layer_name}.0.gate_proj")[0]
    method.create_weights(layer, num_experts=count, hidden_size=hidden, intermediate_size_per_partition=intermediate,
                          params_dtype=torch.bfloat16, weight_loader=lambda *a, **kw: None)
    params = params_of(layer)
    mapping = RoutedExperts.build_expert_params_mapping("gate_proj", "down_proj", "up_proj", count,
                                                        routed_experts_prefix="")
    prefix = layer_name.removesuffix("experts")
    loaded = set()
    for key in sorted(n for e in experts.values() for n in e):
        for param_name, weight_name, expert, shard in mapping:
            if weight_name not in key:
                continue
            param = key.replace(weight_name, param_name).removeprefix(prefix).removeprefix("experts.")
            if param not in params:
                problems.append(f"{key}: vLLM maps it to {param}, which {type(method).__name__} does not create")
                break
            loaded.add(param)
            dtype, shape = params[param]
            want = shape[1:]
            if param.endswith("weight_shape"):  # each expert's [out, in] values, copied whole (_load_single_value)
                if list(stored[key][1]) != want:
                    problems.append(f"{key}: stored {stored[key][:2]}, vLLM's {param} slice is {want}")
                break
            if param.startswith("w13_") and want:
                want = [want[0] // 2, *want[1:]] if len(want) > 1 or shape[-1] != 2 else []
            got = [n for n in stored[key][1] if n != 1] if not want else list(stored[key][1])
            if got != want or family(stored[key][0]) != family(dtype):
                problems.append(f"{key}: stored {stored[key]}, vLLM's {param} slice is {dtype} {want}")
            break
        else:
            problems.append(f"{key}: vLLM's expert mapping does not take it")
    for param in params:
        # NVFP4A16: the method creates the input global scales of W4A4 too, and a weight-only checkpoint has none
        # (llm-compressor's NVFP4A16 artifacts alike); vLLM's loader leaves them unchecked on quantized models
        unused = getattr(method, "use_a16", False) and param.endswith("input_global_scale")
        if param not in loaded and not unused:
            problems.append(f"{layer_name}.{param}: created by {type(method).__name__}, nothing stored loads it")
    return type(method).__name__


def stored_tensors(artifact: str) -> dict[str, tuple]:
    """name -> (torch dtype name, shape) of every tensor of the artifact, from the safetensors headers; a
    `weight_shape` (the original shape of a packed int weight) with its values third."""
    import glob

    from safetensors import safe_open

    dtypes = {"BF16": "bfloat16", "F32": "float32", "F16": "float16", "U8": "uint8", "I8": "int8", "I32": "int32",
              "F8_E4M3": "float8_e4m3fn", "I64": "int64"}
    stored = {}
    for file in sorted(glob.glob(f"{artifact}/*.safetensors")):
        with safe_open(file, "pt") as f:
            for key in f.keys():
                dtype = str(f.get_slice(key).get_dtype())
                stored[key] = (dtypes.get(dtype, dtype), list(f.get_slice(key).get_shape()))
                if key.endswith(".weight_shape"):
                    stored[key] += ([int(n) for n in f.get_tensor(key).tolist()],)
    return stored


def probe(artifact: str) -> dict:
    """The verdicts for one artifact (vLLM's distributed state set up by `main`)."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    with open(f"{artifact}/config.json") as fh:
        hf = json.load(fh)
    stored = stored_tensors(artifact)
    layers = hf["num_hidden_layers"]
    mtp = tuple(f"model.layers.{i}." for i in range(layers, layers + int(hf.get("num_nextn_predict_layers") or 0)))
    main = {k: v for k, v in stored.items() if not k.startswith(mtp)}  # vLLM's main model skips them
    problems: list[str] = []
    config = CompressedTensorsConfig.from_config(hf["quantization_config"])
    config.packed_modules_mapping = dict(FUSED_MOE[hf["model_type"]])
    schemes = {name: check_linear(config, name, shards, main, problems)
               for name, shards in linear_layers(main, config.packed_modules_mapping).items()}
    grouped: dict[str, dict[int, list[str]]] = {}
    for key in main:
        found = re.match(EXPERTS, key)
        if found:
            grouped.setdefault(found.group(1), {}).setdefault(int(found.group(2)), []).append(key)
    methods = {name: check_experts(config, name, experts, main, hf["hidden_size"], problems)
               for name, experts in sorted(grouped.items())}
    # the MTP draft model (DeepSeekMTP) builds the same decoder layer under `model.layers.<i>`, with the same config
    for name in [n for n in stored if n.startswith(mtp) and n.endswith(".weight") and len(stored[n][1]) == 2]:
        module = name.removesuffix(".weight")
        vllm_name = re.sub(r"\.(q_a_proj|kv_a_proj_with_mqa)$", ".fused_qkv_a_proj", module)
        vllm_name = re.sub(r"\.(gate_proj|up_proj)$", ".gate_up_proj", vllm_name)
        if config.get_scheme_dict(stub(vllm_name), vllm_name) is not None:
            problems.append(f"{module}: an MTP layer's linear stored 16-bit, but the config quantizes it")
    return {"schemes": schemes, "moe_methods": methods, "problems": problems}


def main(artifacts: list[str], port: str) -> None:
    """One JSON line per artifact, in order."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    with set_current_vllm_config(VllmConfig()):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"tcp://127.0.0.1:{port}", backend="gloo")
        initialize_model_parallel(1, 1)
        patches = stub_kernels()
        for patch in patches:
            patch.start()
        for artifact in artifacts:
            print(json.dumps({"artifact": artifact, **probe(artifact)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:-1], sys.argv[-1])
