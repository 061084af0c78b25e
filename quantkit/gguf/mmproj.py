"""A VLM's vision tower and projector as llama.cpp's multimodal projector file (`mmproj-*.gguf`).

llama.cpp runs a VLM from two files: the language model (quantkit.gguf.convert) and this one,
which its clip code (llama-mtmd-cli, llama-server --mmproj, Ollama's second FROM) loads. Each
family is written the way llama.cpp's own converter writes it, byte for byte:

* Qwen2-VL, Qwen2.5-VL, Gemma 3: `convert_hf_to_gguf.py MODEL --mmproj` (its MmprojModel and the
  family's vision class): tensor names, the fused qkv split into q/k/v, Qwen's Conv3D patch
  embedding split into one Conv2D kernel per time step, Gemma's `soft_emb_norm` stored as w + 1,
  the `clip.*` metadata, gguf.Metadata's general.* keys, and its types (below).
* Mistral 3 (Pixtral tower): convert_hf_to_gguf.py's LlavaVisionModel, with the `[IMG_BREAK]` row of
  embed_tokens (v.token_embd.img_break) that it takes but its MmprojModel.filter_tensors drops for a
  Hugging Face-layout checkpoint; llama.cpp's clip loader cannot load the file without it.
* LLaVA 1.5 (LlavaForConditionalGeneration with a CLIP tower): convert_hf_to_gguf.py refuses it
  (its LlavaVisionModel takes Pixtral towers only); llama.cpp's documented path is
  tools/mtmd/legacy-models/llava_surgery_v2.py + convert_image_encoder_to_gguf.py on the split-off
  CLIP tower, which writes the legacy CLIP layout (`clip.has_llava_projector`, projector type
  `mlp`, fc1 stored as `ffn_down`, the last encoder layer and post_layernorm dropped because LLaVA
  reads the second-to-last layer). That is what is written for LLaVA.

Types (`mmproj` option):
* auto: what the converter does without --outtype. convert_hf_to_gguf: the first 2-D tower
  weight decides, BF16 for bf16, F16 for f16 or anything else (so a 16-bit tower keeps its own
  type); the legacy LLaVA converter: f16.
* f16 / bf16 / f32: --outtype f16|bf16|f32 (legacy LLaVA: f16, or --use-f32; no bf16).
Within a file the converter's rules apply: 1-D tensors, norms, biases and position embeddings
F32; the patch embedding F16 in an f16 file, else F32 (legacy: always F16); Gemma 3's input
projection F16 (llama.cpp issue 13025). A bf16 source written F16 is rounded (round to nearest
even, as numpy's astype does in the converter); quantkit.gguf.mmproj.tensor_report says per tensor
whether the file holds the source values exactly.

Checkpoint layouts: names are read in the Hub layout (`vision_tower.vision_model.*`, `visual.*`,
`multi_modal_projector.*`); checkpoints saved by transformers >= 4.52 (`model.` prefix) or 5.x
(no `vision_model.` level inside a CLIP/SigLIP tower) are renamed to it first (`hub_name`), so they
give the same file as their Hub-layout twin (llama.cpp's converters read the Hub layout only).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from quantkit.errors import InputError, UnsupportedError
from quantkit.gguf.mixture import T

LEGACY = "convert_image_encoder_to_gguf.py"  # tools/mtmd/legacy-models (LLaVA 1.5 with a CLIP tower)
MODERN = "convert_hf_to_gguf.py --mmproj"
MMPROJ_TYPES = ("auto", "f16", "bf16", "f32")
OUTTYPES = {"f16": T.F16, "bf16": T.BF16, "f32": T.F32}
FILE_TYPES = {T.F32: 0, T.F16: 1, T.BF16: 32}  # gguf.LlamaFileType ALL_F32 / MOSTLY_F16 / MOSTLY_BF16
CLIP_DEFAULT_MEAN = [0.48145466, 0.4578275, 0.40821073]  # convert_image_encoder_to_gguf.py's defaults
CLIP_DEFAULT_STD = [0.26862954, 0.26130258, 0.27577711]


@dataclass(frozen=True)
class Rule:
    """One checkpoint tensor (a full-match regex over its Hub-layout name) and what it becomes."""

    pattern: str
    names: tuple[str, ...]  # GGUF name(s), formatted with the match groups; several: the tensor is split
    split: str = ""  # "rows": equal parts along the first axis (fused qkv); "time": Conv3D kernel per time step;
    # "token": the row of the added token `token` (its id from the tokenizer files); "patch_hwc": a linear patch
    # embedding over (height, width, channel) pixels written as a Conv2D kernel [out, channel, height, width]
    # (Gemma 4); a scalar tensor (Gemma 4's clipping bounds) is written with one element
    shift: bool = False  # stored w + 1 (Gemma's RMSNorm scales by 1 + w)
    force: T | str | None = None  # the converter's tensor_force_quant: a type, "patch" (F16 in an f16 file, else F32)
    permute: bool = False  # LlamaModel.permute of the rows by vision heads (Pixtral's q/k: rotary pairs interleaved)
    index: str = ""  # a vision_config list the first match group indexes (Qwen3-VL's deepstack_visual_indexes)
    token: str = ""  # split "token": the added token whose embedding row is written (llama.cpp's loader needs it)


@dataclass(frozen=True)
class Family:
    name: str
    converter: str  # MODERN or LEGACY
    projector_type: str  # clip.projector_type
    rules: tuple[Rule, ...]
    dropped: tuple[tuple[str, str], ...] = ()  # (regex over Hub names, why the converter leaves it out)
    renames: tuple[tuple[str, str], ...] = ()  # other checkpoint layouts -> the Hub layout (re.sub, in order)
    note: str = ""  # what README's VLM table adds


def blocks(prefix: str, parts: dict[str, str]) -> tuple[Rule, ...]:
    """Rules for the encoder blocks: `{prefix}.N.{hf}.(weight|bias)` -> `v.blk.N.{gguf}.(weight|bias)`."""
    return tuple(Rule(rf"{re.escape(prefix)}\.(\d+)\.{re.escape(hf)}\.(weight|bias)", (f"v.blk.{{0}}.{g}.{{1}}",))
                 for hf, g in parts.items())


QWEN_RENAMES = ((r"^model\.visual\.", "visual."),)  # transformers 5 nests the tower under model.
QWEN_BLOCK = {"attn.proj": "attn_out", "norm1": "ln1", "norm2": "ln2"}
QWEN_COMMON = (
    Rule(r"visual\.blocks\.(\d+)\.attn\.qkv\.(weight|bias)",
         ("v.blk.{0}.attn_q.{1}", "v.blk.{0}.attn_k.{1}", "v.blk.{0}.attn_v.{1}"), split="rows"),
    Rule(r"visual\.merger\.ln_q\.(weight|bias)", ("v.post_ln.{0}",)),
    Rule(r"visual\.merger\.mlp\.(0|2)\.(weight|bias)", ("mm.{0}.{1}",)),
    Rule(r"visual\.patch_embed\.proj\.weight", ("v.patch_embd.weight", "v.patch_embd.weight.1"), split="time",
         force="patch"),
)
SIGLIP_BLOCK = {"layer_norm1": "ln1", "layer_norm2": "ln2", "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down",
                "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.out_proj": "attn_out"}
# the legacy converter's string replacements, in CLIPEncoderLayer's module order (its tensor order)
LEGACY_CLIP_BLOCK = {"self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.q_proj": "attn_q",
                     "self_attn.out_proj": "attn_out", "layer_norm1": "ln1", "mlp.fc1": "ffn_down",
                     "mlp.fc2": "ffn_up", "layer_norm2": "ln2"}
TOWER = "vision_tower.vision_model"
# transformers >= 4.52 saves `model.`-prefixed towers; 5.x drops the `vision_model.` level of CLIP/SigLIP
NESTED_RENAMES = ((r"^model\.(vision_tower|multi_modal_projector)\.", r"\1."),
                  (r"^vision_tower\.(?!vision_model\.)", "vision_tower.vision_model."))

TEXT_CONFIG_NOTE = "the language model when text_config.architectures names a converted one, as SmolVLM's do"
IDEFICS3_TOWER = "model.vision_model"
IDEFICS3_RULES = (  # SmolVLMModel: the SigLIP embeddings forced F32 (even in an f16 file)
    Rule(r"model\.connector\.modality_projection\.proj\.weight", ("mm.model.fc.weight",)),
    Rule(rf"{IDEFICS3_TOWER}\.embeddings\.patch_embedding\.(weight|bias)", ("v.patch_embd.{0}",), force=T.F32),
    Rule(rf"{IDEFICS3_TOWER}\.embeddings\.position_embedding\.weight", ("v.position_embd.weight",), force=T.F32),
    *blocks(f"{IDEFICS3_TOWER}.encoder.layers", SIGLIP_BLOCK),
    Rule(rf"{IDEFICS3_TOWER}\.post_layernorm\.(weight|bias)", ("v.post_ln.{0}",)))

# LlavaVisionModel writes the [IMG_BREAK] row of embed_tokens (llama.cpp's clip loader requires it), but this
# converter's MmprojModel.filter_tensors drops every `language_model.*` tensor before it gets there: its own file
# for a Hugging Face-layout checkpoint fails to load ('unable to find tensor v.token_embd.img_break')
IMG_BREAK_NOTE = ("with the [IMG_BREAK] embedding row the converter's LlavaVisionModel takes, which its "
                  "language_model.* filter drops")

# the VLMs whose tower Qwen3VLVisionModel converts
QWEN3_VL_TOWERS = ("qwen3_vl", "qwen3_5", "qwen3_5_moe")
QWEN3_VL_RULES = (
    *(Rule(rf"visual\.deepstack_merger_list\.(\d+)\.{hf}\.(weight|bias)", (f"v.deepstack.{{0}}.{g}.{{1}}",),
           index="deepstack_visual_indexes") for hf, g in (("norm", "norm"), ("linear_fc1", "fc1"), ("linear_fc2", "fc2"))),
    Rule(r"visual\.merger\.linear_fc1\.(weight|bias)", ("mm.0.{0}",)),
    Rule(r"visual\.merger\.linear_fc2\.(weight|bias)", ("mm.2.{0}",)),
    Rule(r"visual\.merger\.norm\.(weight|bias)", ("v.post_ln.{0}",)),
    Rule(r"visual\.patch_embed\.proj\.weight", ("v.patch_embd.weight", "v.patch_embd.weight.1"), split="time",
         force="patch"),
    Rule(r"visual\.patch_embed\.proj\.bias", ("v.patch_embd.bias",)),
    Rule(r"visual\.pos_embed\.weight", ("v.position_embd.weight",)),
    *blocks("visual.blocks", {"attn.qkv": "attn_qkv", "attn.proj": "attn_out", "norm1": "ln1", "norm2": "ln2",
                              "mlp.linear_fc1": "ffn_up", "mlp.linear_fc2": "ffn_down"}))

# Gemma4VisionAudioModel: the tower's `encoder.` renamed to `vision_model.model.` before gguf-py's TensorNameMap, the
# ClippableLinear's `.linear` level dropped; its clipping bounds (use_clipped_linears) written as 1-element tensors
GEMMA4_BLOCK = {"input_layernorm": "ln1", "post_attention_layernorm": "attn_post_norm",
                "pre_feedforward_layernorm": "ln2", "post_feedforward_layernorm": "ffn_post_norm",
                "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"}
GEMMA4_LINEAR = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                 "self_attn.o_proj": "attn_out", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}
GEMMA4_TOWER = "vision_tower.encoder.layers"
GEMMA4_RULES = (
    Rule(r"embed_vision\.embedding_projection\.weight", ("mm.input_projection.weight",)),
    *blocks(GEMMA4_TOWER, GEMMA4_BLOCK),
    *(Rule(rf"{re.escape(GEMMA4_TOWER)}\.(\d+)\.{re.escape(hf)}\.linear\.weight", (f"v.blk.{{0}}.{g}.weight",))
      for hf, g in GEMMA4_LINEAR.items()),
    *(Rule(rf"{re.escape(GEMMA4_TOWER)}\.(\d+)\.{re.escape(hf)}\.((?:input|output)_(?:max|min))",
           (f"v.blk.{{0}}.{g}.{{1}}",)) for hf, g in GEMMA4_LINEAR.items()),
    Rule(r"vision_tower\.patch_embedder\.input_proj\.weight", ("v.patch_embd.weight",), split="patch_hwc",
         force="patch"),
    Rule(r"vision_tower\.patch_embedder\.position_embedding_table", ("v.position_embd.weight",), force=T.F32))

FAMILIES: dict[str, Family] = {
    "llava": Family(
        "LLaVA 1.5 (CLIP tower)", LEGACY, "mlp",
        (Rule(r"multi_modal_projector\.linear_1\.(weight|bias)", ("mm.0.{0}",)),
         Rule(r"multi_modal_projector\.linear_2\.(weight|bias)", ("mm.2.{0}",)),
         Rule(rf"{TOWER}\.embeddings\.class_embedding", ("v.class_embd",)),
         Rule(rf"{TOWER}\.embeddings\.patch_embedding\.weight", ("v.patch_embd.weight",)),
         Rule(rf"{TOWER}\.embeddings\.position_embedding\.weight", ("v.position_embd.weight",)),
         Rule(rf"{TOWER}\.pre_layrnorm\.(weight|bias)", ("v.pre_ln.{0}",)),
         *blocks(f"{TOWER}.encoder.layers", LEGACY_CLIP_BLOCK)),
        dropped=((rf"{TOWER}\.post_layernorm\..*", "LLaVA reads the second-to-last layer, before post_layernorm"),
                 (rf"{TOWER}\.embeddings\.position_ids", "a buffer, not a weight")),
        renames=NESTED_RENAMES, note="CLIP towers; a Pixtral tower is refused"),
    "qwen2_vl": Family(
        "Qwen2-VL", MODERN, "qwen2vl_merger",
        QWEN_COMMON + blocks("visual.blocks", {**QWEN_BLOCK, "mlp.fc1": "ffn_up", "mlp.fc2": "ffn_down"}),
        renames=QWEN_RENAMES),
    "qwen2_5_vl": Family(
        "Qwen2.5-VL", MODERN, "qwen2.5vl_merger",
        QWEN_COMMON + blocks("visual.blocks", {**QWEN_BLOCK, "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                                               "mlp.down_proj": "ffn_down"}),
        renames=QWEN_RENAMES),
    "qwen3_vl": Family("Qwen3-VL", MODERN, "qwen3vl_merger", QWEN3_VL_RULES, renames=QWEN_RENAMES),
    # Qwen3VLVisionModel converts Qwen3.5's tower too: Qwen3-VL's without deepstack mergers
    "qwen3_5": Family("Qwen3.5", MODERN, "qwen3vl_merger", QWEN3_VL_RULES, renames=QWEN_RENAMES),
    "qwen3_5_moe": Family("Qwen3.5-MoE", MODERN, "qwen3vl_merger", QWEN3_VL_RULES, renames=QWEN_RENAMES),
    "idefics3": Family("Idefics3", MODERN, "idefics3", IDEFICS3_RULES, note=TEXT_CONFIG_NOTE),
    "smolvlm": Family("SmolVLM", MODERN, "idefics3", IDEFICS3_RULES, note=TEXT_CONFIG_NOTE),
    "mistral3": Family(
        "Mistral 3 (Pixtral tower)", MODERN, "pixtral",
        (Rule(r"(?:model\.)?language_model\.(?:model\.)?embed_tokens\.weight", ("v.token_embd.img_break",),
              split="token", token="[IMG_BREAK]"),
         Rule(r"multi_modal_projector\.linear_(1|2)\.(weight|bias)", ("mm.{0}.{1}",)),
         Rule(r"multi_modal_projector\.norm\.weight", ("mm.input_norm.weight",)),
         Rule(r"multi_modal_projector\.patch_merger\.merging_layer\.weight", ("mm.patch_merger.weight",),
              force="patch"),
         Rule(r"vision_tower\.ln_pre\.weight", ("v.pre_ln.weight",)),
         Rule(r"vision_tower\.patch_conv\.weight", ("v.patch_embd.weight",), force="patch"),
         *(Rule(rf"vision_tower\.transformer\.layers\.(\d+)\.attention\.{p}_proj\.(weight|bias)",
                (f"v.blk.{{0}}.attn_{p}.{{1}}",), permute=True) for p in ("q", "k")),
         *blocks("vision_tower.transformer.layers", {
             "attention.v_proj": "attn_v", "attention.o_proj": "attn_out", "attention_norm": "ln1",
             "ffn_norm": "ln2", "feed_forward.gate_proj": "ffn_gate", "feed_forward.up_proj": "ffn_up",
             "feed_forward.down_proj": "ffn_down"})),
        renames=((r"^model\.(vision_tower|multi_modal_projector)\.", r"\1."),),
        note=IMG_BREAK_NOTE),
    "gemma3": Family(
        "Gemma 3", MODERN, "gemma3",
        (Rule(r"multi_modal_projector\.mm_input_projection_weight", ("mm.input_projection.weight",), force=T.F16),
         Rule(r"multi_modal_projector\.mm_soft_emb_norm\.weight", ("mm.soft_emb_norm.weight",), shift=True),
         Rule(rf"{TOWER}\.embeddings\.patch_embedding\.(weight|bias)", ("v.patch_embd.{0}",), force=T.F32),
         Rule(rf"{TOWER}\.embeddings\.position_embedding\.weight", ("v.position_embd.weight",), force=T.F32),
         *blocks(f"{TOWER}.encoder.layers", SIGLIP_BLOCK),
         Rule(rf"{TOWER}\.post_layernorm\.(weight|bias)", ("v.post_ln.{0}",))),
        dropped=((rf"{TOWER}\.head\..*", "SigLIP's pooling head: Gemma 3 does not use it (the converter skips it)"),),
        renames=NESTED_RENAMES),
    "gemma4": Family("Gemma 4", MODERN, "gemma4v", GEMMA4_RULES, renames=((r"^model\.", ""),)),
}


@dataclass
class Piece:
    """One GGUF tensor of the mmproj: a (part of a) checkpoint tensor, transformed and typed."""

    name: str  # GGUF name
    source: str  # checkpoint name (as stored)
    hub: str  # the Hub-layout name the rules matched
    rule: Rule
    part: int  # which part of a split tensor; split "token": the token id (the row); else 0
    shape: tuple[int, ...]  # numpy order, as written
    qtype: T = T.F32
    source_dtype: str = "BF16"
    heads: int = 0  # rows permuted in groups of this many heads (Rule.permute)


@dataclass
class MmprojPlan:
    family: str  # model_type
    converter: str
    outtype: T  # the file type (general.file_type)
    pieces: list[Piece]
    dropped: dict[str, str] = field(default_factory=dict)  # checkpoint name -> why it is not written
    config: dict = field(default_factory=dict)


@dataclass
class MmprojResult:
    path: Path
    family: str
    converter: str
    file_type: str
    type_counts: dict[str, int]
    tensors: int
    bytes: int


def supported_families() -> list[str]:
    return sorted(FAMILIES)


def family_of(config: dict) -> Family:
    """The config's family row, or UnsupportedError naming the supported ones."""
    model_type = config.get("model_type", "?")
    if model_type not in FAMILIES:
        raise UnsupportedError(
            f"gguf: no mmproj (vision tower) conversion for '{model_type}' "
            f"({(config.get('architectures') or ['?'])[0]})",
            hint="mmproj supported for: " + ", ".join(f"{FAMILIES[k].name} ({k})" for k in supported_families())
                 + "; set the gguf option mmproj: none to write the language model alone (no image input)")
    return FAMILIES[model_type]


