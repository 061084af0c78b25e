"""HF checkpoint (local safetensors) -> GGUF, streamed one tensor at a time.

What convert_hf_to_gguf.py + llama-quantize do in two passes, in one: names through gguf-py's
TensorNameMap, Q/K rows permuted for the llama architecture (LlamaModel.permute), per-expert
weights stacked into 3-D ffn_*_exps tensors (Mixtral, Qwen3-MoE; experts stored stacked, Granite 4's, are
written by the family's steps, one expert's matrix at a time), Gemma's norm weights + 1,
generated tensors (llama3 RoPE's rope_freqs, Phi-3's LongRoPE factors), metadata as each
converter class's set_gguf_parameters writes it (hyper-parameters as transformers' AutoConfig
gives them to the converter, read without transformers by quantkit.arch.hf_config), the tokenizer (quantkit.gguf.vocab), and every tensor
quantized to the type quantkit.gguf.mixture chooses (llama-quantize's rules).

Per-architecture knowledge is each family's record (quantkit.arch.families: its `gguf`, one Gguf per
architecture, as llama.cpp's converter registers a model class per architecture). `arch_spec(config)`
refuses, from config.json alone, every feature the conversion does not reproduce (RoPE types, sliding
windows llama.cpp lacks, expert variants, the family's own checks), naming what is supported.

Streaming: all tensor infos are added first (shapes and types are known from the safetensors
header), then header, metadata and tensor infos are written, then each tensor is read from the
safetensors file with plain reads (SafetensorsRows: no mmap, no torch) in row slabs for large
tensors, quantized and appended at its aligned offset (the layout gguf-py's writer gives). Peak
memory is about one quantized tensor plus one slab of float32 rows on top of the interpreter,
numpy, numba and gguf-py. With a state file, each tensor written is recorded with its sha256, and
an interrupted conversion continues after the last recorded tensor that verifies (quantkit.gguf.resume).

Numerics: every source weight is converted to float32 exactly (bf16/f16 -> f32 is exact) and
quantized from those values. llama-quantize quantizes from whatever its input GGUF holds: an F16
GGUF of a bf16 checkpoint has already rounded the weights to f16, a BF16 or F32 GGUF has not.
So quantkit's output equals `convert_hf_to_gguf.py --outtype bf16|f32` + `llama-quantize`
for bf16/f32 checkpoints, and equals `--outtype f16` + `llama-quantize` for f16 checkpoints.
"""

from __future__ import annotations

import hashlib
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from quantkit.arch.families import gguf_conversions, gguf_refusals
from quantkit.arch.families.base import Gguf, TensorRule
from quantkit.arch.families.text import find, full_rope, rope_parameters, shift_norm, text_hparams
from quantkit.errors import InputError, InternalError, UnsupportedError
from quantkit.gguf import mixture, resume
from quantkit.gguf.mixture import T


# HF `architectures[0]` -> how llama.cpp converts it (convert_hf_to_gguf.py's registrations), from the family
# records (quantkit.arch.families: each family's `gguf`)
ARCHITECTURES: dict[str, Gguf] = gguf_conversions()
# HF `architectures[0]` -> why quantkit refuses it though the converter registers a class for it (the families'
# `gguf_refusal`)
REFUSED: dict[str, str] = gguf_refusals()
# VLMs whose language model convert_hf_to_gguf.py converts only through text_config.architectures
# (get_model_architecture prefers it over architectures[0]; neither class is registered as a text model)
ROUTED_BY_TEXT_CONFIG = {
    "Idefics3ForConditionalGeneration": "SmolVLM checkpoints name VLlama3ForCausalLM",
    "SmolVLMForConditionalGeneration": "SmolVLM checkpoints name VLlama3ForCausalLM",
}
# HF names that are not weights (convert_hf_to_gguf.py skips them too)
SKIPPED = re.compile(r"(rotary_emb\.inv_freq|\.attention\.masked_bias|\.attention\.bias)$")
# TextModel.filter_tensors: multimodal parts of a VLM checkpoint (only the language model is converted)
MULTIMODAL = re.compile(r"^(mlp|vit\.|vpm\.|siglip2\.|merger\.|resampler\.)|visual\.|vision\.|vision_|audio|"
                        r"projector\.|pre_mm_projector_norm|image_newline|view_seperator|patch_embed|"
                        r"patch_merger\.|patch_merge_mlp\.|model\.connector\.")
# per-expert weights: (layer, expert, weight) and the stacked name TensorNameMap knows
EXPERT_LAYOUTS = {
    "mixtral": (re.compile(r"^model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight$"),
                "layers.{bid}.feed_forward.experts.{w}.weight", ("w1", "w2", "w3")),
    "qwen": (re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$"),
             "model.layers.{bid}.mlp.experts.{w}.weight", ("gate_proj", "up_proj", "down_proj")),
}
FUSED_EXPERTS = re.compile(r"(^|\.)experts\.(gate_up_proj|down_proj|gate_proj|up_proj)(\.weight)?$")
SLAB_ELEMENTS = 1 << 22  # rows read per slab: about 16 MiB of float32


@dataclass
class TensorPlan:
    name: str  # GGUF name
    hf_name: str  # source tensor (the first expert's for stacked experts; "" for generated tensors)
    shape: tuple[int, ...]  # numpy order
    qtype: T
    permute_heads: int | None = None  # rows permuted in groups of this many heads
    norm_shift: bool = False  # Gemma: stored weight = HF weight + 1 (HF's RMSNorm scales by 1 + w)
    sources: tuple[str, ...] = ()  # experts stacked along a new first axis, in expert order
    values: np.ndarray | None = None  # generated tensors (rope_freqs, LongRoPE factors)
    # the family's modify_tensors step (quantkit.arch.families.base.TensorRule): forward(float32 values,
    # source dtype) -> the values written
    transform: Callable[[np.ndarray, str], np.ndarray] | None = None
    # (first, end): the block of the source matrix's rows a piece of a split holds as they are (no forward, no
    # reshape: Granite's shared MLP input_linear cut into ffn_gate and ffn_up); the sensitivity reads and patches them
    source_rows: tuple[int, int] | None = None


