"""Smoothing mappings per architecture, as data: one table for AWQ and SmoothQuant.

model_type -> [Mapping(smooth layer, balance layers)], llm-compressor regex syntax (`re:` +
re.match). The smooth layer's output is the balance layers' input: a per-channel scale s
divides the smooth layer's output channels and multiplies the balance layers' input columns
(mathematically a no-op), chosen by AWQ to minimise the quantized block's output error, and by
SmoothQuant as s_j = max|X_j|^alpha / max|W_j|^(1-alpha).

- AWQ uses every row (norm -> linears and linear -> linear) except those marked `awq=False`.
- SmoothQuant uses the rows whose smooth layer is a norm (o_proj's and down_proj's inputs are
  not a norm output, so they are never smoothed there).

Sources: llm-compressor 0.14 `modifiers/transform/awq/mappings.py` (default, Gemma2 and Gemma3
lists) and the model definitions in transformers 5. Offset norms (Gemma's x * (1 + w)) are
converted by llm-compressor around calibration, so smoothing them is sound.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mapping:
    smooth: str  # the layer whose output channels are divided by s
    balance: tuple[str, ...]  # the layers whose input columns are multiplied by s
    from_norm: bool  # the smooth layer is a norm (SmoothQuant's rows)
    awq: bool = True  # False: AWQ leaves this row out


QKV = ("re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$")
GATE_UP = ("re:.*gate_proj$", "re:.*up_proj$")


def decoder_rows(mlp_norm: str, awq_attention_norm: bool = True) -> list[Mapping]:
    """The four rows of a Llama-style decoder layer; `mlp_norm` is the norm feeding the MLP."""
    return [
        Mapping("re:.*input_layernorm$", QKV, from_norm=True, awq=awq_attention_norm),
        Mapping("re:.*v_proj$", ("re:.*o_proj$",), from_norm=False),
        Mapping(f"re:.*{mlp_norm}$", GATE_UP, from_norm=True),
        Mapping("re:.*up_proj$", ("re:.*down_proj$",), from_norm=False),
    ]


LLAMA_LIKE = decoder_rows("post_attention_layernorm")
# Gemma 2/3: the MLP input is pre_feedforward_layernorm (post_attention_layernorm normalizes
# the attention output before the residual add).
GEMMA2 = decoder_rows("pre_feedforward_layernorm")
# Gemma 3 normalizes q and k after projection (q_norm/k_norm); AWQ smoothing input_layernorm ->
# q/k/v was measured worse than round-to-nearest (llm-compressor issue #2522), so AWQ leaves it out.
GEMMA3 = decoder_rows("pre_feedforward_layernorm", awq_attention_norm=False)

SMOOTHING_MAPPINGS: dict[str, list[Mapping]] = {
    "llama": LLAMA_LIKE,
    "mistral": LLAMA_LIKE,
    "qwen2": LLAMA_LIKE,
    "qwen3": LLAMA_LIKE,
    "gemma": LLAMA_LIKE,
    "gemma2": GEMMA2,
    "gemma3": GEMMA3,
    "gemma3_text": GEMMA3,
}


def supported_model_types() -> list[str]:
    return sorted(SMOOTHING_MAPPINGS)


def awq_mappings(model_type: str) -> list[Mapping]:
    return [m for m in SMOOTHING_MAPPINGS[model_type] if m.awq]


def smoothquant_mappings(model_type: str) -> list[Mapping]:
    return [m for m in SMOOTHING_MAPPINGS[model_type] if m.from_norm]
