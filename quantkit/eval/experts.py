"""The gate's reading of a mixture-of-experts compressed-tensors artifact: each expert decompressed by
compressed-tensors' own compressor and stacked into transformers' fused experts.

transformers 5 loads an MoE checkpoint's per-expert projections into one tensor per layer
(`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`: quantkit.arch.moe.ExpertCheckpoint) and, for a
compressed-tensors artifact, decompresses the experts on the way (its DecompressExperts): an fp8 weight times a
per-channel scale, or an int-packed weight. It cannot reload the experts of fp8-block (the 128x128 block scale does
not broadcast over the weight: the load fails), of NVFP4 (the global scale is left unread: the experts come out
wrong with only a warning) or of MXFP4. So quantkit reads such an artifact itself, as it reads a dense one
(quantkit.eval.compressed):

- every quantized module's weight, an expert's included, is decompressed from its stored tensors by the
  compressor of its format (the expert's scheme is the config group whose targets and ignore list take its name,
  as vLLM and compressed-tensors match names); an expert's gate/up/down weights are stacked as transformers'
  conversion stacks them (FusedExperts);
- the non-expert Linear modules run compressed-tensors' quantized forward (quantized_meta_model): fp8-block's
  input activations are quantized per token and group of 128 there, as vLLM's kernels do. The fused experts are
  not Linear modules: they run on the decompressed weights with 16-bit inputs, which is exactly what vLLM computes
  for the weight-only formats (nvfp4 a16, mxfp4) and leaves out fp8-block's activation rounding inside the
  experts (the gate's numbers there are the weights' error alone);
- stored persistent buffers (DeepSeek-V3's `e_score_correction_bias`) are read into the model, which the stream
  otherwise computes; the multi-token-prediction layers after the decoder's are stored but not read (transformers'
  model has none).

The model is streamed a unit at a time (a layer's fused experts are one unit) or resident, like any reading
(quantkit.eval.scorers.reading_scorer); the strict-reload check is the dense one's.

An MLX mixture of experts is read the same way (mlx_open): its stacked experts given back under the checkpoint's
per-expert names (quantkit.mlx.checkpoint.MLXWeights), renamed as llm-compressor's linear experts name them.
"""

from __future__ import annotations

import re
from pathlib import Path

from quantkit.engines.llmcompressor.llmc import FORMAT as COMPRESSED_TENSORS
from quantkit.eval.stream import Reading

# formats decompressed here: the dense reading's (quantkit.eval.compressed.STREAMED_FORMATS) and the FP4 ones
FORMATS = frozenset({"dense", "naive-quantized", "int-quantized", "float-quantized", "pack-quantized",
                     "nvfp4-pack-quantized", "mxfp4-pack-quantized"})


def text_model_type(config: dict) -> str:
    """The model_type of a config's text model (a VLM's text_config's, else its own)."""
    text = config.get("text_config") or config
    return text.get("model_type", config.get("model_type", ""))


def layout_of(config: dict):
    """The expert layout (quantkit.arch.moe.ExpertCheckpoint) of an MoE config transformers stacks as expected,
    None otherwise."""
    from quantkit.arch import moe

    layout = moe.expert_checkpoint(text_model_type(config))
    return layout if layout is not None and moe.expert_count(config) and fuses_experts(config) else None


