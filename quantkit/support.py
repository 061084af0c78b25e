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
METHOD_COLUMNS = ("fp8", "gptq", "awq", "smoothquant", "nf4", "gguf")


def support(model_type: str, architecture: str, method: str) -> str:
    """One cell: ✅ (with conditions) or 'refused: reason', as the method's check() decides."""
    from quantkit.gguf.convert import supported_architectures
    from quantkit.methods import moe
    from quantkit.methods.mappings import supported_model_types

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