@dataclass
class ConvertResult:
    path: Path
    gguf_type: str
    type_counts: dict[str, int]
    tensors: int
    bytes: int
    vocab: dict = field(default_factory=dict)
    imatrix_tensors: int = 0


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


# ------------------------------------------------------------------ configuration and refusals


def load_hparams(model_dir: Path) -> dict:
    """ModelBase.load_hparams: transformers' AutoConfig.to_dict() (it fills defaults config.json
    omits, e.g. head_dim), config.json when transformers cannot read it; then text_hparams, with what the
    converter class counts from the checkpoint's tensors (Gguf.tensor_hparams: Qwen3-Next's MTP layers)."""
    import json

    from quantkit.io.checkpoint import weight_files
    from quantkit.io.safetensors import safetensors_index

    config = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    hp = text_hparams(converter_config(config))
    spec = ARCHITECTURES.get(hf_architecture(config))
    if spec is None or spec.tensor_hparams is None:
        return hp
    names = [name for file in weight_files(Path(model_dir)) for name in safetensors_index(file)]
    return spec.tensor_hparams(hp, names)


def converter_config(config: dict) -> dict:
    """The configuration the architecture's converter class reads: config.json's dict as stored where the
    class reads it itself (Gguf.raw_config), else completed with transformers' defaults."""
    spec = ARCHITECTURES.get(hf_architecture(config))
    return dict(config) if spec is not None and spec.raw_config else complete_config(config)


def reading_config(model_dir: Path, config: dict) -> dict:
    """The configuration a .gguf converted from model_dir is read back with (its names, the steps undone):
    config.json as stored where the converter class reads it itself (Gguf.raw_config: the checks and steps
    see what they saw when converting), else `config` (transformers' to_dict())."""
    import json

    spec = ARCHITECTURES.get(hf_architecture(config))
    if spec is None or not spec.raw_config:
        return config
    return json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))


def complete_config(config: dict) -> dict:
    """config.json's dict with transformers' defaults filled in (what AutoConfig.to_dict() gives
    for the checkpoint; config.json may omit values equal to the defaults): read directly for the
    families quantkit.arch.hf_config knows (no transformers, no torch), through transformers for
    the others (a VLM's nested configurations)."""
    from quantkit.arch import hf_config

    if hf_config.known(config):
        return hf_config.complete(config)
    from transformers import AutoConfig

    rest = {k: v for k, v in config.items() if k != "model_type"}
    try:
        return AutoConfig.for_model(config["model_type"], **rest).to_dict()
    except (KeyError, ValueError, TypeError):
        return dict(config)


def hf_architecture(config: dict) -> str:
    """get_model_architecture(hparams, TEXT): architectures[0], or text_config.architectures[0]
    where a VLM's text config names one (config.json's dict or text_hparams', which keeps text_config)."""
    archs = config.get("architectures") or []
    arch = archs[0] if archs else config.get("model_type", "?")
    text = config.get("text_config")
    if isinstance(text, dict) and text.get("architectures"):
        arch = text["architectures"][0]
    return arch


def arch_spec(config: dict) -> Gguf:
    """The architecture's conversion, or UnsupportedError for anything the converter does not
    handle (checked from config.json alone, before any model is loaded)."""
    arch = hf_architecture(config)
    if arch in ROUTED_BY_TEXT_CONFIG:
        raise UnsupportedError(f"GGUF conversion of {arch}: its config names no text_config.architectures (llama.cpp's "
                               "converter converts this VLM's language model only through it)",
                               hint=f"{ROUTED_BY_TEXT_CONFIG[arch]}; supported there: "
                                    + ", ".join(supported_architectures()))
    if arch in REFUSED:
        raise UnsupportedError(f"GGUF conversion of {arch}: {REFUSED[arch]}",
                               hint="convert it with llama.cpp's convert_hf_to_gguf.py where it can, then quantize "
                                    "with llama-quantize")
    if arch not in ARCHITECTURES:
        raise UnsupportedError(f"GGUF conversion does not support architecture '{arch}'",
                               hint="supported: " + ", ".join(supported_architectures()))
    spec = ARCHITECTURES[arch]
    hp = text_hparams(config)
    for check in (check_quantized, check_text_type, check_rope, check_sliding_window, check_experts):
        check(arch, spec, hp)
    for check in spec.checks:
        check(arch, hp)
    return spec


def refuse(arch: str, what: str, hint: str) -> None:
    raise UnsupportedError(f"GGUF conversion of {arch}: {what}", hint=hint)


def check_quantized(arch: str, spec: Gguf, hp: dict) -> None:
    from quantkit.io.checkpoint import QUANTIZED_CHECKPOINTS, quant_method

    if hp.get("quantization_config"):
        method = quant_method(hp)
        if method in QUANTIZED_CHECKPOINTS:
            what, hint = QUANTIZED_CHECKPOINTS[method]
            refuse(arch, f"the checkpoint is already quantized ({method}: {what})", hint)
        refuse(arch, "the checkpoint is already quantized", "convert the full-precision checkpoint")


def check_text_type(arch: str, spec: Gguf, hp: dict) -> None:
    if spec.text_types and hp.get("model_type") not in spec.text_types:
        refuse(arch, f"text model '{hp.get('model_type')}' (llama.cpp converts it with another model class)",
               "supported text_config.model_type: " + ", ".join(spec.text_types))


def check_rope(arch: str, spec: Gguf, hp: dict) -> None:
    rope = rope_parameters(hp)
    kind = full_rope(hp).get("rope_type") or "default"
    supported = "supported RoPE types for this architecture: " + ", ".join(spec.rope_types)
    if kind not in spec.rope_types:
        refuse(arch, f"RoPE type '{kind}' is not supported", supported)
    if (rope.get("sliding_attention") or {}).get("rope_type", "default") != "default":
        refuse(arch, "a scaled RoPE on the sliding-window layers is not supported", supported)
    if ("mrope_section" in rope) != spec.mrope and not spec.mrope_optional:
        what = "a RoPE without mrope_section is" if spec.mrope else "multimodal RoPE sections are"
        refuse(arch, f"{what} not supported", "multimodal RoPE (mrope_section) converts for Qwen2-VL, "
               "Qwen2.5-VL and Qwen3-VL only, and those need it")
    if kind in ("longrope", "su") and not (rope.get("long_factor") and rope.get("short_factor")):
        refuse(arch, "LongRoPE without long_factor / short_factor", "supported: LongRoPE with both factor lists, as Phi-3 configs give them")