def fuses_experts(config: dict) -> bool:
    """transformers' loading conversion for this model type is exactly the per-expert stacking FusedExperts does
    (its `qwen2_moe` pattern: gate and up concatenated per expert, then every expert stacked)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter

    found = get_checkpoint_conversion_mapping(config.get("model_type", "")) or []
    pairs = sorted((tuple(c.source_patterns), tuple(c.target_patterns)) for c in found
                   if isinstance(c, WeightConverter))
    return len(found) == len(pairs) == 2 and pairs == [
        (("mlp.experts.*.down_proj.weight",), ("mlp.experts.down_proj",)),
        (("mlp.experts.*.gate_proj.weight", "mlp.experts.*.up_proj.weight"), ("mlp.experts.gate_up_proj",)),
    ]


# transformers' loading conversion of an MoE family that stacks its experts: each layer's per-expert gate and up
# projections stacked and concatenated along the rows, and its down projections stacked (MergeModulelist dim 0,
# Concatenate dim 1), as FusedExperts stacks them
STACKING = {"gate_up_proj": [("MergeModulelist", {"dim": 0}), ("Concatenate", {"dim": 1})],
            "down_proj": [("MergeModulelist", {"dim": 0})]}


def stacks_experts(config: dict) -> bool:
    """Whether transformers' loading conversion for this MoE config renames tensors (its WeightRenaming rows) and
    stacks the experts as STACKING says, and does nothing else: its per-expert sources the family's expert
    projections (quantkit.arch.moe.moe_layout's expert_names: Mixtral's w1 / w3 for gate and up, w2 for down), gate
    before up. Such a checkpoint reads as transformers' model by RenamedWeights and then FusedExperts."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    from quantkit.arch.moe import moe_layout

    layout = moe_layout(config)
    if layout is None:
        return False
    stored = [layout.expert_names.get(p, p) for p in ("gate_proj", "up_proj", "down_proj")]
    expected = {"gate_up_proj": stored[:2], "down_proj": stored[2:]}
    rows = get_checkpoint_conversion_mapping(text_model_type(config)) or []
    found = {}
    for row in (r for r in rows if not isinstance(r, WeightRenaming)):
        target = "".join(row.target_patterns).rsplit(".", 1)[-1]
        sources = [re.fullmatch(r".*experts\.\*\.(\w+)\.weight", p) for p in row.source_patterns]
        operations = [(type(o).__name__, {k: getattr(o, k, None) for k in ("dim",)}) for o in row.operations]
        if (target not in expected or not all(sources) or [m.group(1) for m in sources] != expected[target]
                or operations != STACKING[target]):
            return False
        found[target] = True
    return sorted(found) == sorted(expected)


def reads(path: Path) -> bool:
    """Whether the gate reads this compressed-tensors artifact here: an MoE text decoder of a family with an expert
    layout row, no KV-cache scheme, transforms or sparsity, every config group in a format decompressed here."""
    from quantkit.arch.vlm import is_vlm
    from quantkit.io.checkpoint import read_config

    config = read_config(path)
    qconfig = config.get("quantization_config") or {}
    groups = (qconfig.get("config_groups") or {}).values()
    return (qconfig.get("quant_method") == COMPRESSED_TENSORS and not is_vlm(config)
            and (moe_layout(config) is not None or layout_of(config) is not None) and not config.get("auto_map")
            and not qconfig.get("kv_cache_scheme") and not qconfig.get("transform_config")
            and not qconfig.get("sparsity_config")
            and all((g.get("format") or qconfig.get("format")) in FORMATS for g in groups))


def expert_modules(qconfig, names) -> dict:
    """'<expert projection>.weight' -> quantkit.eval.compressed.CompressedModule for every expert projection module
    in `names` (stored tensor names) a config group quantizes: the first group whose targets take it (`Linear`, or
    its name) and whose ignore list does not (compressed-tensors' match_name: exact or `re:`)."""
    import torch
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.compressors.format import infer_module_format
    from compressed_tensors.utils.match import match_name

    from quantkit.eval.compressed import CompressedModule

    modules = sorted({n.rsplit(".", 1)[0] for n in names if re.search(r"\.experts\.\d+\.[^.]+\.[^.]+$", n)})
    found = {}
    for module in modules:
        if any(match_name(module, target) for target in qconfig.ignore or []):
            continue
        for scheme in qconfig.config_groups.values():
            if "Linear" in scheme.targets or any(match_name(module, t) for t in scheme.targets):
                fmt = scheme.format or qconfig.format or infer_module_format(torch.nn.Linear, scheme).value
                compressor = BaseCompressor.get_value_from_registry(fmt)
                found[f"{module}.weight"] = CompressedModule(
                    scheme, compressor, {local: f"{module}.{local}" for local in compressor.compression_param_names(scheme)})
                break
    return found


