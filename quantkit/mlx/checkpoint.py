"""MLX model directories as mlx-lm loads them: which modules are quantized, config.json's
`quantization` block, writing the safetensors, and reading the weights back dequantized.

mlx-lm (mlx_lm.utils.load_model) builds the model from config.json, and for each module whose path
is a key of config["quantization"] uses that entry ({"group_size", "bits", "mode"}, or false: kept
16-bit); any other module with a `<path>.scales` tensor gets the top-level group size and bits. A
quantized module stores `<path>.weight` (uint32, the packed integers), `<path>.scales` and
`<path>.biases` (quantkit.mlx.affine). mlx_lm.convert quantizes every Linear and Embedding whose
input width the group size divides (the token embedding and the output head included); quantkit
writes the same modules, so the file sizes compare, and names every module that differs from the
top-level precision, as mlx_lm.convert does for its mixed recipes.

The families written are those whose mlx-lm model takes the Hugging Face tensor names as they are
(its `sanitize` only drops rotary buffers and a tied head): MLX_MODEL_TYPES; a family whose mlx-lm model holds the
text checkpoint under other names or values (its record's `mlx_layout`: Qwen3.5 and Qwen3.5-MoE, whose text model
mlx-lm's qwen3_5 and qwen3_5_moe hold under language_model.; Qwen3-Next, whose norms and conv1d mlx-lm's qwen3_next
changes) is written as mlx_lm.convert writes that model: its config.json nesting the checkpoint's as text_config
(where the layout is `nested`), the names and values as its `sanitize` makes them (which then leaves them as they
are), the tensors it drops not written; MLXWeights reads them back under the checkpoint's names and values.

A mixture of experts is written as that model's `sanitize` stacks a 16-bit one (the family record's `mlx_experts`:
expert_stacks): each routed projection one `<block>.switch_mlp.<projection>` module of [experts, out, in], quantized
expert by expert along its last axis (packed weight [experts, out, in * bits / 32], scales and biases [experts, out,
in / group_size]), as mlx_lm.convert writes it (its QuantizedSwitchLinear); `sanitize` leaves stacked tensors as
they are. The routers stay 16-bit (their entry false), where mlx_lm.convert quantizes them; the
multi-token-prediction layers after the decoder's are not written (mtp_layers). MLXWeights reads the stacked modules
back under the checkpoint's per-expert names. Experts the checkpoint stores fused across experts (the record's
`mlx_experts.fused`: GPT-OSS's gate_up_proj, interleaved, with biases; Llama 4's, gate then up) are cut into the
SwitchGLU's projections (written_fused), the form that model's sanitize leaves as it is, and read back joined
(fused_sources, joined_fused).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from quantkit.arch.families import FAMILIES, of_config
from quantkit.arch.moe import EXPERT_TENSOR, mtp_prefixes
from quantkit.errors import ModelError

# config.json model_type -> the mlx_lm.models module that loads it, with the Hugging Face names as stored and a
# mixture's experts stacked (expert_stacks) (each family record's `mlx`: quantkit.arch.families)
MLX_MODEL_TYPES = {f.model_type: f.mlx for f in FAMILIES if f.mlx}
MODE = "affine"
SHARD_BYTES = 512 * 1024 ** 2  # data bytes held before a shard is written (mlx_lm loads model*.safetensors)
QUANTIZED_ROLES = ("decoder", "other", "lm_head", "embeddings")


@dataclass(frozen=True)
class Precision:
    bits: int
    group_size: int

    def entry(self) -> dict:
        return {"group_size": self.group_size, "bits": self.bits, "mode": MODE}


def quantization_block(default: Precision, layers: dict[str, Precision | None]) -> dict:
    """config.json's `quantization` (and `quantization_config`, as mlx_lm writes both): the top-level
    precision, and an entry for every module whose precision differs from it (None: kept 16-bit)."""
    block = default.entry()
    for name, precision in sorted(layers.items()):
        if precision != default:
            block[name] = precision.entry() if precision else False
    return block


def module_precision(config: dict, module: str) -> Precision | None:
    """A module's precision as mlx-lm reads config.json (its own entry, else the top level)."""
    block = config.get("quantization") or {}
    entry = block.get(module, block)
    if entry is False:
        return None
    return Precision(int(entry["bits"]), int(entry["group_size"]))


