"""The architecture families quantkit names in docs/models.md's support tables, one record per family.

A text family is its config's `model_type` and `architectures[0]`; a VLM family (quantkit.arch.vlm
holds its towers) also names the `model_type` of its language model, which is what AWQ and
SmoothQuant look up in the smoothing table (quantkit.arch.mappings) and what the expert layout is
read from (quantkit.arch.moe). Each method says what it does with a family (MethodSpec.support);
quantkit.run.support writes the tables (scripts/make_docs_tables.py), and tests/test_docs.py keeps the page
equal to them.
"""

from __future__ import annotations

from dataclasses import dataclass

from quantkit.arch import moe
from quantkit.arch.mappings import supported_model_types
from quantkit.arch.vlm import FAMILIES as VLMS


@dataclass(frozen=True)
class Family:
    name: str  # as people name it
    model_type: str  # config.json model_type
    architecture: str  # config.json architectures[0]
    text_type: str = ""  # a VLM: its language model's model_type
    experts: bool = False  # a VLM whose language model is a mixture of experts

    @property
    def is_vlm(self) -> bool:
        return bool(self.text_type)

    @property
    def smoothing_type(self) -> str:
        """The model_type whose smoothing rows AWQ and SmoothQuant use."""
        return self.text_type or self.model_type

    @property
    def is_moe(self) -> bool:
        return moe.is_moe(self.model_type)

    @property
    def cross_attention(self) -> bool:
        return self.is_vlm and bool(VLMS[self.model_type].cross_attention)

    def kept(self) -> str:
        """What every decoder-only method keeps 16-bit in this family: '✅', or the towers named."""
        if not self.is_vlm:
            return "✅"
        return "✅ towers and cross-attention layers 16-bit" if self.cross_attention else "✅ towers 16-bit"

    def decoder_support(self, moe_cell: str) -> str:
        """The verdict of a method that quantizes the decoder's linear layers: a text family's MoE
        models get `moe_cell` (what the method's check allows of their experts); a VLM keeps its
        towers 16-bit, unless its experts have no layout row."""
        if self.is_vlm:
            return self.expert_refusal() or self.kept()
        return moe_cell if self.is_moe else "✅"

    def expert_refusal(self) -> str | None:
        """A VLM whose mixture-of-experts language model has no expert layout row: refused by every
        method that quantizes the experts (None: nothing refused)."""
        if self.experts and not moe.is_moe(self.text_type):
            return f"refused: no expert layout row for its text model `{self.text_type}` (quantkit.arch.moe)"
        return None

    def smoothing_refusal(self) -> str | None:
        """Why AWQ and SmoothQuant refuse this family (None: they take it)."""
        if self.cross_attention:
            return "refused: cross-attention k/v read image features"
        if self.smoothing_type not in supported_model_types():
            return (f"refused: no smoothing mappings for its text model `{self.text_type}`" if self.is_vlm
                    else "refused: no smoothing mappings")
        return None


TEXT_FAMILIES = [
    Family("Llama 3.1 / 3.2 / 3.3", "llama", "LlamaForCausalLM"),
    Family("Gemma 3 (text)", "gemma3_text", "Gemma3ForCausalLM"),
    Family("Phi-3 / Phi-4", "phi3", "Phi3ForCausalLM"),
    Family("Mistral", "mistral", "MistralForCausalLM"),
    Family("Mixtral", "mixtral", "MixtralForCausalLM"),
    Family("Qwen2.5", "qwen2", "Qwen2ForCausalLM"),
    Family("Qwen3", "qwen3", "Qwen3ForCausalLM"),
    Family("Qwen2-MoE", "qwen2_moe", "Qwen2MoeForCausalLM"),
    Family("Qwen3-MoE", "qwen3_moe", "Qwen3MoeForCausalLM"),
]

# The VLM families tiny models of go through every method in the tests (tests/test_vlm_families.py builds
# exactly these), with the text model of their checkpoints. Gemma 3n has a tower row (its towers are
# planned and kept) but no tiny model in the tests (its vision tower needs timm), so docs/models.md does not
# claim it.
VLM_TEXT_TYPES = {"llava": "llama", "llava_next": "llama", "qwen2_vl": "qwen2_vl_text",
                  "qwen2_5_vl": "qwen2_5_vl_text", "qwen3_vl": "qwen3_vl_text", "idefics3": "llama",
                  "smolvlm": "llama", "gemma3": "gemma3_text", "paligemma": "gemma", "mllama": "mllama_text_model",
                  "mistral3": "mistral", "internvl": "qwen2", "llama4": "llama4_text"}
VLM_WITH_EXPERTS = ("llama4",)
VLM_FAMILIES = [Family(VLMS[model_type].name, model_type, VLMS[model_type].architecture, text_type,
                       model_type in VLM_WITH_EXPERTS) for model_type, text_type in VLM_TEXT_TYPES.items()]