class FusedExperts:
    """A WeightSource for the model transformers builds over one that holds each expert's weights apart (a 16-bit
    checkpoint, or a compressed-tensors artifact decompressed a module at a time: compressed_experts): every
    `<experts>.gate_up_proj` stacked from each expert's gate and up rows ([experts, 2 x intermediate, hidden])
    and `<experts>.down_proj` from each expert's down ([experts, hidden, intermediate]), as transformers' loading
    conversion stacks them; everything else as the source gives it."""

    def __init__(self, weights, layout):
        self.weights = weights
        self.stored = getattr(weights, "stored", weights)  # what reload_problems reads the stored names from
        gate, up, down = layout.projections
        experts: dict[str, set[int]] = {}  # '<layer>.mlp.experts' -> the expert numbers stored
        for name in weights.keys():
            found = re.fullmatch(rf"(.*\.mlp\.experts)\.(\d+)\.({gate}|{up}|{down})\.weight", name)
            if found:
                experts.setdefault(found.group(1), set()).add(int(found.group(2)))
        self.fused: dict[str, list[list[str]]] = {}  # fused parameter -> per expert, the weights stacked into it
        for prefix, numbers in experts.items():
            count = max(numbers) + 1
            self.fused[f"{prefix}.gate_up_proj"] = [[f"{prefix}.{e}.{gate}.weight", f"{prefix}.{e}.{up}.weight"]
                                                    for e in range(count)]
            self.fused[f"{prefix}.down_proj"] = [[f"{prefix}.{e}.{down}.weight"] for e in range(count)]
        self.parts = {n for rows in self.fused.values() for row in rows for n in row}

    def keys(self) -> list[str]:
        available = set(self.weights.keys())
        complete = [name for name, rows in self.fused.items() if all(n in available for row in rows for n in row)]
        return sorted((available - self.parts) | set(complete))

    def reads(self, name: str) -> list[str]:
        """The stored tensors `get(name)` reads."""
        own = getattr(self.weights, "reads", lambda n: [n])
        if name in self.fused:
            return [s for row in self.fused[name] for n in row for s in own(n)]
        return own(name)

    def get(self, name: str):
        import torch

        if name not in self.fused:
            return self.weights.get(name)
        return torch.stack([torch.cat([self.weights.get(n) for n in row]) for row in self.fused[name]])

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.fused:
            return self.weights.shape(name)
        rows = self.fused[name]
        first = [self.weights.shape(n) for n in rows[0]]
        return (len(rows), sum(s[0] for s in first), *first[0][1:])

    def rows(self, name: str, index):
        return self.weights.rows(name, index)


def compressed_experts(model_dir: Path, model, qconfig):
    """quantkit.eval.compressed.CompressedWeights over an MoE artifact for `model` (quantized_meta_model), every
    expert projection the config quantizes decompressed too (expert_modules)."""
    from quantkit.eval.compressed import CompressedWeights

    weights = CompressedWeights(model_dir, model)
    weights.modules.update(expert_modules(qconfig, weights.stored.index))
    return weights


def load_buffers(model, source) -> None:
    """The model's persistent buffers that the checkpoint stores (DeepSeek-V3's router correction bias), read into
    it as from_pretrained loads them: in float32 where the model class keeps them so
    (`_keep_in_fp32_modules_strict`, `_keep_in_fp32_modules`), else in the buffer's dtype."""
    import torch
    from accelerate.utils import set_module_tensor_to_device

    keep = [*(getattr(model, "_keep_in_fp32_modules_strict", None) or []),
            *(getattr(model, "_keep_in_fp32_modules", None) or [])]
    available = set(source.keys())
    for name, buffer in list(model.named_buffers()):
        if name in available:
            dtype = torch.float32 if any(k in name.split(".") for k in keep) else buffer.dtype
            set_module_tensor_to_device(model, name, buffer.device, value=source.get(name).to(dtype), dtype=dtype)


def experts_open(path: Path, config, dtype):
    """The artifact's model on the meta device (compressed-tensors' quantization applied to its Linear modules) and
    the source of its weights; ArtifactReloadError (exit 3) when the checkpoint does not reload strictly (the MTP
    layers aside)."""
    from quantkit.arch import moe
    from quantkit.eval.artifacts import check_strict_reload
    from quantkit.eval.compressed import quantization_config, quantized_meta_model, reload_problems

    model = quantized_meta_model(config, dtype)
    layout = layout_of(config.to_dict())
    source = FusedExperts(compressed_experts(path, model, quantization_config(config.to_dict())), layout)
    problems = reload_problems(model, source)
    mtp = tuple(moe.mtp_prefixes(config.to_dict(), source.stored.index, layout))
    problems["unexpected_keys"] = [n for n in problems["unexpected_keys"] if not n.startswith(mtp)]
    check_strict_reload(path, problems)
    load_buffers(model, source)
    return model, source


