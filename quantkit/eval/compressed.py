"""compressed-tensors checkpoints (fp8, gptq, awq, smoothquant artifacts) streamed a module at a time.

The gate's candidate runs through quantkit.eval.stream like a 16-bit checkpoint: a meta-device model whose
units read their weights from a WeightSource while they run. Two things make it the model
transformers and vLLM run:

- the weights: `CompressedWeights` reads a quantized module's stored tensors (an int4 module's
  weight_packed / weight_scale / weight_shape / weight_zero_point, an fp8 or int8 weight with its
  weight_scale) with plain file reads and decompresses them with compressed-tensors' own compressor
  for the module's format (the classmethod `decompress` that `decompress_module` calls when
  transformers loads the artifact); every other tensor (norms, embeddings, the 16-bit head, static
  activation scales) is read as stored.
- the forward: the meta model gets the artifact's quantization config from compressed-tensors
  (`apply_quantization_config`, as transformers' loader does), so each quantized module runs
  compressed-tensors' quantized forward in the DECOMPRESSED state transformers leaves it in: the
  weight is used as given and the input activations are quantized as the scheme says (per token,
  dynamically, for fp8-dynamic and W8A8; with the stored input_scale for fp8-static). That is what
  `quantkit.formats.compressed_tensors.load` computes, and what vLLM's kernels compute.

Streamed: text decoders (quantkit.eval.stream.streamable without the quantization) whose quantized
modules are Linear layers of the decoder in a format decompressed here (STREAMED_FORMATS), with no
KV-cache or attention quantization, no transforms and no sparsity. The token embedding and the
output head must be unquantized: the stream gathers the embedding's rows and applies the head in
vocabulary slices outside its module's forward. Anything else loads whole (quantkit.eval.artifacts).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from quantkit.engines.llmcompressor.llmc import FORMAT as COMPRESSED_TENSORS
from quantkit.eval.evaluate import Scorer
from quantkit.eval.stream import ACTIVATION_BYTES, StreamedModel, build_meta_model, group_scorer, stream_built
from quantkit.io.checkpoint import SafetensorsWeights

# compressed-tensors formats whose compressor decompresses one module from its own tensors
STREAMED_FORMATS = frozenset({"dense", "naive-quantized", "int-quantized", "float-quantized", "pack-quantized"})


def streamable(config: dict) -> bool:
    """Whether config.json's model and quantization are ones the streamed forward reproduces (the
    modules are checked on the built model: `streams_modules`)."""
    from quantkit.eval import stream

    qconfig = config.get("quantization_config") or {}
    plain = {key: value for key, value in config.items() if key != "quantization_config"}
    return (qconfig.get("quant_method") == COMPRESSED_TENSORS and stream.streamable(plain)
            and not qconfig.get("kv_cache_scheme") and not qconfig.get("transform_config")
            and not qconfig.get("sparsity_config"))


def quantization_config(config: dict):
    """compressed-tensors' QuantizationConfig of config.json, parsed as transformers parses it."""
    from transformers.utils.quantization_config import CompressedTensorsConfig

    return CompressedTensorsConfig.from_dict(config["quantization_config"]).quantization_config


def quantized_meta_model(config, dtype, model=None):
    """The meta-device CausalLM (quantkit.eval.stream.build_meta_model, or `model`: one built so and changed,
    quantkit.eval.experts.linear_experts_model) with the artifact's quantization applied by compressed-tensors
    and every quantized module in the state decompress_module leaves it in: DECOMPRESSED, holding its weight and
    the activations' qparams its forward reads (the weight's own qparams, used only to decompress, are dropped:
    CompressedWeights reads them)."""
    from compressed_tensors.quantization import QuantizationStatus, apply_quantization_config

    model = build_meta_model(config, dtype) if model is None else model
    apply_quantization_config(model, quantization_config(config.to_dict()), run_compressed=False,
                              show_progress=False)
    for module in quantized(model).values():
        for name in [n for n in module._parameters if n.startswith("weight_")]:
            delattr(module, name)
        module.quantization_status = QuantizationStatus.DECOMPRESSED
    return model


def quantized(model) -> dict[str, object]:
    """Module name -> module, for every module the quantization config applies to."""
    from compressed_tensors.quantization.utils import is_module_quantized

    return {name: module for name, module in model.named_modules() if is_module_quantized(module)}


def module_format(module) -> str:
    """The compressed-tensors format a module is stored in: its scheme's, else the one inferred from
    the module and scheme (compressed-tensors' decompress_module takes the same)."""
    from compressed_tensors.compressors.format import infer_module_format

    scheme = module.quantization_scheme
    return str(scheme.format or infer_module_format(type(module), scheme).value)


def streams_modules(model) -> bool:
    """Every quantized module is a Linear of the decoder (so not the token embedding) other than the
    output head, stored in a format decompressed here."""
    import torch

    from quantkit.arch.modules import decoder

    head, body = model.get_output_embeddings(), {id(m) for m in decoder(model).modules()}
    return all(isinstance(m, torch.nn.Linear) and id(m) in body and m is not head
               and module_format(m) in STREAMED_FORMATS for m in quantized(model).values())


def streams(path: Path) -> bool:
    """Whether the gate streams this compressed-tensors artifact (else it loads whole)."""
    import torch

    from quantkit.engines.transformers import hf_config
    from quantkit.io.checkpoint import read_config

    return streamable(read_config(path)) and streams_modules(quantized_meta_model(hf_config(path), torch.float32))


# ------------------------------------------------------------------ the weights


@dataclass(frozen=True)
class CompressedModule:
    """A quantized module as stored: the tensors its compressor decompresses it from."""

    scheme: object  # compressed_tensors QuantizationScheme
    compressor: type  # the compressed_tensors BaseCompressor subclass of its format
    names: dict[str, str]  # local name (weight_packed, weight_scale, ...) -> stored tensor name


