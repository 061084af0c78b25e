"""Vision-language models: where each family keeps its towers, as data, and how an unknown VLM's
towers are found.

A VLM is a language model plus towers: a vision encoder, a projector (the layers that map image
features into the text embedding space; a module tree or a single Linear) and sometimes an audio
encoder. quantkit quantizes the language model's decoder only; every tower stays in 16-bit.

`FAMILIES` names the components (dotted module paths, without the `model.` prefix transformers 5
adds on load) of every family transformers 5.17 provides. A component matches a tensor or module
name when it appears there between dots or at the end, so one rule covers the checkpoint name
(`multi_modal_projector.weight`), the module name after loading (`model.multi_modal_projector`), a
projector that is itself a Linear (Mllama) and the modules inside a tower (SigLIP's attention
pooling head, an `nn.MultiheadAttention` whose `out_proj` is a Linear subclass).

A model whose config has no row here is checked by look (`find_unknown_towers`): any component
outside the language model's decoder stack that holds a convolution weight (a patch embedding),
or has a tower-like name, or, when config.json carries a vision/audio config, any component beside
the text model, is kept 16-bit and reported as an unknown tower.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# "tower": found by look in an unknown VLM; "cross_attention": decoder layers that attend to image
# features (Mllama): text-only calibration never runs them (transformers skips them without an
# image) and the text gate never measures them, so they stay 16-bit like the towers.
TOWER_ROLES = ("vision", "projector", "audio", "tower", "cross_attention")


@dataclass(frozen=True)
class Family:
    name: str  # as people name it
    architecture: str  # config architectures[0]
    language: str  # the component holding the text model
    vision: tuple[str, ...]
    projector: tuple[str, ...]
    audio: tuple[str, ...] = ()
    cross_attention: str | None = None  # text_config key listing the decoder layers that attend to images
    # Why a quantized vision tower of this family would not reload in transformers (None: it does).
    vision_stays_16bit: str | None = None


# SigLIP's _init_weights reads each attention projection's `.weight`, which a compressed-tensors module
# does not have: transformers fails to build such an artifact (AttributeError while loading).
SIGLIP_RELOAD = "transformers' SigLIP initializer reads q_proj.weight, which a quantized module does not have"


LLAVA_LIKE = dict(language="language_model", vision=("vision_tower",), projector=("multi_modal_projector",))

# model_type -> family. transformers 5.17 module names (checked against tiny models of each family
# in tests/vlm_models.py); checkpoints store them with or without the `model.` prefix.
FAMILIES: dict[str, Family] = {
    "llava": Family("LLaVA 1.5 / Pixtral", "LlavaForConditionalGeneration", **LLAVA_LIKE),
    "llava_next": Family("LLaVA-NeXT", "LlavaNextForConditionalGeneration", language="language_model",
                         vision=("vision_tower",), projector=("multi_modal_projector", "image_newline")),
    "qwen2_vl": Family("Qwen2-VL", "Qwen2VLForConditionalGeneration", language="language_model",
                       vision=("visual",), projector=("visual.merger",)),
    "qwen2_5_vl": Family("Qwen2.5-VL", "Qwen2_5_VLForConditionalGeneration", language="language_model",
                         vision=("visual",), projector=("visual.merger",)),
    "qwen3_5": Family("Qwen3.5", "Qwen3_5ForConditionalGeneration", language="language_model",
                      vision=("visual",), projector=("visual.merger",)),
    "qwen3_5_moe": Family("Qwen3.5-MoE", "Qwen3_5MoeForConditionalGeneration", language="language_model",
                          vision=("visual",), projector=("visual.merger",)),
    "qwen3_vl": Family("Qwen3-VL", "Qwen3VLForConditionalGeneration", language="language_model",
                       vision=("visual",), projector=("visual.merger", "visual.deepstack_merger_list")),
    "idefics3": Family("Idefics3", "Idefics3ForConditionalGeneration", language="text_model",
                       vision=("vision_model",), projector=("connector",)),
    "smolvlm": Family("SmolVLM", "SmolVLMForConditionalGeneration", language="text_model",
                      vision=("vision_model",), projector=("connector",)),
    "gemma3": Family("Gemma 3", "Gemma3ForConditionalGeneration", **LLAVA_LIKE, vision_stays_16bit=SIGLIP_RELOAD),
    "gemma3n": Family("Gemma 3n", "Gemma3nForConditionalGeneration", language="language_model",
                      vision=("vision_tower",), projector=("embed_vision", "embed_audio"), audio=("audio_tower",)),
    "gemma4": Family("Gemma 4", "Gemma4ForConditionalGeneration", language="language_model",
                     vision=("vision_tower",), projector=("embed_vision", "embed_audio"), audio=("audio_tower",)),
    "paligemma": Family("PaliGemma", "PaliGemmaForConditionalGeneration", **LLAVA_LIKE,
                        vision_stays_16bit=SIGLIP_RELOAD),
    "mllama": Family("Llama 3.2 Vision (Mllama)", "MllamaForConditionalGeneration", language="language_model",
                     vision=("vision_model",), projector=("multi_modal_projector",),
                     cross_attention="cross_attention_layers"),
    "mistral3": Family("Mistral 3 (Small 3.1)", "Mistral3ForConditionalGeneration", **LLAVA_LIKE),
    "internvl": Family("InternVL 3 (HF)", "InternVLForConditionalGeneration", **LLAVA_LIKE),
    "llama4": Family("Llama 4", "Llama4ForConditionalGeneration", language="language_model",
                     vision=("vision_model",), projector=("multi_modal_projector",)),
}

# Names that say "tower" in a component outside the language model's decoder stack.
TOWER_HINT = re.compile(r"vision|visual|image|patch|mm_projector|multi_modal|connector|resampler|audio|"
                        r"merger|vpm|siglip|clip|vit")
# config.json keys that say the model has a non-text tower.
TOWER_CONFIG_KEYS = ("vision_config", "audio_config", "vision_tower_config", "mm_vision_tower")
# The text model's own pieces outside its decoder stack (never a tower).
LANGUAGE_PARTS = re.compile(r"^(embed_tokens|wte|wpe|word_embeddings|tok_embeddings|norm|final_layernorm|ln_f|"
                            r"rotary_emb|lm_head|embed_out)$")
EMBEDDING = re.compile(r"^(.*?)(embed_tokens|wte|word_embeddings|tok_embeddings)\.weight$")
DECODER_STACK = re.compile(r"^(layers|h|blocks|block)\.\d+\.")
CONV_NDIM = (4, 5)  # Conv2d/Conv3d weights: a patch embedding (3-D is left out: fused MoE experts are 3-D)


@dataclass(frozen=True)
class Towers:
    """A model's tower components: (role, component) pairs, most specific first."""

    components: tuple[tuple[str, str], ...] = ()
    family: str | None = None  # model_type of the FAMILIES row, None when found by look
    unknown: tuple[str, ...] = field(default=())  # components found by look (role "tower")

    def role(self, name: str) -> str | None:
        """The tower role of a tensor or module name, None outside every tower."""
        for role, component in self.components:
            if re.search(component_pattern(component), name):
                return role
        return None

    def names(self, role: str) -> list[str]:
        return [c for r, c in self.components if r == role]