def check_sliding_window(arch: str, spec: Gguf, hp: dict) -> None:
    if not spec.windowed and (hp.get("use_sliding_window") or
                              (hp.get("sliding_window") and "use_sliding_window" not in hp)):
        refuse(arch, f"sliding-window attention (window {hp.get('sliding_window')}) has no llama.cpp "
               f"equivalent for this architecture", "sliding-window attention converts for " + ", ".join(
                   sorted(a for a, s in ARCHITECTURES.items() if s.windowed)))


def check_experts(arch: str, spec: Gguf, hp: dict) -> None:
    if not spec.experts:
        return
    hint = "supported: every layer a routed-expert layer, top-k weights renormalised, no shared experts"
    if hp.get("mlp_only_layers") or hp.get("decoder_sparse_step", 1) not in (None, 1):
        refuse(arch, "dense (non-expert) layers mixed with expert layers", hint)
    if hp.get("shared_expert_intermediate_size") and not spec.shared_expert:
        refuse(arch, "shared experts", hint)


def check_convertible(config: dict, hf_tensors) -> Gguf:
    """arch_spec plus the checks that need the checkpoint's tensor names (fused expert layouts)."""
    spec = arch_spec(config)
    fused = [n for n in hf_tensors if FUSED_EXPERTS.search(n) and tensor_rule(config, n) is None]
    if fused and spec.experts != "stacked":  # stored stacked, or a rule of the family's converter, writes them
        raise UnsupportedError(f"GGUF conversion: fused expert tensors ('{fused[0]}') are not supported",
                               hint="supported: one tensor per expert (experts.N.*), as transformers' "
                                    "save_pretrained writes Mixtral and Qwen3-MoE")
    for check in spec.tensor_checks:
        check(hf_architecture(config), text_hparams(config), list(hf_tensors))
    return spec


def gguf_arch_name(spec: Gguf) -> str:
    import gguf

    return gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[spec.arch]]


def n_experts(hp: dict) -> int:
    from quantkit.arch.moe import EXPERT_COUNT_KEYS

    return find(hp, EXPERT_COUNT_KEYS) or 0


def model_facts(config: dict) -> mixture.ModelFacts:
    spec, hp = arch_spec(config), text_hparams(config)
    n_head = hp["num_attention_heads"]
    n_head_kv = spec.layer_kv_heads(hp)[0] if spec.layer_kv_heads else hp.get("num_key_value_heads") or n_head
    n_layer = spec.blocks(hp) if spec.blocks is not None else hp["num_hidden_layers"]
    return mixture.ModelFacts(arch=gguf_arch_name(spec), n_layer=n_layer, n_head=n_head, n_head_kv=n_head_kv,
                              n_expert=n_experts(hp) if spec.experts else 0)


# ------------------------------------------------------------------ names


def name_map(config: dict):
    """TensorNameMap over the file's blocks (Gguf.blocks: the MTP layers after the decoder's where the converter
    counts them)."""
    import gguf

    spec, hp = arch_spec(config), text_hparams(config)
    return gguf.get_tensor_name_map(gguf.MODEL_ARCH[spec.arch],
                                    spec.blocks(hp) if spec.blocks is not None else hp["num_hidden_layers"])


def gguf_name(tmap, hf_name: str) -> str:
    name = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise UnsupportedError(f"cannot map tensor '{hf_name}' to a GGUF name",
                               hint="the checkpoint holds a tensor llama.cpp's converter has no name for; "
                                    "docs/models.md lists the architectures gguf converts")
    return name


def source_name(hf_name: str, spec: Gguf | None = None) -> str | None:
    """ModelBase/TextModel.filter_tensors: the name the converter maps, None when it skips it
    (LlamaModel.filter_tensors first drops SmolVLM's `text_model.`)."""
    if spec is not None and spec.strips_text_model:
        hf_name = hf_name.replace("text_model.", "")
    if MULTIMODAL.search(hf_name):
        return None
    return hf_name.replace("language_model.", "")


def permute_heads(config: dict, hf_name: str) -> int | None:
    """Head count whose row groups LlamaModel.permute interleaves (q: n_head, k: n_head_kv)."""
    if not arch_spec(config).permute_qk:
        return None
    hp = text_hparams(config)
    if re.search(r"q_proj\.(weight|bias)$", hf_name):
        return hp["num_attention_heads"]
    if re.search(r"k_proj\.(weight|bias)$", hf_name):
        return hp.get("num_key_value_heads") or hp["num_attention_heads"]
    return None


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """LlamaModel.permute: HF rotate_half row order -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute`."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def skipped(config: dict, hf_name: str) -> bool:
    """Tensors convert_hf_to_gguf.py does not write (Gemma 1/2: lm_head, the output is the tied embedding; the
    family's own drops: DeepSeek's MTP layers)."""
    spec = arch_spec(config)
    return bool(SKIPPED.search(hf_name)) or (spec.drops_lm_head and hf_name == "lm_head.weight") or \
        (spec.drops is not None and spec.drops(hf_name, text_hparams(config)))


def norm_shift(config: dict, hf_name: str) -> bool:
    """Gemma*Model.modify_tensors: `if name.endswith("norm.weight"): data_torch + 1`."""
    return arch_spec(config).norm_shift and hf_name.endswith("norm.weight")


def source_tensors(config: dict, hf_tensors) -> dict[str, str]:
    """{name the converter maps: HF tensor name} for the tensors it writes (not those it writes as metadata)."""
    out, spec = {}, arch_spec(config)
    for hf in hf_tensors:
        name = source_name(hf, spec)
        if name is not None and spec.renames is not None:
            name = spec.renames(name, text_hparams(config))
        if name is not None and not skipped(config, name) and metadata_tensor(spec, name) is None:
            out[name] = hf
    return out


def metadata_tensor(spec: Gguf, name: str):
    """The family's MetadataTensor a tensor name is one of (quantkit.arch.families.base), None."""
    return next((m for m in spec.metadata_tensors
                 if re.fullmatch(r"model\.layers\.\d+\." + re.escape(m.suffix), name)), None)