def hub_name(family: Family, name: str) -> str:
    for pattern, repl in family.renames:
        name = re.sub(pattern, repl, name)
    return name


def match(family: Family, hub: str) -> tuple[Rule, tuple[str, ...]] | None:
    for rule in family.rules:
        if (m := re.fullmatch(rule.pattern, hub)) is not None:
            return rule, m.groups()
    return None


def is_language_model(name: str) -> bool:
    return bool(re.match(r"^(model\.)?(language_model\.|text_model\.|layers\.|embed_tokens\.|norm\.)|^lm_head\.", name))


# ------------------------------------------------------------------ checks (config.json only)


def check(config: dict, mmproj_type: str) -> Family:
    """Refuse, before any work, what the family's llama.cpp converter does not convert."""
    family = family_of(config)
    vision = config.get("vision_config") or {}

    def refuse(what: str, hint: str):
        raise UnsupportedError(f"gguf mmproj of {family.name}: {what}", hint=hint)

    if mmproj_type not in MMPROJ_TYPES:
        refuse(f"unknown mmproj type '{mmproj_type}'", "one of: " + ", ".join((*MMPROJ_TYPES, "none")))
    if family.converter == LEGACY:
        if mmproj_type == "bf16":
            refuse("the legacy CLIP format has no bf16", "use mmproj: auto (f16) or f32")
        if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
            refuse(f"vision tower '{vision.get('model_type')}' (only a CLIP tower converts here)",
                   "convert a Pixtral tower with llama.cpp's convert_hf_to_gguf.py --mmproj, and the language "
                   "model with quantkit --mmproj none")
        layer, strategy = config.get("vision_feature_layer", -2), config.get("vision_feature_select_strategy", "default")
        if layer != -2 or strategy != "default":
            refuse(f"vision_feature_layer {layer} / select strategy '{strategy}' (llama.cpp's LLaVA mmproj reads "
                   "the second-to-last CLIP layer without the class token)",
                   "supported: vision_feature_layer -2, vision_feature_select_strategy default (LLaVA 1.5)")
        if config.get("projector_hidden_act", "gelu") != "gelu" or config.get("multimodal_projector_bias") is False:
            refuse("a projector other than Linear-GELU-Linear with biases", "LLaVA 1.5's projector is supported")
    if any(r.split == "time" for r in family.rules) and vision.get("temporal_patch_size", 2) != 2:
        refuse("temporal_patch_size other than 2", "llama.cpp splits the Conv3D patch embedding into 2 kernels")
    if config.get("model_type") == "mistral3":
        if vision.get("model_type") != "pixtral":
            refuse(f"vision tower '{vision.get('model_type')}' (llama.cpp's LlavaVisionModel takes Pixtral towers)",
                   "a Mistral 3 checkpoint with its Pixtral tower")
        if vision.get("hidden_act") not in ("gelu", "silu"):
            refuse(f"Pixtral hidden_act '{vision.get('hidden_act')}'", "llama.cpp's Pixtral tower runs gelu or silu")
        if vision.get("num_hidden_layers", 24) < 3:
            refuse(f"a Pixtral tower of {vision.get('num_hidden_layers')} layers (the converter maps the projector's "
                   "linear_1 / linear_2 through a tensor map sized by the tower's depth: 'Can not map tensor')",
                   "a tower of at least 3 layers, as every released Mistral 3 has")
    if config.get("model_type") == "gemma4":
        if config.get("audio_config"):
            refuse("the audio tower (Gemma 4 E2B / E4B) is not converted here (llama.cpp's converter writes it "
                   "into the same mmproj)", "set the gguf option mmproj: none to write the language model alone, "
                   "and convert the mmproj with llama.cpp's convert_hf_to_gguf.py --mmproj")
        if vision.get("standardize"):
            refuse("vision_config.standardize (its std_bias / std_scale have no GGUF name in llama.cpp's converter)",
                   "set the gguf option mmproj: none to write the language model alone")
    if config.get("model_type") == "qwen2_5_vl":
        n_wa_pattern(vision, family)
    if config.get("model_type") in QWEN3_VL_TOWERS:
        # Qwen3-VL's config class default; Qwen3.5's tower has no deepstack merger
        default = [8, 16, 24] if config["model_type"] == "qwen3_vl" else []
        depth, deepstack = vision.get("depth", 27), vision.get("deepstack_visual_indexes", default)
        if any(not 0 <= i < depth for i in deepstack):
            refuse(f"deepstack_visual_indexes {deepstack} outside the {depth} encoder blocks",
                   "each deepstack merger reads one encoder block")
        layers = text_layers(config)
        if len(deepstack) >= layers:
            refuse(f"{len(deepstack)} deepstack mergers for {layers} decoder layers (llama.cpp's qwen3vl graph adds "
                   "deepstack features to the last layer after its output rows are selected: GGML_ASSERT("
                   "ggml_can_repeat(b, a)) aborts)", "fewer deepstack mergers than decoder layers, as every "
                   "released Qwen3-VL has")
    return family