def component_pattern(component: str) -> str:
    """A regex finding `component` as whole name parts: `x.component`, `component.y` or the name itself."""
    return rf"(^|\.){re.escape(component)}(\.|$)"


def ignore_pattern(component: str, except_under: tuple[str, ...] = ()) -> str:
    """An llm-compressor / transformers ignore entry (re.match) for a component and everything under
    it, but the sub-components `except_under` (relative names: Qwen2-VL's `merger` inside `visual`)."""
    if not except_under:
        return rf"re:(.*\.)?{re.escape(component)}(\..*)?$"
    skipped = "|".join(re.escape(sub) for sub in except_under)
    return rf"re:(.*\.)?{re.escape(component)}(\.(?!({skipped})(\.|$)).*)?$"


def family_towers(model_type: str, config: dict | None = None) -> Towers:
    """A family's components in match order: projectors first (Qwen's `visual.merger` sits inside the
    vision tower), then audio, vision, and the cross-attention decoder layers `config` lists."""
    family = FAMILIES[model_type]
    text = (config or {}).get("text_config") or {}
    layers = text.get(family.cross_attention) or [] if family.cross_attention else []
    pairs = [("projector", c) for c in family.projector] + [("audio", c) for c in family.audio] + [
        ("vision", c) for c in family.vision] + [("cross_attention", f"layers.{i}") for i in layers]
    return Towers(tuple(pairs), model_type)