def mlx_config(config: dict, block: dict) -> dict:
    """config.json of the artifact: the checkpoint's, the quantization block (under both names, as mlx_lm writes
    it), and the fields mlx-lm's model arguments read where transformers 5 nests or derives them
    (mlx_lm_fields); transformers' encoded infinities ({"__float__": "Infinity"}: Granite 4's time_step_limit)
    as the floats json reads back (mlx-lm reads config.json with json.load)."""
    from transformers import PreTrainedConfig

    config = PreTrainedConfig._decode_special_floats(config)
    family = of_config(config)
    if family is not None and family.mlx_layout is not None and family.mlx_layout.nested:  # as its text_config
        return {"model_type": family.mlx, "text_config": {**config, **mlx_lm_fields(config)},
                **{k: config[k] for k in LAYOUT_TOP_LEVEL if k in config}, "quantization": block,
                "quantization_config": block}
    return {**config, **mlx_lm_fields(config), "quantization": block, "quantization_config": block}


LAYOUT_TOP_LEVEL = ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")  # what mlx_lm.load and
# transformers' VLM config read at the top level beside text_config


MLX_LM_ROPE_SCALINGS = ("llama3", "longrope")  # scalings mlx-lm reads as rope_parameters state them (Llama 3.1's and
# Phi-3's logits then follow transformers'; mlx-lm applies Phi-3's long factors at every length, as its own
# conversions do, where transformers applies the short ones below the original context)


def mlx_lm_fields(config: dict) -> dict:
    """What mlx-lm (0.32) reads at the top level of config.json that a transformers 5 config keeps elsewhere
    (derived_mlx_lm_fields), where the config does not have it already (those are kept as they are). Without
    them mlx-lm builds the model with its own defaults (RoPE base 10000, no llama3 scaling, a sliding pattern of
    6): other logits, or an error."""
    return {k: v for k, v in derived_mlx_lm_fields(config).items() if config.get(k) is None}


def derived_mlx_lm_fields(config: dict) -> dict:
    """`rope_theta` and a llama3 or longrope `rope_scaling` from `rope_parameters` (per attention type for
    Gemma 3, whose sliding layers' base is `rope_local_base_freq`), Gemma 3's `sliding_window_pattern` from
    `layer_types`; then the family's own (its record's `mlx_fields`)."""
    rope = config.get("rope_parameters") or {}
    full, local = (rope.get("full_attention"), rope.get("sliding_attention")) if "full_attention" in rope \
        else (rope, None)
    fields = {}
    if full and "rope_theta" in full:
        fields["rope_theta"] = full["rope_theta"]
    if full and full.get("rope_type") in MLX_LM_ROPE_SCALINGS:
        scaling = {k: v for k, v in full.items() if k != "rope_theta"}
        fields["rope_scaling"] = {**scaling, "type": scaling["rope_type"]}  # Phi-3's model reads "type"
    if local and "rope_theta" in local:
        fields["rope_local_base_freq"] = local["rope_theta"]
    layer_types = config.get("layer_types") or []
    if "full_attention" in layer_types and "sliding_attention" in layer_types:
        fields["sliding_window_pattern"] = layer_types.index("full_attention") + 1
    family = of_config(config)
    if family is not None and family.mlx_fields is not None:  # the family's own (Hunyuan's NTK alpha)
        fields.update(family.mlx_fields(config))
    return fields


def as_mlx_lm_rotates(config: dict) -> dict:
    """config.json with its RoPE as mlx-lm computes it: mlx-lm's SuScaledRoPE applies a longrope scaling's long
    factors at every length, where transformers applies the short ones within original_max_position_embeddings
    (Phi-3's), so the reading takes the long factors for both; any other config as it is."""
    rope = config.get("rope_parameters") or {}
    if rope.get("rope_type") != "longrope" or "long_factor" not in rope:
        return config
    return {**config, "rope_parameters": {**rope, "short_factor": rope["long_factor"]}}


