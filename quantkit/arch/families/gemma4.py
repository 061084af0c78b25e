"""Gemma 4 (Gemma4ForCausalLM, and the language model of Gemma4ForConditionalGeneration; text model_type
`gemma4_text`).

Per-layer inputs: a second embedding (`embed_tokens_per_layer`, one slice per layer) plus a projection of the
token embedding (`per_layer_model_projection`), mixed into each layer's residual after its MLP through a gate
(`per_layer_input_gate`, `per_layer_projection`, `post_per_layer_input_norm`). The last `num_kv_shared_layers`
layers have no k/v projections: they read the keys and values of the last earlier layer of their type. Global
layers have their own head width (per_layer_config) and proportional RoPE; Gemma 4's RMSNorm scales by w
(not 1 + w), so nothing is shifted. GGUF: llama.cpp conversion/gemma.py's Gemma4Model.
"""

from __future__ import annotations

from quantkit.arch.families.base import Family, Kept

# llm-compressor's tracer leaves Gemma4TextModel.project_per_layer_inputs opaque (its default tracing_ignore:
# its reshape unpacks a shape, which torch.fx cannot trace), so per_layer_model_projection, called inside it,
# is no node of the sequential pipeline's graph: it would gather a Hessian but never its weight statistics
# (GPTQ: "No statistics available"). The calibrated llm-compressor methods keep it 16-bit; fp8's data-free run
# and the other formats quantize it.
UNTRACED = (Kept(r"re:(.*\.)?per_layer_model_projection$",
                 "per_layer_model_projection: runs inside project_per_layer_inputs, which llm-compressor's "
                 "sequential tracing leaves untraced (no calibration statistics)"),)



def whole_text_model(hp: dict) -> list[str] | None:
    """With KV shared across layers, the whole text model is one subgraph of llm-compressor's sequential
    pipeline: the layers hand their keys and values to the later ones in `shared_kv_states`, a dictionary the
    tracer freezes into each layer's call as an empty constant (`shared_kv_states = {}`), so layer by layer the
    KV-shared layers would find nothing (KeyError 'sliding_attention'). Without KV sharing: one layer each."""
    return ["Gemma4TextModel"] if hp.get("num_kv_shared_layers") else None


GEMMA4 = Family(
    "gemma4_text", "Gemma4ForCausalLM", "Gemma 4 (text)",
    untraced=UNTRACED, sequential=whole_text_model,
)

FAMILIES = (GEMMA4,)
