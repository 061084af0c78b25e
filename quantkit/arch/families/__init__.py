"""The architecture families quantkit knows, one module per family (the shape of llama.cpp's `conversion/`
and mlx-lm's `models/`), each a list of records (quantkit.arch.families.base.Family) that every method reads:
what stays 16-bit and why, the smoothing rows, the expert layout, the GGUF conversion, the mlx-lm model.

Adding a family is one module here (and its records in FAMILIES) plus a tiny-model test. The records with a
`name` are the rows of docs/models.md's family x method tables (quantkit.run.support writes them, each cell
what the method's `support(family)` says); the VLM rows pair a VLM's towers (quantkit.arch.vlm) with its
text model's family.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.arch.families import (apertus, deepseek, ernie, gemma, gemma4, glm4_moe, gpt_oss, granite, hunyuan,
                                     llama, llama4, minimax, ministral3, mistral, olmo, phi, qwen, qwen35, seed_oss,
                                     smollm3)
from quantkit.arch.families.base import Family, Gguf
from quantkit.arch.vlm import FAMILIES as VLMS

# Every family record, module by module, in the order of docs/models.md's tables.
FAMILIES: tuple[Family, ...] = (*llama.FAMILIES, *gemma.FAMILIES, *gemma4.FAMILIES, *phi.FAMILIES, *mistral.FAMILIES,
                                *qwen.FAMILIES, *ministral3.FAMILIES, *qwen35.FAMILIES, *seed_oss.FAMILIES, *smollm3.FAMILIES,
                                *olmo.FAMILIES, *ernie.FAMILIES, *hunyuan.FAMILIES, *apertus.FAMILIES, *granite.FAMILIES,
                                *deepseek.FAMILIES, *glm4_moe.FAMILIES, *minimax.FAMILIES, *gpt_oss.FAMILIES,
                                *llama4.FAMILIES)


def all_families() -> tuple[Family, ...]:
    return FAMILIES


def by_model_type(model_type: str) -> Family | None:
    return next((f for f in all_families() if f.model_type == model_type), None)


def of_config(config: dict) -> Family | None:
    """The family of a checkpoint's config.json: a VLM's is its text model's (text_config.model_type)."""
    text = config.get("text_config")
    return by_model_type(text.get("model_type", "") if isinstance(text, dict) else config.get("model_type", ""))


def kept_reason(config: dict, module: str, method: str = "") -> str | None:
    """Why the family keeps a linear layer 16-bit (its record's `kept`; those of `method`, or of every method),
    None where it does not."""
    from quantkit.arch.roles import matches

    family = of_config(config)
    return next((k.reason for k in family.kept if matches(module, [k.pattern])
                 and (not k.methods or method in k.methods) and (k.when is None or k.when(config))),
                None) if family else None


def kept_layers(info, method: str = "") -> dict[str, str]:
    """{linear layer: why} of the layers a checkpoint's family keeps 16-bit under `method` (`info`:
    quantkit.io.checkpoint.ModelInfo)."""
    from quantkit.arch.roles import linear_weights

    return {name: reason for name in linear_weights(info)
            if (reason := kept_reason(info.config, name, method)) is not None}


def check_family(info) -> None:
    """The family's own checks of a checkpoint (its record's `checks`), for every method before any work."""
    family = of_config(info.config)
    for check in family.checks if family else ():
        check(info)


def gguf_conversions() -> dict[str, Gguf]:
    """Hugging Face architecture -> its GGUF conversion, over every family."""
    return {arch: spec for f in all_families() for arch, spec in f.gguf.items()}


def gguf_refusals() -> dict[str, str]:
    """Hugging Face architecture -> why its GGUF conversion is refused, over the families that state a reason."""
    return {f.architecture: f.gguf_refusal for f in all_families() if f.gguf_refusal}


def model_types(has) -> list[str]:
    """The sorted model_types of the families for which `has(family)` is true."""
    return sorted(f.model_type for f in all_families() if has(f))


# ---------------------------------------------------------------- the rows of docs/models.md's tables


@dataclass(frozen=True)
class TextRow:
    """A text family as the docs' tables and the methods' `support` read it."""

    family: Family

    @property
    def name(self) -> str:
        return self.family.name

    @property
    def model_type(self) -> str:
        return self.family.model_type

    @property
    def architecture(self) -> str:
        return self.family.architecture

    is_vlm = False
    cross_attention = False

    @property
    def is_moe(self) -> bool:
        return self.family.moe is not None

    def kept(self) -> str:
        """What every decoder-only method keeps 16-bit in this family: '✅', or the layers named."""
        kept = [k.reason for k in self.family.kept if not k.methods]
        return "✅" if not kept else "✅ " + ", ".join(kept)

    def decoder_support(self, moe_cell: str) -> str:
        """The verdict of a method that quantizes the decoder's linear layers: what the family keeps 16-bit, and for
        an MoE family `moe_cell` beyond ✅ (what the method's check allows of its experts; a refusal alone)."""
        if not self.is_moe:
            return self.kept()
        if not moe_cell.startswith("✅"):
            return moe_cell
        parts = [p for p in (self.kept().removeprefix("✅").strip(), moe_cell.removeprefix("✅").strip()) if p]
        return " ".join(["✅", "; ".join(parts)]) if parts else "✅"

    def expert_refusal(self) -> str | None:
        return None

    def expert_reload_refusal(self, stored: str) -> str | None:
        return None

    def smoothing_refusal(self) -> str | None:
        """Why AWQ and SmoothQuant refuse this family (None: they take it)."""
        return None if self.family.smoothing else "refused: no smoothing mappings"

    def smoothquant_refusal(self) -> str | None:
        """Why SmoothQuant refuses this family although AWQ takes it: no norm row (None: it takes it)."""
        return None if any(m.smoothquant for m in self.family.smoothing) else "refused: no norm row"