def add_metadata_tensors(writer, spec: Gguf, hp: dict, handles: dict) -> None:
    """The per-layer tensors the converter writes as metadata arrays (one float per layer, in layer order)."""
    for m in spec.metadata_tensors:
        names = [f"model.layers.{i}.{m.suffix}" for i in range(hp["num_hidden_layers"])]
        missing = [n for n in names if n not in handles]
        if missing:
            raise InputError(f"the checkpoint lacks '{missing[0]}' (written as the GGUF key {m.key})",
                             hint="the checkpoint and its config.json disagree: save it again with transformers")
        writer.add_array(m.key, [float(read_rows(handles[n], n, 0, 1).reshape(-1)[0]) for n in names])


def group_experts(config: dict, names: dict[str, str]) -> tuple[dict[str, str], dict[str, tuple[str, ...]]]:
    """Split off per-expert tensors: (other names, {stacked name: HF names in expert order})."""
    spec = arch_spec(config)
    if spec.experts not in EXPERT_LAYOUTS:  # none, or stored stacked (the family's rules write them)
        return names, {}
    pattern, stacked, _ = EXPERT_LAYOUTS[spec.experts]
    found: dict[str, dict[int, str]] = {}
    rest = {}
    for name, hf in names.items():
        m = pattern.match(name)
        if m is None:
            rest[name] = hf
            continue
        found.setdefault(stacked.format(bid=m.group(1), w=m.group(3)), {})[int(m.group(2))] = hf
    count = n_experts(text_hparams(config))
    groups = {}
    for key, experts in found.items():
        if sorted(experts) != list(range(count)):
            raise UnsupportedError(f"GGUF conversion: {key} has experts {sorted(experts)}, expected 0..{count - 1}",
                                   hint="the checkpoint lacks some experts' tensors: save it again with transformers' "
                                        "save_pretrained")
        groups[key] = tuple(experts[i] for i in range(count))
    return rest, groups


def vocab_rows(model_dir: Path | None, hp: dict) -> int | None:
    """Gemma3Model.modify_tensors: the tokenizer's real vocabulary size (token_embd is cut to it)."""
    import json

    if model_dir is None:
        return None
    if (Path(model_dir) / "tokenizer.model").is_file():
        from quantkit.gguf.vocab import load_sentencepiece

        return max(hp.get("vocab_size_per_layer_input") or hp.get("vocab_size") or 0,
                   load_sentencepiece(Path(model_dir)).vocab_size())
    data = json.loads((Path(model_dir) / "tokenizer.json").read_text(encoding="utf-8"))
    return len(data["model"]["vocab"]) + len(data["added_tokens"])


def tensor_rule(config: dict, name: str) -> TensorRule | None:
    """The family's modify_tensors step for a tensor (the name the converter maps), None where it has none."""
    rules = arch_spec(config).rules
    hp = text_hparams(config) if any(rule.when is not None for rule in rules) else {}
    return next((rule for rule in rules if re.search(rule.pattern, name) and (rule.when is None or rule.when(hp))),
                None)


# ModelBase.modify_tensors' own renaming before TensorNameMap, for every architecture: a router's correction bias
CONVERTER_RENAMES = ((r"e_score_correction_bias$", "e_score_correction.bias"),)


def mapped_name(rule: TensorRule | None, name: str) -> str:
    """The name TensorNameMap maps: the converter's, renamed by the family's step where it says so, then as
    ModelBase.modify_tensors renames it."""
    name = re.sub(rule.rename[0], rule.rename[1], name) if rule is not None and rule.rename else name
    for pattern, replacement in CONVERTER_RENAMES:
        name = re.sub(pattern, replacement, name)
    return name


def single_plan(config: dict, tmap, name: str, hf: str, shape: list[int]) -> TensorPlan:
    """The plan of one source tensor: its GGUF name, written shape and the converter's changes to it."""
    rule, hp = tensor_rule(config, name), text_hparams(config)
    written = tuple(shape) if rule is None or rule.shape is None else tuple(rule.shape(tuple(shape), hp))
    transform = None
    if rule is not None and rule.forward is not None:
        def transform(data, dtype, forward=rule.forward):
            return forward(data, hp, dtype)
    target = rule.target(name, hp) if rule is not None and rule.target is not None else gguf_name(tmap, mapped_name(rule, name))
    return TensorPlan(target, hf, written, T.F32, permute_heads(config, name),
                      norm_shift(config, name), transform=transform)


def split_names(rule: TensorRule | None, name: str) -> list[str]:
    """The names TensorNameMap maps for a source tensor: one, or one per piece of a split tensor."""
    if rule is None or not rule.split:
        return [mapped_name(rule, name)]
    return [re.sub(pattern, replacement, name) for pattern, replacement in rule.split]