def n_wa_pattern(vision: dict, family: Family) -> int:
    """Qwen2.5-VL's window-attention pattern: full attention every n-th block (evenly spaced)."""
    full = vision.get("fullatt_block_indexes")
    if not full:
        raise UnsupportedError(f"gguf mmproj of {family.name}: vision_config has no fullatt_block_indexes",
                               hint="Qwen2.5-VL checkpoints list their full-attention blocks")
    step = full[0] + 1
    if any(b - a != step for a, b in zip(full, full[1:])):
        raise UnsupportedError(f"gguf mmproj of {family.name}: full-attention blocks {full} are not evenly spaced",
                               hint="llama.cpp's clip code supports one window pattern (n_wa_pattern)")
    return step


# ------------------------------------------------------------------ plan


def plan(model_dir: Path, mmproj_type: str = "auto") -> MmprojPlan:
    """Which tensors the mmproj holds, their names, shapes and types (nothing read but headers)."""
    from quantkit.io.checkpoint import check_model_dir

    info = check_model_dir(Path(model_dir))
    config = complete(info.config)
    family = check(config, mmproj_type)
    pieces, dropped = [], {}
    skip = legacy_skipped_layer(config) if family.converter == LEGACY else None
    for name, (dtype, shape) in info.tensors.items():
        hub = hub_name(family, name)
        if is_language_model(name) and not any(r.token and re.fullmatch(r.pattern, hub) for r in family.rules):
            continue
        why = next((reason for pattern, reason in family.dropped if re.fullmatch(pattern, hub)), None)
        if why is None and skip is not None and re.match(rf"{re.escape(TOWER)}\.encoder\.layers\.{skip}\.", hub):
            why = f"encoder layer {skip} is the last one: LLaVA reads the second-to-last layer's output"
        if why is not None:
            dropped[name] = why
            continue
        found = match(family, hub)
        if found is None:
            raise UnsupportedError(f"gguf mmproj of {family.name}: no GGUF name for tensor '{name}'",
                                   hint="the checkpoint has a tower tensor llama.cpp's converter does not know")
        rule, groups = indexed(*found, config)
        if rule.split == "token":
            pieces.append(Piece(rule.names[0], name, hub, rule, token_id(Path(model_dir), rule.token, family),
                                tuple(shape[1:]), source_dtype=dtype))
            continue
        for part, shape_out in enumerate(split_shapes(rule, tuple(shape), family.converter == LEGACY)):
            pieces.append(Piece(rule.names[part].format(*groups), name, hub, rule, part, shape_out,
                                source_dtype=dtype, heads=vision_heads(config) if rule.permute else 0))
    if not pieces:
        raise UnsupportedError(f"gguf mmproj of {family.name}: the checkpoint has no vision tower tensors",
                               hint="write the language model alone with --mmproj none")
    for rule in family.rules:
        if rule.token and not any(p.rule is rule for p in pieces):
            raise UnsupportedError(f"gguf mmproj of {family.name}: no token embedding for {rule.names[0]} (the "
                                   f"{rule.token} row)", hint="the checkpoint's language model embed_tokens.weight")
    if family.converter == LEGACY:
        pieces = legacy_order(family, pieces)
        outtype = T.F32 if mmproj_type == "f32" else T.F16
    else:
        outtype = OUTTYPES[mmproj_type] if mmproj_type in OUTTYPES else guessed_outtype(pieces)
    for piece in pieces:
        piece.qtype = (legacy_type if family.converter == LEGACY else modern_type)(piece, outtype)
    return MmprojPlan(config["model_type"], family.converter, outtype, pieces, dropped, config)


