"""AWQ smoothing mappings per architecture, as data.

model_type -> [(smooth layer, [balance layers])], llm-compressor regex syntax (`re:` + re.match).
The smooth layer's output is the balance layers' input: AWQ searches a per-channel scale s,
divides the smooth layer's output channels by s and multiplies the balance layers' input
columns by s, choosing s to minimise the quantized block's output error.

Sources: llm-compressor 0.14 `modifiers/transform/awq/mappings.py` (default, Gemma2 and Gemma3
lists) and the model definitions in transformers 5. Offset norms (Gemma's x * (1 + w)) are
converted by llm-compressor around calibration, so smoothing them is sound.
"""

from __future__ import annotations

Mapping = tuple[str, list[str]]

LLAMA_LIKE: list[Mapping] = [
    ("re:.*input_layernorm$", ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"]),
    ("re:.*v_proj$", ["re:.*o_proj$"]),
    ("re:.*post_attention_layernorm$", ["re:.*gate_proj$", "re:.*up_proj$"]),
    ("re:.*up_proj$", ["re:.*down_proj$"]),
]

# Gemma 2: the MLP input is pre_feedforward_layernorm (post_attention_layernorm normalizes
# the attention output before the residual add).
GEMMA2: list[Mapping] = [
    ("re:.*input_layernorm$", ["re:.*q_proj$", "re:.*k_proj$", "re:.*v_proj$"]),
    ("re:.*v_proj$", ["re:.*o_proj$"]),
    ("re:.*pre_feedforward_layernorm$", ["re:.*gate_proj$", "re:.*up_proj$"]),
    ("re:.*up_proj$", ["re:.*down_proj$"]),
]

# Gemma 3 normalizes q and k after projection (q_norm/k_norm); smoothing input_layernorm ->
# q/k/v was measured worse than round-to-nearest (llm-compressor issue #2522), so it is left out.
GEMMA3: list[Mapping] = GEMMA2[1:]

AWQ_MAPPINGS: dict[str, list[Mapping]] = {
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
    return sorted(AWQ_MAPPINGS)