def source_plans(config: dict, tmap, name: str, hf: str, shape: list[int]) -> list[TensorPlan]:
    """The plans of one source tensor: one, or one per piece where the family's step splits it (each piece
    a block of the written tensor's rows along its second-to-last axis: equal parts, or TensorRule.split_rows)."""
    rule, hp = tensor_rule(config, name), text_hparams(config)
    if rule is None or not rule.split:
        return [single_plan(config, tmap, name, hf, shape)]
    if rule.pieces is not None:
        return cut_plans(rule, hp, tmap, name, hf, shape)
    written = tuple(shape) if rule.shape is None else tuple(rule.shape(tuple(shape), hp))
    rows = piece_rows(rule, written, hp)
    bounds = np.cumsum(rows)[:-1]

    def transform(data, dtype, index, forward=rule.forward):
        values = (data if forward is None else forward(data, hp, dtype)).reshape(written)
        return np.split(values, bounds, axis=-2)[index]

    starts = (0, *bounds.tolist())
    as_stored = rule.forward is None and len(shape) == 2 and written == tuple(shape)
    return [TensorPlan(gguf_name(tmap, piece_name), hf, (*written[:-2], rows[i], written[-1]), T.F32,
                       transform=lambda data, dtype, i=i: transform(data, dtype, i),
                       source_rows=(starts[i], starts[i] + rows[i]) if as_stored else None)
            for i, piece_name in enumerate(split_names(rule, name))]


def piece_rows(rule: TensorRule, written: tuple[int, ...], hp: dict) -> tuple[int, ...]:
    """The rows of each piece of a split tensor (along its second-to-last axis): the family's sizes, or equal parts."""
    if rule.split_rows is not None:
        return tuple(rule.split_rows(written, hp))
    return (written[-2] // len(rule.split),) * len(rule.split)


def cut_plans(rule: TensorRule, hp: dict, tmap, name: str, hf: str, shape: list[int]) -> list[TensorPlan]:
    """The plans of a tensor the family's step cuts into pieces of their own shapes (TensorRule.pieces)."""
    shapes = rule.pieces.shapes(tuple(shape), hp)

    def transform(data, dtype, index):
        values = (data if rule.forward is None else rule.forward(data, hp, dtype)).reshape(shape)
        return rule.pieces.cut(values, hp)[index]

    return [TensorPlan(gguf_name(tmap, piece_name), hf, tuple(piece), T.F32,
                       transform=lambda data, dtype, i=i: transform(data, dtype, i))
            for i, (piece_name, piece) in enumerate(zip(split_names(rule, name), shapes, strict=True))]


def plan_tensors(config: dict, hf_tensors: dict[str, tuple[str, list[int]]], gguf_type: str,
                 has_imatrix: bool = False, model_dir: Path | None = None) -> list[TensorPlan]:
    """One TensorPlan per written tensor, in llama-quantize's tensor order (config: config.json's
    dict or load_hparams'; model_dir: the checkpoint, for Gemma 3's vocabulary trim)."""
    config = config if model_dir is not None else converter_config(config)
    check_convertible(config, hf_tensors)
    tmap = name_map(config)
    single, groups = group_experts(config, source_tensors(config, hf_tensors))
    plans = {}
    for n, hf in single.items():
        for plan in source_plans(config, tmap, n, hf, hf_tensors[hf][1]):
            plans[plan.name] = plan
    for n, hfs in groups.items():
        plans[gguf_name(tmap, n)] = TensorPlan(gguf_name(tmap, n), hfs[0], (len(hfs), *hf_tensors[hfs[0]][1]),
                                               T.F32, sources=hfs)
    for name, values in generated_tensors(config).items():
        plans[name] = TensorPlan(name, "", values.shape, T.F32, values=values)
    trim_vocab(config, plans, model_dir)
    types = mixture.choose_types({g: p.shape for g, p in plans.items()}, gguf_type, model_facts(config), has_imatrix)
    for g, p in plans.items():
        p.qtype = types[g]
        if mixture.kept_as_converted(g, p.shape):
            p.qtype = converted_type(gguf_type, hf_tensors[p.hf_name][0])
    return [plans[g] for g in mixture.llama_order(plans)]


def converted_type(gguf_type: str, source_dtype: str) -> T:
    """The type convert_hf_to_gguf.py writes a 2-D weight at (the output type: F32/F16/BF16), and the one a
    quantized file keeps it at where llama-quantize leaves it as it reads it: the converter's output quantkit
    equals (--outtype bf16 for a bf16 checkpoint, f16 for f16, f32 for f32)."""
    _, _, default = mixture.file_type(gguf_type)
    if default in mixture.UNQUANTIZED:
        return default
    return {"BF16": T.BF16, "F16": T.F16}.get(source_dtype, T.F32)


def override_types(plans: list[TensorPlan], types: dict[str, T]) -> list[TensorPlan]:
    """The plans with `types` replacing the mixture's choice; each named tensor must be one the
    mixture quantizes and the type must fit its rows."""
    from gguf import GGML_QUANT_SIZES

    by_name = {p.name: p for p in plans}
    for name, qtype in types.items():
        plan = by_name.get(name)
        if plan is None or plan.qtype in mixture.UNQUANTIZED:
            raise InputError(f"per-tensor type for '{name}': not a quantized tensor of this model",
                             hint="name a tensor of the model as tensor-types.txt lists it (quantkit inspect MODEL "
                                  "--method gguf)")
        if plan.shape[-1] % GGML_QUANT_SIZES[qtype][0] != 0:
            raise InputError(f"per-tensor type {qtype.name} for '{name}': rows of {plan.shape[-1]} values "
                             f"are not a multiple of its block size",
                             hint="give that tensor a type whose block divides its rows, e.g. Q8_0 or Q4_0 (32 "
                                  "values), or leave it to --auto-precision")
        plan.qtype = qtype
    return plans


def trim_vocab(config: dict, plans: dict[str, TensorPlan], model_dir: Path | None) -> None:
    embd = plans.get("token_embd.weight")
    if embd is None or not arch_spec(config).trims_vocab:
        return
    rows = vocab_rows(model_dir, text_hparams(config))
    if rows is not None and rows < embd.shape[0]:
        embd.shape = (rows, *embd.shape[1:])


# ------------------------------------------------------------------ generated tensors


def generated_tensors(config: dict) -> dict[str, np.ndarray]:
    """generate_extra_tensors of the architecture's converter class (Llama 3.1's rope_freqs, Phi-3's LongRoPE
    factors)."""
    return arch_spec(config).extra_tensors(text_hparams(config))


# ------------------------------------------------------------------ metadata


def add_metadata(writer, hp: dict, spec: Gguf, name: str, ftype) -> None:
    """general.name / general.type, the architecture's set_gguf_parameters, quantization version."""
    import gguf

    writer.add_name(name)
    writer.add_type(gguf.GGUFType.MODEL)
    spec.params(writer, hp, int(ftype))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


# ------------------------------------------------------------------ tensor data


def quantize_rows(data: np.ndarray, qtype: T, imatrix: np.ndarray | None = None, threads: int = 1) -> np.ndarray:
    """float32 rows -> GGUF bytes (uint8 rows) or f32/f16 arrays, through quantkit's kernels."""
    import gguf

    if qtype == T.F32:
        return np.ascontiguousarray(data, dtype=np.float32)
    if qtype == T.F16:
        return data.astype(np.float16)
    try:
        from quantkit.gguf.quants import quantize
    except ImportError:  # kernels not installed: gguf-py covers BF16, Q8_0 and the legacy types
        if imatrix is not None and qtype not in (T.BF16, T.Q8_0):
            raise UnsupportedError(f"{qtype.name} with an imatrix needs quantkit.gguf.quants",
                                   hint="pip install -e . installs quantkit's GGUF kernels; or run with --imatrix "
                                        "none") from None
        return gguf.quants.quantize(data, qtype)
    return quantize(np.ascontiguousarray(data, dtype=np.float32), qtype, imatrix, threads=threads)


def tensor_nbytes(shape: tuple[int, ...], qtype: T) -> int:
    import gguf

    return int(np.prod(gguf.quant_shape_to_byte_shape(shape, qtype))) if qtype not in (T.F32, T.F16) \
        else int(np.prod(shape)) * (4 if qtype == T.F32 else 2)


def numpy_dtype(qtype: T):
    return {T.F32: np.float32, T.F16: np.float16}.get(qtype, np.float32)


class SafetensorsRows:
    """Rows of the tensors of one .safetensors file, read with plain file reads into numpy.

    No torch and no mmap: the converter's memory is its working set (one slab), not the pages of
    the checkpoint it has visited (a memory map keeps every page it touched resident, which for
    a 250 MB checkpoint was a third of the peak RSS); tensors are decoded without torch.
    F32 / F16 / BF16 are decoded here (bf16 -> f32 is a 16-bit shift, exact); other dtypes go
    through safetensors' torch reader.
    """

    DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}

    def __init__(self, path: Path):
        import json
        import struct

        self.path = Path(path)
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            self.header = json.loads(f.read(n))
        self.header.pop("__metadata__", None)
        self.base = 8 + n
        self._file = None
        self._torch = None

    def keys(self):
        return self.header.keys()

    def read(self, name: str, start: int, stop: int) -> np.ndarray:
        """float32 rows start:stop of a tensor (the whole tensor when it is 1-D)."""
        entry = self.header[name]
        shape, raw = list(entry["shape"]), self.DTYPES.get(entry["dtype"])
        if raw is None:
            return self._read_torch(name, shape, start, stop)
        if len(shape) <= 1:  # read whole, as one row
            start, stop, row_shape = 0, 1, tuple(shape)
        else:
            row_shape = tuple(shape[1:])
        row = int(np.prod(row_shape, dtype=np.int64))
        buf = np.empty((stop - start) * row, dtype=raw)
        if self._file is None:
            self._file = open(self.path, "rb")
        self._file.seek(self.base + entry["data_offsets"][0] + start * row * buf.itemsize)
        if self._file.readinto(memoryview(buf).cast("B")) != buf.nbytes:
            raise InputError(f"{self.path.name}: tensor '{name}' is truncated",
                             hint="the checkpoint file is damaged: download or save it again")
        if raw is np.uint16:  # bf16: the high half of a float32
            out = buf.astype(np.uint32)
            out <<= 16
            data = out.view(np.float32)
        else:
            data = buf.astype(np.float32, copy=False)
        return data.reshape(row_shape if len(shape) <= 1 else (stop - start, *row_shape))

    def _read_torch(self, name, shape, start, stop):
        import torch
        from safetensors import safe_open

        if self._torch is None:
            self._torch = safe_open(str(self.path), framework="pt")
        sl = self._torch.get_slice(name)
        part = sl[start:stop] if len(shape) > 1 else sl[:]
        return part.to(torch.float32).numpy()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._torch = None