def experts_reading(path: Path) -> Reading:
    """An MoE compressed-tensors artifact read by quantkit (`reads`), in its stored dtype: with linear experts where
    llm-compressor's methods write the family (its record's `moe`), else stacked into the fused experts."""
    from quantkit.engines.transformers import hf_config, torch_dtype
    from quantkit.io.checkpoint import check_model_dir

    config = hf_config(path)
    dtype = torch_dtype("auto", check_model_dir(path))
    layout = moe_layout(config.to_dict())
    if layout is not None:
        return Reading(config, lambda: linear_open(path, config, dtype, layout))
    return Reading(config, lambda: experts_open(path, config, dtype))


# ---------------------------------------------------------------- linear experts: each expert its own quantized Linears


def moe_layout(config: dict):
    """The family's expert layout for llm-compressor's methods (quantkit.arch.moe.moe_layout: a record's `moe`),
    None for a dense model."""
    from quantkit.arch import moe

    return moe.moe_layout(config)


def mlx_expert_layout(config: dict):
    """The expert layout an MLX artifact is read by: moe_layout, None where the family's mlx-lm model cuts its
    experts from fused checkpoint tensors (MlxExperts.fused: Granite 4 MoE), which the MLX reading gives back fused
    for transformers' own experts module."""
    from quantkit.arch.families import by_model_type

    family = by_model_type(text_model_type(config))
    fused = family is not None and family.mlx_experts is not None and bool(family.mlx_experts.fused)
    return None if fused else moe_layout(config)


def load_named(weights, model_type: str):
    """`weights` by the names of transformers' model where its loading conversion renames checkpoint tensors
    (RenamedWeights: Granite 4 MoE's block_sparse_moe.input_linear.weight -> block_sparse_moe.experts.gate_up_proj);
    as they are where it renames none."""
    from quantkit.arch.moe import load_renamings

    return RenamedWeights(weights, None, model_type) if load_renamings(model_type) else weights


def linear_experts_model(config, dtype):
    """The meta-device CausalLM with every fused-experts module replaced by llm-compressor's linear experts (one
    Linear per expert projection, LinearExperts2D: what llm-compressor calibrates and saves), so that compressed-
    tensors' quantization applies to each expert's projections as to any Linear: each runs its scheme's quantized
    forward, its input activations quantized as the scheme says (per token for fp8-dynamic and W8A8, with the
    static scale for fp8-static, per group for fp8-block), as vLLM's fused-MoE kernels quantize them."""
    import torch
    from llmcompressor.modeling.moe.linearize import get_non_linearized_moes

    from quantkit.arch.moe import linear_experts, moe_layout
    from quantkit.eval.stream import build_meta_model

    model = build_meta_model(config, dtype)
    layout = moe_layout(config.to_dict())
    for name, module in get_non_linearized_moes(model):
        with torch.device("meta"):
            model.set_submodule(name, linear_experts(module, model.config, layout, copy=False).to(dtype))
    return model


def model_name(stored: str, layout, renamings) -> str:
    """A stored tensor's name in the linear-experts model: renamed as transformers renames it on load (`renamings`,
    quantkit.arch.moe.load_renamings: Mixtral's block_sparse_moe -> mlp, ERNIE 4.5's moe_statics under the router),
    each expert projection under llm-compressor's linear name (w1 -> gate_proj)."""
    for renaming in renamings:
        stored, _matched = renaming.rename_source_key(stored)
    for linear, name in layout.expert_names.items() if layout is not None else ():
        stored = re.sub(rf"\.experts\.(\d+)\.{name}\.", rf".experts.\1.{linear}.", stored)
    return stored