def token_id(model_dir: Path, token: str, family: Family) -> int:
    """LlavaVisionModel.get_token_id: the added token's id from tokenizer_config.json's
    added_tokens_decoder, else tokenizer.json's added_tokens; refused when absent (or id 0, which the
    converter does not write): llama.cpp's clip loader cannot load the mmproj without its row."""
    import json

    found = None
    for file, key in (("tokenizer_config.json", "added_tokens_decoder"), ("tokenizer.json", "added_tokens")):
        path = model_dir / file
        if found is None and path.is_file():
            entries = json.loads(path.read_text(encoding="utf-8")).get(key) or {}
            items = entries.items() if isinstance(entries, dict) else ((e.get("id"), e) for e in entries)
            found = next((int(i) for i, e in items if e.get("content") == token), None)
    if not found:
        raise UnsupportedError(
            f"gguf mmproj of {family.name}: the tokenizer has no {token} added token"
            + (" (id 0: llama.cpp's converter writes no row for it)" if found == 0 else ""),
            hint=f"llama.cpp's clip loader needs the {token} embedding row; use the model's own tokenizer files "
                 "(tokenizer.json / tokenizer_config.json), or set the gguf option mmproj: none to write the "
                 "language model alone (no image input)")
    return found


def indexed(rule: Rule, groups: tuple[str, ...], config: dict) -> tuple[Rule, tuple[str, ...]]:
    """The match groups with the first one looked up in the rule's vision_config list (Qwen3-VL's
    deepstack merger N is written under the number of the encoder block it reads)."""
    if not rule.index:
        return rule, groups
    return rule, (str(config["vision_config"][rule.index][int(groups[0])]), *groups[1:])