@dataclass(frozen=True)
class VlmRow:
    """A VLM family: its towers (quantkit.arch.vlm) and the model_type of its language model, which is what
    AWQ and SmoothQuant look up the smoothing rows by and what the expert layout is read from."""

    model_type: str
    text_type: str
    experts: bool = False  # its language model is a mixture of experts

    @property
    def name(self) -> str:
        return VLMS[self.model_type].name

    @property
    def architecture(self) -> str:
        return VLMS[self.model_type].architecture

    is_vlm = True

    @property
    def text_family(self) -> Family | None:
        return by_model_type(self.text_type)

    @property
    def is_moe(self) -> bool:
        return self.text_family is not None and self.text_family.moe is not None and self.text_family.moe.vlm

    @property
    def cross_attention(self) -> bool:
        return bool(VLMS[self.model_type].cross_attention)

    def kept(self) -> str:
        return "✅ towers and cross-attention layers 16-bit" if self.cross_attention else "✅ towers 16-bit"

    def decoder_support(self, moe_cell: str) -> str:
        """A VLM keeps its towers 16-bit, unless its experts have no layout row; a mixture of experts adds what
        `moe_cell` says of them beyond ✅ (nf4: the experts stay bf16)."""
        more = moe_cell.removeprefix("✅").strip() if self.is_moe else ""
        return self.expert_refusal() or (f"{self.kept()}; {more}" if more else self.kept())

    def expert_refusal(self) -> str | None:
        """A mixture-of-experts language model without an expert layout: refused by every method that
        quantizes the experts (None: nothing refused)."""
        if not self.experts or self.is_moe:
            return None
        if self.text_family is not None and self.text_family.moe is not None:  # MoeLayout.vlm false (Llama 4)
            return (f"refused: its text model `{self.text_type}`'s expert layout holds for the text checkpoint "
                    "only (quantkit.arch.families)")
        return f"refused: no expert layout row for its text model `{self.text_type}` (quantkit.arch.families)"

    def expert_reload_refusal(self, stored: str) -> str | None:
        """What transformers' reload of the artifact, on which the towers are proven, cannot decompress in the
        fused experts of a VLM's mixture of experts (quantkit.arch.moe.check_vlm_expert_reload); None: no experts."""
        if self.experts and self.is_moe:
            return f"refused: {stored} in a VLM's experts, which transformers' reload cannot decompress"
        return None

    def smoothing_refusal(self) -> str | None:
        if self.cross_attention:
            return "refused: cross-attention k/v read image features"
        if self.text_family is None or not self.text_family.smoothing:
            return f"refused: no smoothing mappings for its text model `{self.text_type}`"
        return None

    def smoothquant_refusal(self) -> str | None:
        """Its text model's (Qwen3.5-MoE's: no norm row before the experts)."""
        return TextRow(self.text_family).smoothquant_refusal() if self.text_family is not None else None


def text_rows() -> list[TextRow]:
    """The text families of the docs' tables (those with a name), in module order."""
    return [TextRow(f) for f in all_families() if f.name]


# The VLM families tiny models of go through every method in the tests (tests/test_vlm_families.py builds
# exactly these), with the text model of their checkpoints. Gemma 3n has a tower row (its towers are
# planned and kept) but no tiny model in the tests (its vision tower needs timm), so docs/models.md does not
# claim it.
VLM_TEXT_TYPES = {"llava": "llama", "llava_next": "llama", "qwen2_vl": "qwen2_vl_text",
                  "qwen2_5_vl": "qwen2_5_vl_text", "qwen3_vl": "qwen3_vl_text", "idefics3": "llama",
                  "smolvlm": "llama", "gemma3": "gemma3_text", "paligemma": "gemma", "mllama": "mllama_text_model",
                  "mistral3": "mistral", "internvl": "qwen2", "llama4": "llama4_text", "gemma4": "gemma4_text",
                  "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
VLM_WITH_EXPERTS = ("llama4", "qwen3_5_moe")


def vlm_rows() -> list[VlmRow]:
    return [VlmRow(model_type, text_type, model_type in VLM_WITH_EXPERTS)
            for model_type, text_type in VLM_TEXT_TYPES.items()]


def untraced_layers(info) -> dict[str, str]:
    """{linear layer: why} of the layers a checkpoint's family keeps 16-bit in llm-compressor's calibrated
    (sequential) runs layer by layer (its record's `untraced`)."""
    from quantkit.arch.roles import linear_weights, matches

    from quantkit.arch.families.text import text_hparams

    family = of_config(info.config)
    if family is None or not family.untraced:
        return {}
    if family.sequential is not None and family.sequential(text_hparams(info.config)):
        return {}  # calibrated as one subgraph: every layer of it is traced through
    return {name: k.reason for name in linear_weights(info) for k in family.untraced if matches(name, [k.pattern])}