class RenamedWeights:
    """A WeightSource's tensors (stored names) by the names of the linear-experts model (`model_name`; `layout`
    None: of transformers' model, renamed as it renames them on load)."""

    def __init__(self, weights, layout, model_type: str):
        from quantkit.arch.moe import load_renamings

        renamings = load_renamings(model_type)
        self.weights = weights
        self.names = {model_name(n, layout, renamings): n for n in weights.keys()}

    def keys(self) -> list[str]:
        return list(self.names)

    def get(self, name: str):
        return self.weights.get(self.names[name])

    def shape(self, name: str) -> tuple[int, ...]:
        return self.weights.shape(self.names[name])

    def rows(self, name: str, index):
        return self.weights.rows(self.names[name], index)


class ModelNamed(RenamedWeights):
    """The tensors of a checkpoint by the names of the linear-experts model, read one at a time; `index` their
    stored entries by those names (what quantkit.eval.compressed.CompressedWeights reads)."""

    def __init__(self, model_dir: Path, layout, model_type: str):
        from quantkit.io.checkpoint import SafetensorsWeights

        super().__init__(SafetensorsWeights(model_dir), layout, model_type)
        self.index = {name: self.weights.index[stored] for name, stored in self.names.items()}


def mlx_open(weights, config, dtype):
    """An mlx-lm directory's model on the meta device and the source of its weights (`weights`:
    quantkit.mlx.checkpoint.MLXWeights, which gives stacked experts back under the checkpoint's per-expert names): a
    mixture of experts (a family with an expert layout) as llm-compressor's linear experts, the names renamed as
    the model names them (RenamedWeights), its stored buffers read in; any other model as transformers builds it,
    the names renamed as its loading renames them (load_named: Granite 4 MoE's fused experts)."""
    from quantkit.eval.stream import build_meta_model

    layout = mlx_expert_layout(config.to_dict())
    if layout is None:
        return build_meta_model(config, dtype), load_named(weights, text_model_type(config.to_dict()))
    model = linear_experts_model(config, dtype)
    source = RenamedWeights(weights, layout, text_model_type(config.to_dict()))
    load_buffers(model, source)
    return model, source


# an expert projection's static input scale: vLLM's fused MoE keeps one per layer for gate/up (w13) and one for down
# (w2), the largest over the experts (process_fp8_input_tensor_strategy_moe)
EXPERT_INPUT_SCALE = re.compile(r"(.*\.experts)\.\d+\.(gate_proj|up_proj|down_proj)\.input_scale$")


class SharedInputScales:
    """A WeightSource whose experts' static input scales are those vLLM computes with: for each layer, the largest
    over its experts of the gate and up projections' (w13) and of the down projections' (w2); every other tensor
    as `weights` gives it."""

    def __init__(self, weights):
        self.weights, self.stored, self.modules = weights, weights.stored, getattr(weights, "modules", {})
        self.shared: dict[str, list[str]] = {}  # an expert's input_scale -> the scales it shares the maximum of
        for name in weights.keys():
            found = EXPERT_INPUT_SCALE.fullmatch(name)
            if found:
                self.shared.setdefault((found.group(1), found.group(2) == "down_proj"), []).append(name)
        self.groups = {name: names for names in self.shared.values() for name in names}

    def keys(self) -> list[str]:
        return self.weights.keys()

    def reads(self, name: str) -> list[str]:
        return getattr(self.weights, "reads", lambda n: [n])(name)

    def get(self, name: str):
        import torch

        if name not in self.groups:
            return self.weights.get(name)
        scales = [self.weights.get(n) for n in self.groups[name]]
        return torch.stack([s.reshape(-1) for s in scales]).amax(dim=0).reshape(scales[0].shape).to(scales[0].dtype)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.weights.shape(name)

    def rows(self, name: str, index):
        return self.weights.rows(name, index)


# an expert's gate or up projection (w1 / w3 of vLLM's w13)
EXPERT_GATE_UP = re.compile(r"(.*\.experts\.\d+)\.(gate_proj|up_proj)\.weight$")