def vision_heads(config: dict) -> int:
    return int(find(vision_params(config), ("num_attention_heads", "num_heads", "heads", "vt_num_attention_heads")))


def complete(config: dict) -> dict:
    """config.json with transformers' defaults filled in (AutoConfig.to_dict(), as the converters read it)."""
    from quantkit.gguf.convert import complete_config

    return complete_config(config)


def legacy_skipped_layer(config: dict) -> int:
    """The encoder layer the legacy converter pops (LLaVA reads layer -2's output)."""
    return int(config["vision_config"]["num_hidden_layers"]) - 1


def split_shapes(rule: Rule, shape: tuple[int, ...], squeeze: bool) -> list[tuple[int, ...]]:
    """The shape of each written part (the legacy converter squeezes size-1 axes)."""
    if squeeze:
        return [tuple(d for d in shape if d != 1)]
    if rule.split == "rows":
        if shape[0] % 3:
            raise InputError(f"the vision tower's fused qkv weight has {shape[0]} rows, not a multiple of 3",
                             hint="the vision tower's fused qkv is damaged or of another layout; --mmproj none writes "
                                  "the language model alone")
        return [(shape[0] // 3, *shape[1:])] * 3
    if rule.split == "time":
        return [(shape[0], shape[1], *shape[3:])] * shape[2]
    if rule.split == "patch_hwc":
        size = int(round((shape[1] // 3) ** 0.5))
        return [(shape[0], 3, size, size)]
    return [shape or (1,)]


def legacy_order(family: Family, pieces: list[Piece]) -> list[Piece]:
    """convert_image_encoder_to_gguf.py's order: projector tensors as llava.projector holds them
    (checkpoint order), then the CLIP tower's state_dict (module order: rule order, per layer)."""
    rank = {rule.pattern: i for i, rule in enumerate(family.rules)}

    def key(piece: Piece):
        if piece.hub.startswith("multi_modal_projector."):
            return (0, 0, 0, 0)
        layer = re.search(r"\.layers\.(\d+)\.", piece.hub)
        return (1, int(layer.group(1)) if layer else -1, rank[piece.rule.pattern], piece.hub.endswith(".bias"))

    return sorted(pieces, key=key)  # stable: projector tensors keep their checkpoint order


def guessed_outtype(pieces: list[Piece]) -> T:
    """ModelBase's --outtype auto: the first 2-D (or larger) tower tensor stored as bf16 or f16 decides."""
    for piece in pieces:
        if len(piece.shape) >= 2 and piece.source_dtype in ("BF16", "F16"):
            return T.BF16 if piece.source_dtype == "BF16" else T.F16
    return T.F16


def modern_type(piece: Piece, outtype: T) -> T:
    """ModelBase.prepare_tensors' type rules (with the family's tensor_force_quant)."""
    forced = piece.rule.force
    if forced == "patch":
        forced = T.F16 if outtype == T.F16 else T.F32
    if len(piece.shape) <= 1 or piece.name.endswith("_norm.weight"):
        return T.F32
    if forced is not None:
        return forced
    if piece.name == "v.position_embd.weight" or not piece.name.endswith(".weight"):
        return T.F32
    return outtype


def legacy_type(piece: Piece, outtype: T) -> T:
    """convert_image_encoder_to_gguf.py: projector 2-D/4-D F16, else F32; tower 4-D F16, 2-D
    `.weight` F16 in an f16 file, everything else F32."""
    ndim = len(piece.shape)
    if piece.hub.startswith("multi_modal_projector."):
        return T.F16 if ndim in (2, 4) else T.F32
    if ndim == 4:
        return T.F16
    return T.F16 if outtype == T.F16 and ndim == 2 and piece.name.endswith(".weight") else T.F32


# ------------------------------------------------------------------ tensor data


def piece_values(piece: Piece, data: np.ndarray) -> np.ndarray:
    """The float32 values of one piece from the rows of its source tensor source_rows names (float32 as read)."""
    from quantkit.arch.families.text import shift_norm
    from quantkit.gguf.convert import permute

    if piece.heads:
        data = permute(data, piece.heads)
    if piece.rule.split == "rows":
        n = data.shape[0] // 3
        data = data[piece.part * n:(piece.part + 1) * n]
    elif piece.rule.split == "time":
        data = data[:, :, piece.part]
    elif piece.rule.split == "token":  # read as its one row
        data = data[0]
    elif piece.rule.split == "patch_hwc":
        data = data.reshape(data.shape[0], piece.shape[2], piece.shape[3], 3).transpose(0, 3, 1, 2)
    if piece.rule.shift:
        data = shift_norm(data, piece.source_dtype)
    return np.ascontiguousarray(data.reshape(piece.shape), dtype=np.float32)


def encode(values: np.ndarray, qtype: T) -> np.ndarray:
    """float32 values as the converter stores them (numpy's round-to-nearest-even casts, gguf-py's bf16)."""
    import gguf

    if qtype == T.F32:
        return values
    if qtype == T.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values, qtype)


def source_rows(piece: Piece, shape: tuple[int, ...]) -> tuple[int, int]:
    """The rows of its source tensor a piece needs: one embedding row for a "token" piece (not the
    whole vocabulary table), else all of them."""
    if piece.rule.split == "token":
        return piece.part, piece.part + 1
    return 0, shape[0] if len(shape) > 1 else 1


def read_source(handles: dict, piece: Piece) -> np.ndarray:
    handle = handles[piece.source]
    return handle.read(piece.source, *source_rows(piece, tuple(handle.header[piece.source]["shape"])))


# ------------------------------------------------------------------ metadata


def image_stats(model_dir: Path) -> dict:
    """MmprojModel's preprocessor config: preprocessor_config.json, then processor_config.json
    (its image_processor moved to the top level) merged over it."""
    import json

    merged: dict = {}
    pre, proc = Path(model_dir) / "preprocessor_config.json", Path(model_dir) / "processor_config.json"
    if pre.is_file():
        cfg = json.loads(pre.read_text(encoding="utf-8"))
        merged.update({**cfg, **cfg["media_proc_cfg"]} if "media_proc_cfg" in cfg else cfg)
    if proc.is_file():
        cfg = json.loads(proc.read_text(encoding="utf-8"))
        merged.update({**cfg, **cfg["image_processor"]} if "image_processor" in cfg else cfg)
    return merged


def need_stats(stats: dict, family: Family) -> tuple[list, list]:
    if "image_mean" not in stats or "image_std" not in stats:
        raise InputError(f"gguf mmproj of {family.name}: the checkpoint has no image processor config with "
                         "image_mean / image_std", hint="copy the model's preprocessor_config.json into its directory")
    return stats["image_mean"], stats["image_std"]


def text_layers(config: dict) -> int:
    return int({**config, **(config.get("text_config") or {})}.get("num_hidden_layers", 0))


def text_hidden(config: dict) -> int:
    text = {**config, **(config.get("text_config") or {})}
    return text.get("hidden_size", text.get("n_embd", 0))


def find(obj: dict, keys: tuple[str, ...]):
    key = next((k for k in keys if k in obj), None)
    if key is None:
        raise InputError(f"config.json: vision_config has none of {', '.join(keys)}",
                         hint="the config.json lacks a field the converter needs; --mmproj none writes the language "
                              "model alone")
    return obj[key]


BLOCK_KEYS = ("n_layers", "num_hidden_layers", "n_layer", "num_layers", "depth", "layers", "encoder_layers",
              "vt_num_hidden_layers")


def vision_params(config: dict) -> dict:
    """vision_config as the family's converter sees it (Qwen2VLVisionModel renames its keys)."""
    vision = dict(config["vision_config"])
    if config["model_type"] in QWEN3_VL_TOWERS:  # Qwen3VLVisionModel: image_size from the position embedding grid
        if "image_size" not in vision:
            vision["image_size"] = int(vision.get("num_position_embeddings", 2304) ** 0.5 * vision.get("patch_size", 16))
        vision["num_attention_heads"] = vision.get("num_heads")
        vision["num_hidden_layers"] = vision.get("depth")
    if config["model_type"] == "gemma4":  # Gemma4VisionAudioModel: 224 ("unused, but set to avoid error")
        vision["image_size"] = 224
    if config["model_type"] in ("qwen2_vl", "qwen2_5_vl"):
        vision["image_size"] = vision.get("image_size", 560)
        vision["num_attention_heads"] = vision.get("num_heads")
        vision["num_hidden_layers"] = vision.get("depth")
        if "embed_dim" in vision:
            vision["intermediate_size"] = vision.get("hidden_size")
            vision["hidden_size"] = vision.get("embed_dim")
    return vision


def modern_metadata(config: dict, family: Family, stats: dict, outtype: T) -> list[tuple[str, str, object]]:
    """MmprojModel.set_gguf_parameters + the family's own keys, in the converter's order."""
    vision = vision_params(config)
    mean, std = need_stats(stats, family)
    items = [("general.file_type", "u32", FILE_TYPES[outtype]),
             ("clip.has_vision_encoder", "bool", True),
             ("clip.vision.projection_dim", "u32", text_hidden(config)),
             ("clip.vision.image_size", "u32", find(vision, ("image_size",))),
             ("clip.vision.patch_size", "u32", find(vision, ("patch_size",))),
             ("clip.vision.embedding_length", "u32", find(vision, ("hidden_size", "width", "vt_hidden_size"))),
             ("clip.vision.feed_forward_length", "u32", find(vision, ("intermediate_size", "vt_intermediate_size"))),
             ("clip.vision.block_count", "u32", find(vision, BLOCK_KEYS)),
             ("clip.vision.attention.head_count", "u32",
              find(vision, ("num_attention_heads", "num_heads", "heads", "vt_num_attention_heads"))),
             ("clip.vision.image_mean", "arr", mean),
             ("clip.vision.image_std", "arr", std),
             # Gemma4VisionAudioModel names the vision projector (its file may hold an audio one beside it)
             ("clip.vision.projector_type" if config["model_type"] == "gemma4" else "clip.projector_type", "str",
              family.projector_type)]
    if config["model_type"] == "qwen2_5_vl":
        items += [("clip.use_silu", "bool", True), ("clip.vision.n_wa_pattern", "u32", n_wa_pattern(vision, family))]
    if config["model_type"] in ("qwen2_vl", "qwen2_5_vl"):
        items.append(("clip.vision.attention.layer_norm_epsilon", "f32", config.get("rms_norm_eps", 1e-6)))
    if config["model_type"] in QWEN3_VL_TOWERS:
        items.append(("clip.use_gelu", "bool", True))
        if vision.get("spatial_merge_size") is not None:
            items.append(("clip.vision.spatial_merge_size", "u32", int(vision["spatial_merge_size"])))
        items.append(("clip.vision.attention.layer_norm_epsilon", "f32",
                      (config.get("text_config") or {}).get("rms_norm_eps", 1e-6)))
        deepstack = set(vision.get("deepstack_visual_indexes", []))
        if vision["num_hidden_layers"]:
            items.append(("clip.vision.is_deepstack_layers", "arr",
                          [i in deepstack for i in range(int(vision["num_hidden_layers"]))]))
    if config["model_type"] in ("idefics3", "smolvlm"):
        items += [("clip.vision.attention.layer_norm_epsilon", "f32", vision.get("layer_norm_eps", 1e-5)),
                  ("clip.vision.projector.scale_factor", "u32", config.get("scale_factor", 2)),
                  ("clip.use_gelu", "bool", True),
                  ("clip.vision.preproc_image_size", "u32",
                   (stats.get("size") or {}).get("longest_edge", vision["image_size"]))]
    if config["model_type"] == "mistral3":  # LlavaVisionModel (a Pixtral tower)
        items += [("clip.vision.attention.layer_norm_epsilon", "f32", vision.get("layer_norm_eps", 1e-5)),
                  (f"clip.use_{vision['hidden_act']}", "bool", True)]
        if "spatial_merge_size" in config:
            items.append(("clip.vision.spatial_merge_size", "u32", config["spatial_merge_size"]))
    if config["model_type"] == "gemma4":
        items.append(("clip.vision.attention.layer_norm_epsilon", "f32", vision.get("layer_norm_eps", 1e-6)))
    if config["model_type"] == "gemma3":
        items += [("clip.vision.attention.layer_norm_epsilon", "f32", vision.get("layer_norm_eps", 1e-6)),
                  ("clip.use_gelu", "bool", True)]
        n_per_side = int(stats.get("image_seq_length", 256) ** 0.5)
        scale = (vision["image_size"] // vision["patch_size"]) // n_per_side
        if scale > 0 and scale != 4:  # written only when it is not llama.cpp's default
            items.append(("clip.vision.projector.scale_factor", "u32", scale))
    return items


def legacy_metadata(config: dict, family: Family, stats: dict, outtype: T, name: str) -> list[tuple[str, str, object]]:
    """convert_image_encoder_to_gguf.py's keys for a LLaVA projector over a CLIP vision model."""
    vision = config["vision_config"]
    return [("clip.has_text_encoder", "bool", False),
            ("clip.has_vision_encoder", "bool", True),
            ("clip.has_llava_projector", "bool", True),
            ("general.file_type", "u32", FILE_TYPES[outtype]),
            ("general.name", "str", name),
            ("general.description", "str", "image encoder for LLaVA"),
            ("clip.projector_type", "str", family.projector_type),
            ("clip.vision.image_size", "u32", vision["image_size"]),
            ("clip.vision.patch_size", "u32", vision["patch_size"]),
            ("clip.vision.embedding_length", "u32", vision["hidden_size"]),
            ("clip.vision.feed_forward_length", "u32", vision["intermediate_size"]),
            ("clip.vision.projection_dim", "u32", vision["projection_dim"]),
            ("clip.vision.attention.head_count", "u32", vision["num_attention_heads"]),
            ("clip.vision.attention.layer_norm_epsilon", "f32", vision["layer_norm_eps"]),
            ("clip.vision.block_count", "u32", legacy_skipped_layer(config)),
            ("clip.vision.image_mean", "arr", stats.get("image_mean", CLIP_DEFAULT_MEAN)),
            ("clip.vision.image_std", "arr", stats.get("image_std", CLIP_DEFAULT_STD)),
            ("clip.use_gelu", "bool", vision["hidden_act"] == "gelu")]


def add_items(writer, items: list[tuple[str, str, object]]) -> None:
    adders = {"u32": writer.add_uint32, "f32": writer.add_float32, "bool": writer.add_bool,
              "str": writer.add_string, "arr": writer.add_array}
    for key, kind, value in items:
        adders[kind](key, value)


def add_general(writer, model_dir: Path) -> None:
    """ModelBase.prepare_metadata's general.* keys: gguf.Metadata's heuristics over the model directory
    (name from the directory, size label from the parameter count, model card, generation config)."""
    import json

    import gguf

    total, shared, expert, count = writer.get_total_parameter_count()
    metadata = gguf.Metadata.load(None, Path(model_dir), None, total)
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file() and metadata.sampling_penalty_repeat is None:  # gguf-py >= 0.19.1 reads this key too
        metadata.sampling_penalty_repeat = json.loads(gen.read_text()).get("repetition_penalty")
    if metadata.name is None:
        metadata.name = Path(model_dir).name
    if metadata.size_label is None and total > 0:
        metadata.size_label = gguf.size_label(total, shared, expert, count)
    metadata.set_gguf_meta_model(writer)


# ------------------------------------------------------------------ driver


def convert(model_dir: Path, out_path: Path, mmproj_type: str = "auto") -> MmprojResult:
    """Write the mmproj .gguf of the VLM in model_dir; returns what was written."""
    return write(plan(Path(model_dir), mmproj_type), Path(model_dir), out_path)


def write(mp: MmprojPlan, model_dir: Path, out_path: Path) -> MmprojResult:
    """Write a planned mmproj: header and metadata first, then each tensor read, transformed, typed."""
    import gguf

    from quantkit.gguf.convert import open_handles, tensor_nbytes
    from quantkit.io.checkpoint import check_model_dir

    model_dir = Path(model_dir)
    family = FAMILIES[mp.family]
    stats = image_stats(model_dir)
    writer = gguf.GGUFWriter(str(out_path), "clip")
    for p in mp.pieces:
        writer.add_tensor_info(p.name, p.shape, np.dtype(np.float16 if p.qtype == T.F16 else np.float32),
                               tensor_nbytes(p.shape, p.qtype), raw_dtype=p.qtype if p.qtype == T.BF16 else None)
    if family.converter == LEGACY:
        add_items(writer, legacy_metadata(mp.config, family, stats, mp.outtype, model_dir.name))
    else:
        writer.add_type(gguf.GGUFType.MMPROJ)
        add_general(writer, model_dir)
        add_items(writer, modern_metadata(mp.config, family, stats, mp.outtype))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    handles = open_handles(check_model_dir(model_dir).weight_files)
    try:
        source_name, source = None, None
        for p in mp.pieces:  # one source tensor in memory at a time (a split tensor's parts are adjacent)
            if p.source != source_name:
                source_name = p.source
                source = read_source(handles, p)
            writer.write_tensor_data(encode(piece_values(p, source), p.qtype))
    finally:
        writer.close()
        for h in set(handles.values()):
            h.close()
    counts: dict[str, int] = {}
    for p in mp.pieces:
        counts[p.qtype.name] = counts.get(p.qtype.name, 0) + 1
    return MmprojResult(Path(out_path), mp.family, family.converter, mp.outtype.name, counts, len(mp.pieces),
                        Path(out_path).stat().st_size)