def read_rows(handle: SafetensorsRows, name: str, start: int, stop: int) -> np.ndarray:
    return handle.read(name, start, stop)


def whole(data) -> np.ndarray:
    """A SlabbedTensor's slabs joined (an expert's matrix, stacked with the others)."""
    return np.concatenate(list(data.slabs())) if isinstance(data, SlabbedTensor) else data


def tensor_data(handles: dict, plan: TensorPlan, imatrix: np.ndarray | None, threads: int = 1):
    """Read, transform and quantize one tensor (experts one at a time, large matrices by slabs)."""
    if plan.values is not None:
        return quantize_rows(plan.values, plan.qtype, imatrix, threads)
    if plan.sources:
        n = plan.shape[-1]
        return np.stack([whole(matrix_data(handles[hf], plan, hf, plan.shape[1:],
                                           None if imatrix is None else imatrix[i * n:(i + 1) * n], threads))
                         for i, hf in enumerate(plan.sources)])
    return matrix_data(handles[plan.hf_name], plan, plan.hf_name, plan.shape, imatrix, threads)


class SlabbedTensor:
    """A large 2-D tensor quantized and written a slab of rows at a time, for GGUFWriter's
    write_tensor_data (which asks a tensor for `nbytes` and `tofile`, as gguf-py's own lazy
    tensors answer): the quantized tensor is never whole in memory (a 128k-vocab Q6_K output is
    200+ MB, and joining slabs would hold it twice)."""

    def __init__(self, handle, hf_name: str, plan: TensorPlan, shape: tuple[int, ...], imatrix, threads: int):
        self.handle, self.hf_name, self.plan, self.shape = handle, hf_name, plan, shape
        self.imatrix, self.threads = imatrix, threads
        self.nbytes = tensor_nbytes(shape, plan.qtype)

    def slabs(self) -> Iterator[np.ndarray]:
        rows = self.shape[0]
        step = max(1, SLAB_ELEMENTS // max(1, self.shape[-1]))
        for r in range(0, rows, step):
            data = read_rows(self.handle, self.hf_name, r, min(rows, r + step))
            yield quantize_rows(data, self.plan.qtype, self.imatrix, self.threads)

    def tofile(self, fout) -> None:
        for slab in self.slabs():
            slab.tofile(fout)


def matrix_data(handle, plan: TensorPlan, hf_name: str, shape: tuple[int, ...], imatrix, threads: int):
    """One 1-D or 2-D source tensor: permuted / shifted / changed by the family's step whole, otherwise
    streamed by row slabs."""
    if plan.transform is not None:
        data = written_values(handle, plan, hf_name, shape)
        if imatrix is not None and data.ndim == 3:  # one row-sized vector per matrix (DeepSeek's attn_k_b: per head)
            n = data.shape[-1]
            return np.stack([quantize_rows(m, plan.qtype, imatrix[i * n:(i + 1) * n], threads)
                             for i, m in enumerate(data)])
        return quantize_rows(data, plan.qtype, imatrix, threads)
    if len(shape) == 3:  # experts stored stacked (Granite's output_linear): one expert at a time
        return stacked_data(handle, plan, hf_name, shape, imatrix, threads)
    rows = shape[0] if len(shape) > 1 else 1
    if len(shape) == 1 or plan.permute_heads or plan.norm_shift:
        data = read_rows(handle, hf_name, 0, rows)
        if plan.permute_heads:
            data = permute(data, plan.permute_heads)
        if plan.norm_shift:
            data = shift_norm(data, handle.header[hf_name]["dtype"])
        return quantize_rows(data, plan.qtype, imatrix, threads)
    return SlabbedTensor(handle, hf_name, plan, shape, imatrix, threads)


def written_values(handle, plan: TensorPlan, hf_name: str, shape: tuple[int, ...]) -> np.ndarray:
    """A source tensor read whole and changed by the family's step (plan.transform, where it has one) into the
    float32 values written in `shape`, before quantization."""
    source = handle.header[hf_name]
    data = read_rows(handle, hf_name, 0, source["shape"][0] if len(source["shape"]) > 1 else 1)
    if plan.transform is not None:
        data = plan.transform(data, source["dtype"])
    return np.ascontiguousarray(np.reshape(data, shape), dtype=np.float32)


def stacked_data(handle, plan: TensorPlan, hf_name: str, shape: tuple[int, ...], imatrix, threads: int) -> np.ndarray:
    """A 3-D source tensor written as it is stored (one matrix per expert), each matrix quantized with its own
    importance vector, as llama-quantize quantizes a 3-D tensor."""
    n = shape[-1]
    return np.stack([quantize_rows(read_rows(handle, hf_name, e, e + 1)[0], plan.qtype,
                                   None if imatrix is None else imatrix[e * n:(e + 1) * n], threads)
                     for e in range(shape[0])])


def imatrix_size(shape: tuple[int, ...]) -> int:
    """The importance values llama-quantize takes for a tensor of this shape (numpy order): ne[0] x ne[2]."""
    return shape[-1] * (shape[0] if len(shape) == 3 else 1)


def imatrix_for(plan: TensorPlan, imatrix: dict | None) -> np.ndarray | None:
    """The tensor's importance vector (one row-sized vector per matrix of a 3-D tensor: each expert of stacked
    experts, each head of DeepSeek's attn_k_b / attn_v_b), when it is quantized (llama-quantize's size check)."""
    if not imatrix or plan.qtype in (T.F32, T.F16, T.BF16) or plan.name not in imatrix:
        return None
    values = np.asarray(imatrix[plan.name], dtype=np.float32)
    expected = imatrix_size(plan.shape)
    if values.size != expected:
        if plan.name == "token_embd.weight":
            return None
        raise InputError(f"imatrix size {values.size} differs from the expected {expected} of {plan.name}",
                         hint="the imatrix was computed for another model: use --imatrix auto, or compute one for "
                              "this model")
    return values


# ------------------------------------------------------------------ driver


def open_handles(files: list[Path]) -> dict[str, SafetensorsRows]:
    handles = {}
    for f in files:
        h = SafetensorsRows(Path(f))
        for key in h.keys():
            handles[key] = h
    return handles


def convert(model_dir: Path, out_path: Path, gguf_type: str = "F16", imatrix: dict | None = None,
            name: str | None = None, progress: Callable[[str], None] = lambda m: None,
            threads: int = 1, types: dict[str, T] | None = None, state: Path | None = None) -> ConvertResult:
    """Write `out_path` (.gguf) from the checkpoint in model_dir; returns what was written.

    `types` ({GGUF name: type}) replaces the mixture's type of those tensors (per-tensor types
    chosen by quantkit.mixed.gguf; llama-quantize --tensor-type gives the same file).
    `state`: the file recording each tensor as it is written (quantkit.gguf.resume); when it holds the
    progress of an interrupted conversion of the same header and imatrix, the tensors it records are
    verified in `out_path` and writing continues after the last good one."""
    import gguf

    from quantkit.gguf.vocab import add_vocab
    from quantkit.io.checkpoint import check_model_dir

    info = check_model_dir(Path(model_dir))
    key, ftype, _ = mixture.file_type(gguf_type)
    hp = {**load_hparams(info.path), "architectures": info.config.get("architectures")}
    plans = override_types(plan_tensors(hp, info.tensors, key, has_imatrix=bool(imatrix), model_dir=info.path),
                           types or {})
    weights = [imatrix_for(p, imatrix) for p in plans]
    unweighted = {p.name: p.qtype for p, w in zip(plans, weights) if w is None}
    needing = mixture.needs_imatrix(unweighted)
    if needing:
        raise InputError(f"{needing[0]} is {unweighted[needing[0]].name}: llama.cpp quantizes that type only with "
                         "an imatrix, and there is none for it", hint="pass --imatrix auto or an imatrix of this model")
    spec = arch_spec(hp)
    writer = gguf.GGUFWriter(None, gguf_arch_name(spec))
    add_metadata(writer, hp, spec, name or Path(model_dir).name, ftype)
    vocab = add_vocab(writer, info.path, hp, spec.vocab)
    if spec.metadata_tensors:
        metadata_handles = open_handles(info.weight_files)
        try:
            add_metadata_tensors(writer, spec, hp, metadata_handles)
        finally:
            for h in set(metadata_handles.values()):
                h.close()
    for p in plans:
        writer.add_tensor_info(p.name, p.shape, np.dtype(numpy_dtype(p.qtype)), tensor_nbytes(p.shape, p.qtype),
                               raw_dtype=None if p.qtype in (T.F32, T.F16) else p.qtype)
    header = header_bytes(writer, Path(out_path))
    layout = tensor_layout(plans, len(header), writer.data_alignment)
    saved = resume.Progress(hashlib.sha256(header).hexdigest(), resume.imatrix_digest(imatrix))
    saved.tensors = resumed(Path(out_path), state, saved, layout, progress)
    handles = open_handles(info.weight_files)
    try:
        with open_for_writing(Path(out_path), header, saved.tensors, layout) as fh:
            for i in range(len(saved.tensors), len(plans)):
                p = plans[i]
                progress(f"converting: {p.name} -> {p.qtype.name} ({i + 1}/{len(plans)})")
                digest = write_tensor(fh, tensor_data(handles, p, weights[i], threads), layout[i], writer.data_alignment)
                record(state, saved, replace(layout[i], sha256=digest), fh)
    finally:
        for h in set(handles.values()):
            h.close()
    counts = mixture.type_counts({p.name: p.qtype for p in plans})
    return ConvertResult(Path(out_path), key, counts, len(plans), Path(out_path).stat().st_size,
                         vocab.__dict__, sum(w is not None for w in weights))


def header_bytes(writer, out_path: Path) -> bytes:
    """Header, metadata and tensor infos as gguf-py writes them (through a temporary file beside
    out_path, so a partly written out_path stays as it is until it is known to match)."""
    tmp = out_path.with_name(f".{out_path.name}.header")
    try:
        writer.write_header_to_file(path=tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        writer.close()
        return tmp.read_bytes()
    finally:
        tmp.unlink(missing_ok=True)


def aligned(n: int, alignment: int) -> int:
    return (n + alignment - 1) // alignment * alignment


def tensor_layout(plans: list[TensorPlan], header: int, alignment: int) -> list[resume.WrittenTensor]:
    """Where each tensor's data goes in the file (gguf-py's layout: each tensor aligned, padded to the alignment)."""
    offset, layout = aligned(header, alignment), []
    for p in plans:
        nbytes = tensor_nbytes(p.shape, p.qtype)
        layout.append(resume.WrittenTensor(p.name, offset, nbytes, ""))
        offset += aligned(nbytes, alignment)
    return layout


def resumed(out_path: Path, state: Path | None, wanted: resume.Progress, layout: list[resume.WrittenTensor],
            progress: Callable[[str], None]) -> list[resume.WrittenTensor]:
    """The tensors an interrupted conversion already wrote to out_path and that still verify; [] when
    there is no saved progress, or it was made for another header or imatrix (said through `progress`)."""
    saved = resume.load(state) if state is not None and out_path.is_file() else None
    if saved is None or not saved.tensors:
        return []
    if (saved.header_sha256, saved.imatrix_sha256) != (wanted.header_sha256, wanted.imatrix_sha256):
        what = "header (types, shapes or metadata)" if saved.header_sha256 != wanted.header_sha256 else "imatrix"
        progress(f"{out_path.name}: the saved progress was written with another {what}; writing it from the start")
        return []
    good = resume.verified(out_path, saved, layout)
    progress(f"{out_path.name}: resuming after {len(good)} of {len(layout)} tensors (verified by sha256)"
             + (f"; {len(saved.tensors) - len(good)} recorded tensor(s) did not verify" if len(good) < len(saved.tensors)
                else ""))
    return good


@contextmanager
def open_for_writing(out_path: Path, header: bytes, done: list[resume.WrittenTensor],
                     layout: list[resume.WrittenTensor]):
    """out_path open for the tensors after `done`: cut after the last of them (what follows is
    rewritten), or, with none done, a new file holding the header."""
    if not done:
        with open(out_path, "wb") as fh:
            fh.write(header)
            yield fh
        return
    with open(out_path, "r+b") as fh:
        end = layout[len(done)].offset if len(done) < len(layout) else fh.seek(0, os.SEEK_END)
        fh.truncate(end)
        fh.seek(end)
        yield fh


def data_chunks(data) -> Iterator[np.ndarray]:
    return data.slabs() if isinstance(data, SlabbedTensor) else iter([data])


def write_tensor(fh, data, where: resume.WrittenTensor, alignment: int) -> str:
    """One tensor's bytes at its planned offset (zeros pad up to it), padded to the alignment after,
    as GGUFWriter.write_tensor_data writes them; returns their sha256."""
    if fh.tell() > where.offset:
        raise InternalError(f"{where.name}: the file is at byte {fh.tell()}, past the tensor's offset {where.offset}")
    fh.write(bytes(where.offset - fh.tell()))
    digest, written = hashlib.sha256(), 0
    for chunk in data_chunks(data):
        view = memoryview(np.ascontiguousarray(chunk)).cast("B")
        digest.update(view)
        fh.write(view)
        written += view.nbytes
    if written != where.nbytes:
        raise InternalError(f"{where.name}: wrote {written} bytes, planned {where.nbytes}")
    fh.write(bytes(aligned(written, alignment) - written))
    return digest.hexdigest()


def record(state: Path | None, saved: resume.Progress, tensor: resume.WrittenTensor, fh) -> None:
    """A tensor is complete: flushed to the file, then added to the saved progress (when kept)."""
    if state is None:
        return
    fh.flush()
    saved.tensors.append(tensor)
    resume.save(state, saved)