class RequantizedGateUp:
    """A WeightSource whose experts' per-tensor fp8 gate and up weights are those vLLM computes with: its fused-MoE
    fp8 kernel takes one weight scale per expert for gate and up together (w13), so each is dequantized with its own
    scale and quantized again with the larger of the two (process_fp8_weight_tensor_strategy_moe:
    per_tensor_dequantize, then scaled_fp8_quant, which multiplies by the scale's float32 inverse); every other
    tensor as `weights` gives it."""

    def __init__(self, weights):
        self.weights, self.stored, self.modules = weights, weights.stored, getattr(weights, "modules", {})
        self.partner: dict[str, str] = {}  # a per-tensor fp8 gate/up weight -> the other one of its expert
        for name, module in self.modules.items():
            found = EXPERT_GATE_UP.fullmatch(name)
            if found and module.scheme.weights is not None and module.scheme.weights.strategy == "tensor" \
                    and module.scheme.weights.type == "float":
                other = "up_proj" if found.group(2) == "gate_proj" else "gate_proj"
                self.partner[name] = f"{found.group(1)}.{other}.weight"

    def keys(self) -> list[str]:
        return self.weights.keys()

    def reads(self, name: str) -> list[str]:
        own = getattr(self.weights, "reads", lambda n: [n])
        return own(name) + ([f"{self.partner[name]}_scale"] if name in self.partner else [])

    def get(self, name: str):
        import torch

        if name not in self.partner:
            return self.weights.get(name)
        stored_scale = self.stored.get(f"{name}_scale")
        scale = stored_scale.float().reshape(())
        larger = torch.maximum(scale, self.stored.get(f"{self.partner[name]}_scale").float().reshape(()))
        values = self.stored.get(name).to(torch.float16) * scale
        requantized = (values * (1.0 / larger)).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
        # in the dtype compressed-tensors decompresses to: its scale's (0.19 dequantize: dtype = scale.dtype)
        return (requantized.float() * larger).to(stored_scale.dtype)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.weights.shape(name)

    def rows(self, name: str, index):
        return self.weights.rows(name, index)


def linear_open(path: Path, config, dtype, layout):
    """The artifact's linear-experts model on the meta device with compressed-tensors' quantization applied, and the
    source of its weights (each module decompressed as it runs; the experts' static input scales shared and their
    per-tensor fp8 gate/up weights requantized as vLLM does); ArtifactReloadError (exit 3) when the checkpoint does
    not reload strictly (the MTP layers aside)."""
    from quantkit.eval.artifacts import check_strict_reload
    from quantkit.eval.compressed import CompressedWeights, quantized_meta_model, reload_problems

    model = quantized_meta_model(config, dtype, linear_experts_model(config, dtype))
    weights = CompressedWeights(path, model, ModelNamed(path, layout, text_model_type(config.to_dict())))
    source = SharedInputScales(RequantizedGateUp(weights))
    problems = reload_problems(model, source)
    checkpoint = layout_of(config.to_dict())
    if checkpoint is not None:
        from quantkit.arch import moe

        mtp = tuple(moe.mtp_prefixes(config.to_dict(), source.stored.index, checkpoint))
        problems["unexpected_keys"] = [n for n in problems["unexpected_keys"] if not n.startswith(mtp)]
    check_strict_reload(path, problems)
    load_buffers(model, source)
    return model, source


def reads_base(config: dict) -> bool:
    """Whether the gate reads this full-precision checkpoint here (its baseline streamed like a dense model's): an
    MoE text decoder of a family with an expert layout row, unquantized, no custom code."""
    from quantkit.arch.vlm import is_vlm

    return ("quantization_config" not in config and not is_vlm(config) and not config.get("auto_map")
            and layout_of(config) is not None)


def base_open(model_dir: Path, config, dtype):
    from quantkit.eval.stream import build_meta_model
    from quantkit.io.checkpoint import SafetensorsWeights

    model = build_meta_model(config, dtype)
    source = FusedExperts(SafetensorsWeights(model_dir), layout_of(config.to_dict()))
    load_buffers(model, source)
    return model, source


def base_reading(model_dir: Path, dtype: str = "auto") -> Reading:
    """A full-precision MoE checkpoint (`reads_base`) read by quantkit, in `dtype` ('auto': as stored)."""
    from quantkit.engines.transformers import hf_config, torch_dtype
    from quantkit.io.checkpoint import check_model_dir

    config = hf_config(model_dir)
    resolved = torch_dtype(dtype, check_model_dir(Path(model_dir)))
    return Reading(config, lambda: base_open(Path(model_dir), config, resolved))