def without_mlx_lm_fields(config: dict) -> dict:
    """config.json as the checkpoint had it: the fields mlx_lm_fields derives (from rope_parameters and
    layer_types, which it leaves as they are) taken out where they hold the derived values, so transformers
    reads its own rope_parameters and layer_types alone."""
    derived = derived_mlx_lm_fields(config)
    return {k: v for k, v in config.items() if not (k in derived and derived[k] == v)}


# ------------------------------------------------------------------ stacked experts


def expert_stacks(config: dict, names) -> dict[str, list[str]]:
    """{SwitchGLU module: the checkpoint's per-expert weights stacked into it, in expert order} of the routed
    experts among `names` (tensor names), as the family's mlx-lm model stacks them (its record's `mlx_experts`);
    {} for a dense family. Those its layout drops are none (Qwen3.5-MoE's MTP layer's experts)."""
    family = of_config(config)
    if family is None or family.mlx_experts is None:
        return {}
    found: dict[str, dict[int, str]] = {}
    for name in names:
        if (m := EXPERT_TENSOR.match(name)) is not None and written_name(config, name) is not None:
            projection = family.mlx_experts.renames.get(m["projection"], m["projection"])
            found.setdefault(f"{m['layer']}switch_mlp.{projection}", {})[int(m["expert"])] = name
    return {module: [experts[e] for e in sorted(experts)] for module, experts in sorted(found.items())}


def mtp_layers(config: dict, names) -> tuple[str, ...]:
    """The `model.layers.<i>.` prefixes of the multi-token-prediction layers the checkpoint stores
    (quantkit.arch.moe.mtp_prefixes): not written, as mlx-lm's models have none (glm4_moe's and deepseek_v3's
    sanitize drop them)."""
    family = of_config(config)
    layout = family.experts_by_name if family is not None else None
    return tuple(mtp_prefixes(config, names, layout)) if layout is not None else ()


def keeps_dtype(config: dict, name: str) -> bool:
    """Whether a tensor is written in its stored dtype, as mlx_lm.convert writes it (the family's
    `mlx_experts.uncast` or `mlx_layout.uncast`: its mlx-lm model's cast_predicate; the routers' correction bias,
    Qwen3.5's A_log)."""
    family = of_config(config)
    uncast = family.mlx_experts.uncast if family is not None and family.mlx_experts is not None else ()
    return any(part in name for part in uncast) or layout_uncast(config, name)


STACKED_WEIGHT = re.compile(r"^(?P<block>.*\.)switch_mlp\.(?P<projection>[A-Za-z0-9_]+)\.weight$")


def unstacked_names(config: dict, name: str, experts: int) -> list[str]:
    """The checkpoint's per-expert weight names (its Hugging Face names: a layout's prefix taken off) of a stored
    SwitchGLU weight (expert_stacks' way back); [] for any other tensor, and for a family whose checkpoint stores
    the experts fused (read back joined: fused_sources)."""
    family, m = of_config(config), STACKED_WEIGHT.match(name)
    if m is None or family is None or family.mlx_experts is None or family.mlx_experts.fused:
        return []
    stored = {new: old for old, new in family.mlx_experts.renames.items()}.get(m["projection"], m["projection"])
    return [checkpoint_name(config, f"{m['block']}experts.{e}.{stored}.weight") for e in range(experts)]


# ------------------------------------------------------------------ experts stored fused across experts


FUSED_TENSOR = re.compile(r"^(?P<block>.*\.)experts\.(?P<tensor>[A-Za-z0-9_]+)$")