def compressed_modules(model) -> dict[str, CompressedModule]:
    """'<module>.weight' -> how that weight is stored, for every quantized module of the model: the
    tensors compressed-tensors' compressor for its format decompresses it from
    (compression_param_names: what transformers' loader builds the module to receive)."""
    from compressed_tensors.compressors import BaseCompressor

    found = {}
    for name, module in quantized(model).items():
        compressor = BaseCompressor.get_value_from_registry(module_format(module))
        locals_ = compressor.compression_param_names(module.quantization_scheme)
        found[f"{name}.weight"] = CompressedModule(module.quantization_scheme, compressor,
                                                   {local: f"{name}.{local}" for local in locals_})
    return found


class CompressedWeights:
    """A WeightSource over a compressed-tensors checkpoint for `model` (quantized_meta_model): a
    quantized module's `weight` decompressed from its stored tensors when asked for, every other
    tensor as stored."""

    def __init__(self, model_dir: Path, model, stored: SafetensorsWeights | None = None):
        self.stored = SafetensorsWeights(model_dir) if stored is None else stored  # its names are the model's
        self.modules = compressed_modules(model)

    def keys(self) -> list[str]:
        """The stored tensors, and the weight of every quantized module all of whose tensors are stored."""
        complete = [name for name, module in self.modules.items()
                    if all(n in self.stored.index for n in module.names.values())]
        return sorted(set(self.stored.index) | set(complete))

    def reads(self, name: str) -> list[str]:
        """The stored tensors `get(name)` reads."""
        module = self.modules.get(name)
        return list(module.names.values()) if module else [name]

    def get(self, name: str) -> "torch.Tensor":  # noqa: F821
        module = self.modules.get(name)
        if module is None:
            return self.stored.get(name)
        state = {local: self.stored.get(stored) for local, stored in module.names.items()}
        return module.compressor.decompress(state, module.scheme)["weight"]

    def shape(self, name: str) -> tuple[int, ...]:
        module = self.modules.get(name)
        if module is None:
            return self.stored.shape(name)
        if "weight_shape" in module.names:  # packed: the original shape is stored beside the words
            return tuple(int(n) for n in self.stored.get(module.names["weight_shape"]).tolist())
        if "weight" not in module.names:  # FP4 (nvfp4, mxfp4): values packed along the row, 8 // bits a byte
            rows, cols = self.stored.shape(module.names["weight_packed"])
            return rows, cols * 8 // module.scheme.weights.num_bits
        return self.stored.shape(module.names["weight"])

    def rows(self, name: str, index) -> "torch.Tensor":  # noqa: F821
        if name in self.modules:  # not streamed (streams_modules): the embedding and head stay 16-bit
            import torch

            return self.get(name)[torch.as_tensor(index)]
        return self.stored.rows(name, index)


def reload_problems(model, source: CompressedWeights) -> dict[str, list[str]]:
    """What transformers' strict reload of the artifact would find (artifacts.check_strict_reload):
    parameters without their stored tensors (a quantized module's weight without every tensor its
    format decompresses from), stored tensors nothing reads (other than buffers and the names the
    model's class ignores on load), tensors of the wrong shape."""
    import re

    from quantkit.engines.transformers import tied_groups

    stored = source.stored.index
    params = dict(model.named_parameters(remove_duplicate=False))
    missing, read, mismatched = [], {name for name, _ in model.named_buffers()}, []
    for group in tied_groups(model):
        needed = {name: source.reads(name) for name in group}
        present = [name for name, reads in needed.items() if all(n in stored for n in reads)]
        read |= {n for reads in needed.values() for n in reads if n in stored}
        if not present:
            missing += sorted({n for reads in needed.values() for n in reads if n not in stored})
        elif tuple(source.shape(present[0])) != tuple(params[present[0]].shape):
            mismatched.append(present[0])
    ignored = [re.compile(p) for p in model._keys_to_ignore_on_load_unexpected or ()]
    unexpected = [n for n in stored if n not in read and not any(p.search(n) for p in ignored)]
    return {"missing_keys": missing, "unexpected_keys": unexpected, "mismatched_keys": mismatched}


# ------------------------------------------------------------------ the scorer


def compressed_open(path: Path, config, dtype) -> tuple[object, CompressedWeights]:
    """The artifact's model on the meta device and the source of its weights (decompressed a module at
    a time); ArtifactReloadError (exit 3) when the checkpoint does not reload strictly."""
    from quantkit.eval.artifacts import check_strict_reload

    model = quantized_meta_model(config, dtype)
    source = CompressedWeights(path, model)
    check_strict_reload(path, reload_problems(model, source))
    return model, source


def compressed_model(path: Path, config, dtype, device) -> StreamedModel:
    """The artifact's model on the meta device, its weights streamed from `path` (compressed_open)."""
    model, source = compressed_open(path, config, dtype)
    return stream_built(model, config, source, device)


def compressed_scorer(path: Path, device: str = "cpu", activation_bytes: int = ACTIVATION_BYTES) -> Scorer:
    """A compressed-tensors artifact streamed a module at a time, in its stored dtype (as
    from_pretrained loads it), each quantized module decompressed while it runs."""
    from quantkit.engines.transformers import device_map, hf_config, torch_dtype
    from quantkit.io.checkpoint import check_model_dir

    config = hf_config(path)  # streamed only without trust_remote_code
    dtype = torch_dtype("auto", check_model_dir(path))

    def make() -> StreamedModel:
        return compressed_model(path, config, dtype, device_map(device))

    return group_scorer(make, config.get_text_config(), activation_bytes)