def model_towers(model_type: str, config: dict, tensors: dict[str, tuple[str, list[int]]]) -> Towers:
    """The towers of a model: its family's row, else those found by look (none for a text LM)."""
    if model_type in FAMILIES:
        return family_towers(model_type, config)
    found = find_unknown_towers(config, tensors)
    return Towers(tuple(("tower", c) for c in found), None, tuple(found))


def language_root(tensors: dict) -> str:
    """The prefix under which the text model lives: where its token embedding is (`model.`,
    `model.language_model.`, `language_model.model.`), '' when there is none."""
    roots = sorted(m.group(1) for m in map(EMBEDDING.match, tensors) if m)
    return roots[0] if roots else ""


def outside_component(name: str, root: str) -> str | None:
    """The component a tensor outside the decoder stack belongs to (its first name part below the
    language root, or its top name part beside it); None for the decoder stack and the text model's
    own pieces."""
    if root and name.startswith(root):
        rest = name[len(root):]
        if DECODER_STACK.match(rest):
            return None
        head = rest.split(".", 1)[0]
        return None if LANGUAGE_PARTS.match(head) or "." not in rest else root + head
    parts = name.split(".")
    if parts[0] == "model" and len(parts) > 2:
        parts = parts[1:]
    head = parts[0]
    if LANGUAGE_PARTS.match(head) or len(parts) < 2 or (root and root.startswith(head + ".")):
        return None
    return head


def find_unknown_towers(config: dict, tensors: dict[str, tuple[str, list[int]]]) -> list[str]:
    """Components that look like towers in a model without a FAMILIES row (sorted)."""
    root = language_root(tensors)
    has_tower_config = any(key in config for key in TOWER_CONFIG_KEYS)
    components: dict[str, list[list[int]]] = {}
    for name, (_dtype, shape) in tensors.items():
        component = outside_component(name, root)
        if component is not None:
            components.setdefault(component, []).append(shape)
    found = []
    for component, shapes in components.items():
        conv = any(len(shape) in CONV_NDIM for shape in shapes)
        if has_tower_config or conv or TOWER_HINT.search(component):
            found.append(component)
    return sorted(found)


def is_vlm_family(model_type: str) -> bool:
    return model_type in FAMILIES


def tower_summary(towers: Towers) -> dict:
    """What the report, the model card and `quantkit inspect` say about a model's towers."""
    return {"family": FAMILIES[towers.family].name if towers.family else None,
            "model_type": towers.family,
            **{role: towers.names(role) for role in TOWER_ROLES if towers.names(role)},
            "unknown_towers": list(towers.unknown)}


def is_vlm(config: dict) -> bool:
    """A vision-language model: a *ForConditionalGeneration architecture with a vision_config.

    The one rule for picking the Auto class, shared by loading the base (quantkit.io.checkpoint.load_model) and
    loading an artifact back for evaluation (`quantkit.formats.gate.load_artifact`).
    """
    architecture = (config.get("architectures") or [""])[0]
    return architecture.endswith("ForConditionalGeneration") and "vision_config" in config