def fused_tensor(config: dict, name: str):
    """(block, FusedExperts, whether it is the bias) of a checkpoint tensor holding every expert fused (the family's
    `mlx_experts.fused`: GPT-OSS's and Llama 4's `<block>.experts.gate_up_proj`, its bias); None for any other
    tensor."""
    family = of_config(config)
    if family is None or family.mlx_experts is None:
        return None
    for fused in family.mlx_experts.fused:
        for suffix, bias in ((fused.tensor, False), (fused.bias, True)):
            if suffix and name.endswith("." + suffix):
                return name[: -len(suffix)], fused, bias
    return None


def fused_piece_name(config: dict, block: str, projection: str, bias: bool) -> str:
    """The name a fused tensor's piece is written under (before the layout's prefix): the SwitchGLU projection's."""
    return f"{block}{of_config(config).mlx_experts.module}.{projection}.{'bias' if bias else 'weight'}"


def fused_modules(config: dict, tensors: dict) -> dict[str, tuple[str, list[int]]]:
    """{SwitchGLU module: (the checkpoint's fused weight it is cut from, its shape [experts, out, in])} of the fused
    experts among `tensors` (name -> (dtype, shape), a ModelInfo's headers)."""
    out = {}
    for name, (_dtype, shape) in tensors.items():
        if (found := fused_tensor(config, name)) is not None and not found[2]:
            block, fused, _bias = found
            for projection in fused.projections:
                module = fused_piece_name(config, block, projection, False).removesuffix(".weight")
                out[module] = (name, list(fused.piece_shape(shape)))
    return out


def fused_pieces(fused, tensor, bias: bool) -> list:
    """A fused tensor's pieces, in the order of its projections, as mlx-lm's SwitchGLU holds them: weights [experts,
    out, in] (x @ W transposed), biases [experts, out] (FusedExperts.layout)."""
    count = len(fused.projections)
    if fused.layout == "rows":
        return list(tensor.chunk(count, dim=1))
    columns = [tensor[..., i::count] for i in range(count)] if fused.layout == "interleaved" else \
        list(tensor.chunk(count, dim=-1))
    return columns if bias else [c.transpose(1, 2) for c in columns]


def written_fused(config: dict, name: str, tensor) -> dict:
    """{written name: value} of a fused expert tensor, each projection's piece (fused_pieces) under its SwitchGLU
    name."""
    block, fused, bias = fused_tensor(config, name)
    return {fused_piece_name(config, block, projection, bias): piece.contiguous()
            for projection, piece in zip(fused.projections, fused_pieces(fused, tensor, bias), strict=True)}


def fused_sources(config: dict, names) -> dict[str, tuple[list[str], object]]:
    """{the checkpoint's fused expert tensor: (the names, before the layout's prefix, of the pieces it is joined from
    in its projections' order, its FusedExperts)} (written_fused's way back), of the fused pieces among `names` (an
    artifact's tensors, under their checkpoint names)."""
    family = of_config(config)
    if family is None or family.mlx_experts is None or not family.mlx_experts.fused:
        return {}
    present, out = set(names), {}
    piece = re.compile(rf"^(?P<block>.*\.){re.escape(family.mlx_experts.module)}\.(?P<p>[A-Za-z0-9_]+)\."
                       r"(?P<kind>weight|bias)$")
    for name in present:
        m = piece.match(name)
        for fused in family.mlx_experts.fused if m is not None else ():
            if m["p"] == fused.projections[0] and (m["kind"] == "weight" or fused.bias):
                bias = m["kind"] == "bias"
                pieces = [fused_piece_name(config, m["block"], p, bias) for p in fused.projections]
                if all(piece in present for piece in pieces):
                    out[f"{m['block']}{fused.bias if bias else fused.tensor}"] = (pieces, fused)
    return out


def joined_fused(pieces: list, fused):
    """The fused tensor of its pieces' values (written_fused's way back): row blocks concatenated; or weights
    [experts, out, in] transposed to x @ W, then interleaved along the last axis or concatenated along it
    (FusedExperts.layout); biases [experts, out] likewise."""
    import torch

    if fused.layout == "rows":
        return torch.cat(pieces, dim=1)
    columns = [p if p.dim() == 2 else p.transpose(1, 2) for p in pieces]
    return torch.stack(columns, dim=-1).flatten(-2) if fused.layout == "interleaved" else torch.cat(columns, dim=-1)


