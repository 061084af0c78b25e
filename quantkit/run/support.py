"""Which method handles which model family: README's family x method table, computed from the
methods' own tables (the smoothing mappings, the MoE table, the GGUF converter's architectures).
tests/test_readme.py keeps README equal to `family_table()`."""

from __future__ import annotations

# (family as people name it, config model_type, config architectures[0])
FAMILIES: list[tuple[str, str, str]] = [
    ("Llama 3.1 / 3.2 / 3.3", "llama", "LlamaForCausalLM"),
    ("Gemma 3 (text)", "gemma3_text", "Gemma3ForCausalLM"),
    ("Phi-3 / Phi-4", "phi3", "Phi3ForCausalLM"),
    ("Mistral", "mistral", "MistralForCausalLM"),
    ("Mixtral", "mixtral", "MixtralForCausalLM"),
    ("Qwen2.5", "qwen2", "Qwen2ForCausalLM"),
    ("Qwen3", "qwen3", "Qwen3ForCausalLM"),
    ("Qwen2-MoE", "qwen2_moe", "Qwen2MoeForCausalLM"),
    ("Qwen3-MoE", "qwen3_moe", "Qwen3MoeForCausalLM"),
]
# The text model (`text_config.model_type`) of each tested VLM family's checkpoints: what AWQ and
# SmoothQuant look up in the smoothing table (a checkpoint with another text model is checked by its own).
VLM_TEXT_TYPES = {"llava": "llama", "llava_next": "llama", "qwen2_vl": "qwen2_vl_text",
                  "qwen2_5_vl": "qwen2_5_vl_text", "qwen3_vl": "qwen3_vl_text", "idefics3": "llama",
                  "smolvlm": "llama", "gemma3": "gemma3_text", "paligemma": "gemma", "mllama": "mllama_text_model",
                  "mistral3": "mistral", "internvl": "qwen2", "llama4": "llama4_text"}
# VLM families whose language model is a mixture of experts (its experts' layout decides fp8/gptq/nf4)
VLM_EXPERTS = ("llama4",)
METHOD_COLUMNS = ("fp8", "gptq", "awq", "smoothquant", "nf4", "gguf")


def support(model_type: str, architecture: str, method: str) -> str:
    """One cell: ✅ (with conditions) or 'refused: reason', as the method's check() decides."""
    from quantkit.arch import moe
    from quantkit.arch.mappings import supported_model_types
    from quantkit.gguf.convert import supported_architectures

    if method == "gguf":
        return "✅" if architecture in supported_architectures() else "refused: the converter lacks this architecture"
    if method in ("awq", "smoothquant") and model_type not in supported_model_types():
        return "refused: no smoothing mappings"
    return moe.MOE_SUPPORT[method] if moe.is_moe(model_type) else "✅"


def family_table() -> list[str]:
    """The markdown rows of README's family x method table."""
    lines = ["| family (`model_type`) | " + " | ".join(f"`{m}`" for m in METHOD_COLUMNS) + " |",
             "|---" * (len(METHOD_COLUMNS) + 1) + "|"]
    for family, model_type, architecture in FAMILIES:
        cells = [support(model_type, architecture, m) for m in METHOD_COLUMNS]
        lines.append(f"| {family} (`{model_type}`) | " + " | ".join(cells) + " |")
    return lines


# VLM families (quantkit.arch.vlm.FAMILIES) that tiny models of go through every method in the tests
# (tests/test_vlm_families.py builds exactly these). Gemma 3n has a table row (its towers are planned
# and kept) but no tiny model in the tests (its vision tower needs timm), so README does not claim it.
VLM_TESTED = ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "idefics3", "smolvlm", "gemma3",
              "paligemma", "mllama", "mistral3", "internvl", "llama4")


def vlm_support(model_type: str, method: str) -> str:
    """One cell of the VLM table, as the methods' checks decide."""
    from quantkit.arch import moe
    from quantkit.arch.mappings import supported_model_types
    from quantkit.arch.vlm import FAMILIES
    from quantkit.gguf.convert import supported_architectures

    family = FAMILIES[model_type]
    if method in ("awq", "smoothquant"):
        if family.cross_attention:
            return "refused: cross-attention k/v read image features"
        text_type = VLM_TEXT_TYPES[model_type]
        if text_type not in supported_model_types():
            return f"refused: no smoothing mappings for its text model `{text_type}`"
    if method == "gguf":
        from quantkit.gguf.convert import ROUTED_BY_TEXT_CONFIG

        return gguf_vlm_support(model_type, family.architecture in supported_architectures()
                                or family.architecture in ROUTED_BY_TEXT_CONFIG)
    if model_type in VLM_EXPERTS and not moe.is_moe(VLM_TEXT_TYPES[model_type]):
        return f"refused: no expert layout row for its text model `{VLM_TEXT_TYPES[model_type]}` (quantkit.arch.moe)"
    kept = "towers and cross-attention layers 16-bit" if family.cross_attention else "towers 16-bit"
    return f"✅ {kept}"


def gguf_vlm_support(model_type: str, converts: bool) -> str:
    """The gguf cell: the language model's architecture converts, and the towers have an mmproj
    conversion (quantkit.gguf.mmproj), or the family is refused (mmproj: none is the opt-in
    language-model-only output for a family whose language model converts)."""
    from quantkit.gguf.mmproj import FAMILIES

    if not converts:
        return "refused: llama.cpp's convert_hf_to_gguf.py has no conversion for its architecture"
    if model_type not in FAMILIES:
        return "refused: no mmproj conversion (`mmproj: none` writes the language model alone)"
    family = FAMILIES[model_type]
    return f"✅ language model + mmproj, as llama.cpp's {family.converter}" + (f" ({family.note})" if family.note else "")


def vlm_table() -> list[str]:
    """The markdown rows of README's VLM family x method table."""
    from quantkit.arch.vlm import FAMILIES

    lines = ["| VLM family (`model_type`) | " + " | ".join(f"`{m}`" for m in METHOD_COLUMNS) + " |",
             "|---" * (len(METHOD_COLUMNS) + 1) + "|"]
    for model_type in VLM_TESTED:
        cells = [vlm_support(model_type, m) for m in METHOD_COLUMNS]
        lines.append(f"| {FAMILIES[model_type].name} (`{model_type}`) | " + " | ".join(cells) + " |")
    return lines