# ------------------------------------------------------------------ experts stored in transformers' fused layout


# transformers 5's fused experts (quantkit.arch.families.base.ExpertCheckpoint): gate_up_proj [experts, 2 x
# intermediate, hidden], gate then up along the rows; down_proj [experts, hidden, intermediate]
TRANSFORMERS_FUSED = re.compile(r"^(?P<block>.*\.mlp\.experts)\.(?P<tensor>gate_up_proj|down_proj)$")


def splits_fused(config: dict) -> bool:
    """Whether the family's experts may be stored in transformers' fused layout and are then written as its
    per-expert tensors would be (its record's `mlx_experts.split_fused`: the Qwen mixtures)."""
    family = of_config(config)
    return family is not None and family.mlx_experts is not None and family.mlx_experts.split_fused


def per_expert_parts(name: str, shape) -> dict[str, tuple[str, int, slice]]:
    """{per-expert tensor: (the fused tensor, its expert, its rows)} of one tensor in transformers' fused layout
    ({} for any other tensor): gate_up_proj's first half of each expert's rows its gate_proj, the second its
    up_proj; down_proj's its down_proj."""
    m = TRANSFORMERS_FUSED.match(name)
    if m is None or len(shape) != 3:
        return {}
    experts, rows = shape[0], shape[1]
    if m["tensor"] == "down_proj":
        return {f"{m['block']}.{e}.down_proj.weight": (name, e, slice(0, rows)) for e in range(experts)}
    half = rows // 2
    return {f"{m['block']}.{e}.{projection}.weight": (name, e, slice(start, start + half))
            for e in range(experts) for projection, start in (("gate_proj", 0), ("up_proj", half))}


def per_expert_headers(config: dict, tensors: dict) -> dict[str, tuple[str, list[int]]]:
    """A checkpoint's headers (name -> (dtype, shape)) with each fused expert tensor as the per-expert tensors it
    holds, where the family splits them (splits_fused); as they are otherwise."""
    if not splits_fused(config):
        return tensors
    out = {}
    for name, (dtype, shape) in tensors.items():
        parts = per_expert_parts(name, shape)
        out.update({part: (dtype, [rows.stop - rows.start, shape[2]]) for part, (_n, _e, rows) in parts.items()}
                   if parts else {name: (dtype, shape)})
    return out


class PerExpertWeights:
    """A WeightSource over a checkpoint whose experts are stored in transformers' fused layout, giving each expert's
    projections as the per-expert checkpoint stores them (per_expert_parts), every other tensor as stored: what the
    mlx method stacks and calibrates, so the artifact is the one the per-expert checkpoint gives."""

    def __init__(self, weights):
        self.weights = weights
        self.parts: dict[str, tuple[str, int, slice]] = {}
        self.names: list[str] = []  # each fused tensor's parts where it was, in expert order
        for name in weights.keys():
            parts = per_expert_parts(name, weights.shape(name))
            self.parts.update(parts)
            self.names += list(parts) or [name]

    def keys(self) -> list[str]:
        return list(self.names)

    def get(self, name: str):
        if name not in self.parts:
            return self.weights.get(name)
        fused, expert, rows = self.parts[name]
        return self.weights.rows(fused, [expert])[0, rows].clone()

    def shape(self, name: str) -> tuple[int, ...]:
        if name not in self.parts:
            return tuple(self.weights.shape(name))
        fused, _expert, rows = self.parts[name]
        return (rows.stop - rows.start, self.weights.shape(fused)[2])

    def rows(self, name: str, index):
        if name not in self.parts:
            return self.weights.rows(name, index)
        return self.get(name)[index]


def per_expert_info(info):
    """A checkpoint's ModelInfo with its headers as per_expert_headers gives them: what the mlx method plans from."""
    from dataclasses import replace

    return replace(info, tensors=per_expert_headers(info.config, info.tensors)) if splits_fused(info.config) else info


def per_expert_source(info):
    """The checkpoint's tensors as the mlx method reads them: PerExpertWeights where the family splits fused
    experts (splits_fused), the stored ones otherwise."""
    from quantkit.io.checkpoint import SafetensorsWeights

    source = SafetensorsWeights(info.path)
    return PerExpertWeights(source) if splits_fused(info.config) else source


# ------------------------------------------------------------------ a text checkpoint under the model's own names


def layout(config: dict):
    """The family's MlxLayout (quantkit.arch.families.base) of a checkpoint's or an artifact's config.json: its
    text model under other names in its mlx-lm model (None: the Hugging Face names as stored)."""
    family = of_config(config)
    return family.mlx_layout if family is not None else None


def written_name(config: dict, name: str) -> str | None:
    """The name a checkpoint tensor (or module) is written under: the layout's prefix before it; None where the
    layout drops it (its mlx-lm model's sanitize drops it)."""
    found = layout(config)
    if found is None:
        return name
    return None if name.startswith(found.dropped) else found.prefix + name


def dropped_names(config: dict, names) -> list[str]:
    """The checkpoint's tensors not written, as the family's mlx-lm model has no module for them (Qwen3.5's MTP
    layers)."""
    return [name for name in names if written_name(config, name) is None]


def written_tensor(config: dict, name: str, tensor):
    """A 16-bit tensor as the family's mlx-lm sanitize would make it (the layout's rules), as mlx_lm.convert
    writes it."""
    rule = layout_rule(config, name)
    return tensor if rule is None else rule.forward(tensor)


def layout_rule(config: dict, name: str):
    """The layout's rule for a tensor by its Hugging Face name (None: as it is)."""
    found = layout(config)
    return next((r for r in found.rules if re.search(r.pattern, name)), None) if found is not None else None


def checkpoint_name(config: dict, stored: str) -> str:
    """The Hugging Face name of a tensor stored under the layout's prefix (written_name's way back)."""
    found = layout(config)
    return stored.removeprefix(found.prefix) if found is not None else stored


def layout_uncast(config: dict, name: str) -> bool:
    found = layout(config)
    return found is not None and name.endswith(found.uncast)


# ------------------------------------------------------------------ writing


class ShardedWriter:
    """Tensors added one at a time, flushed into shards of about SHARD_BYTES; `close` names the files
    as transformers and mlx_lm do and writes the index of several."""

    def __init__(self, out_dir: Path):
        self.out_dir, self.pending, self.pending_bytes, self.parts = Path(out_dir), {}, 0, []
        self.weight_map: dict[str, int] = {}

    def add(self, name: str, tensor) -> None:
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += tensor.numel() * tensor.element_size()
        if self.pending_bytes >= SHARD_BYTES:
            self.flush()

    def flush(self) -> None:
        from safetensors.torch import save_file

        if not self.pending:
            return
        part = self.out_dir / f".part-{len(self.parts):05d}.safetensors"
        save_file(self.pending, str(part), metadata={"format": "mlx"})
        self.weight_map.update({name: len(self.parts) for name in self.pending})
        self.parts.append(part)
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[str]:
        self.flush()
        count = len(self.parts)
        names = ["model.safetensors"] if count == 1 else [f"model-{i + 1:05d}-of-{count:05d}.safetensors"
                                                          for i in range(count)]
        for part, name in zip(self.parts, names):
            part.rename(self.out_dir / name)
        if count > 1:
            total = sum((self.out_dir / n).stat().st_size for n in names)
            index = {"metadata": {"total_size": total},
                     "weight_map": {k: names[i] for k, i in sorted(self.weight_map.items())}}
            (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=4) + "\n")
        return names


def quantized_tensors(name: str, words: np.ndarray, scales, biases) -> dict:
    """The three tensors of a quantized module stored under `name` (its module path)."""
    import torch

    return {f"{name}.weight": torch.from_numpy(words), f"{name}.scales": scales, f"{name}.biases": biases}


# ------------------------------------------------------------------ reading back


class MLXWeights:
    """An MLX model directory's tensors by Hugging Face name (quantkit.eval.stream.WeightSource), each
    quantized weight dequantized exactly as mlx.core.dequantize does (quantkit.mlx.affine); a stacked expert
    projection (`switch_mlp`) as the checkpoint's per-expert weights (`experts`: per-expert name -> (stored
    weight, expert)), each expert's slice read and dequantized on its own; experts the checkpoint stores fused
    (GPT-OSS) joined from the SwitchGLU's projections again (`fused`: fused name -> its pieces); a family written
    in its mlx-lm model's layout (MlxLayout: Qwen3.5) under the checkpoint's names and values again (`stored`:
    Hugging Face name -> stored name)."""

    def __init__(self, model_dir: Path):
        from quantkit.io.checkpoint import weight_files
        from quantkit.io.safetensors import safetensors_index

        self.path = Path(model_dir)
        self.config = json.loads((self.path / "config.json").read_text())
        self.index = {}
        for file in weight_files(self.path):
            self.index.update(safetensors_index(file))
        self.quantized = {name[: -len(".scales")] for name in self.index if name.endswith(".scales")}
        for module in self.quantized:
            self.check_module(module)
        self.experts = {expert: (name, e) for name, entry in self.index.items()
                        for e, expert in enumerate(unstacked_names(self.config, name, entry.shape[0]))}
        self.stored = {checkpoint_name(self.config, name): name for name in self.index
                       if not name.endswith((".scales", ".biases"))}
        self.fused = fused_sources(self.config, self.stored)

    def check_module(self, module: str) -> None:
        precision = module_precision(self.config, module)
        words, scales = self.index.get(f"{module}.weight"), self.index[f"{module}.scales"]
        if precision is None or words is None or words.dtype != "U32" or f"{module}.biases" not in self.index:
            raise ModelError(f"{self.path.name}: {module} is not an affine quantized module as config.json "
                             "describes it (uint32 weight, scales, biases)",
                             hint="the directory is not an mlx-lm quantized model as quantkit writes it: write it "
                                  "again with --method mlx")
        columns = words.shape[-1] * 32 // precision.bits
        if columns != scales.shape[-1] * precision.group_size or words.shape[:-1] != scales.shape[:-1]:
            raise ModelError(f"{self.path.name}: {module}'s packed weight {list(words.shape)} and scales "
                             f"{list(scales.shape)} disagree with {precision.bits} bits in groups of "
                             f"{precision.group_size}",
                             hint="config.json's quantization entry disagrees with the weights: write the artifact "
                                  "again with --method mlx")

    def keys(self) -> list[str]:
        stacked = {name for name, _e in self.experts.values()}
        pieces = {piece for names, _fused in self.fused.values() for piece in names}
        return [n for n, stored in self.stored.items() if stored not in stacked and n not in pieces] + \
            list(self.experts) + list(self.fused)

    def checkpoint_name(self, stored: str) -> str:
        """The Hugging Face name of a stored tensor (the name mlx-lm's module path gives)."""
        return checkpoint_name(self.config, stored)

    def shape(self, name: str) -> tuple[int, ...]:
        import torch

        if name in self.fused:
            pieces, fused = self.fused[name]
            return tuple(joined_fused([torch.empty(self.shape(p), device="meta") for p in pieces], fused).shape)
        stored, _expert = self.experts.get(name, (self.stored.get(name, name), None))
        module = stored.removesuffix(".weight")
        shape = tuple(self.index[stored].shape[1:] if name in self.experts else self.index[stored].shape)
        if module in self.quantized:
            return (*shape[:-1], shape[-1] * 32 // module_precision(self.config, module).bits)
        rule = layout_rule(self.config, name)
        return shape if rule is None else tuple(rule.inverse(torch.empty(shape, device="meta")).shape)

    def get(self, name: str):
        import torch

        from quantkit.io.safetensors import read_stored, read_stored_rows

        if name in self.fused:
            pieces, fused = self.fused[name]
            return joined_fused([self.get(piece) for piece in pieces], fused)
        stored, expert = self.experts.get(name, (self.stored.get(name, name), None))
        module = stored.removesuffix(".weight")
        read = read_stored if expert is None else (lambda entry: read_stored_rows(entry, [expert])[0])
        if module not in self.quantized:
            rule = layout_rule(self.config, name)
            return read(self.index[stored]) if rule is None else rule.inverse(read(self.index[stored]))
        if expert is None and len(self.index[stored].shape) == 3:  # a stacked module whole: expert by expert
            return torch.stack([self.dequantized(stored, e) for e in range(self.index[stored].shape[0])])
        return self.dequantized(stored, expert)

    def dequantized(self, stored: str, expert: int | None):
        """A stored quantized weight dequantized (of a stacked one, the slice of one expert)."""
        from quantkit.io.safetensors import read_stored, read_stored_rows
        from quantkit.mlx.affine import dequantize

        module = stored.removesuffix(".weight")
        read = read_stored if expert is None else (lambda entry: read_stored_rows(entry, [expert])[0])
        precision = module_precision(self.config, module)
        return dequantize(read_words(self.index[stored], expert), read(self.index[f"{module}.scales"]),
                          read(self.index[f"{module}.biases"]), precision.bits, precision.group_size)

    def rows(self, name: str, index):
        """Rows `index` of a tensor; of a quantized module, only those rows' words, scales and biases dequantized
        (a gathered embedding is never dequantized whole)."""
        import torch

        from quantkit.io.safetensors import read_stored
        from quantkit.mlx.affine import dequantize

        index = torch.as_tensor(np.asarray(index), dtype=torch.long)
        module = name.removesuffix(".weight")
        if name in self.experts or name in self.fused or module not in self.quantized:
            return self.get(name)[index]
        precision = module_precision(self.config, module)
        scales, biases = (read_stored(self.index[f"{module}.{part}"])[index] for part in ("scales", "biases"))
        return dequantize(read_words(self.index[name])[index.numpy()], scales, biases, precision.bits,
                          precision.group_size)

    def transformers_config(self):
        """The model's transformers config: config.json without the quantization blocks (a family written in its
        mlx-lm model's layout: its text_config, the checkpoint's config.json), its RoPE as mlx-lm computes it
        (as_mlx_lm_rotates)."""
        from transformers import AutoConfig

        plain = {k: v for k, v in self.config.items() if k not in ("quantization", "quantization_config")}
        if layout(plain) is not None and layout(plain).nested:
            plain = plain["text_config"]
        return AutoConfig.for_model(**as_mlx_lm_rotates(without_mlx_lm_fields(plain)))

    def stored_dtype(self) -> str:
        """The float dtype the scales are stored in (what mlx-lm computes in)."""
        from quantkit.io.safetensors import TORCH_DTYPES

        first = next(iter(sorted(self.quantized)), None)
        entry = self.index[f"{first}.scales"] if first else next(e for e in self.index.values() if e.dtype != "U32")
        return TORCH_DTYPES[entry.dtype]


def read_words(entry, expert: int | None = None) -> np.ndarray:
    """A stored uint32 tensor (the safetensors reader's torch dtypes have no uint32); of a stacked one, the slice
    of one expert (its first axis)."""
    shape = tuple(entry.shape) if expert is None else tuple(entry.shape[1:])
    count = math.prod(shape)
    offset = entry.offset + (0 if expert is None else expert * count * 4)
    data = np.fromfile(entry.file, dtype="<u4", count=count, offset=offset)
    if data.size != count:
        raise ModelError(f"{entry.file.name}: tensor data is truncated",
                         hint="the file is damaged or incomplete: write the artifact again")
    return data.reshape(shape)


def is_mlx_dir(config: dict) -> bool:
    """config.json of an mlx-lm quantized model: a `quantization` block with bits and group size."""
    block = config.get("quantization")
    return isinstance(block, dict) and "bits" in block and "group_size" in block
