"""Llama 4's text model (Llama4ForCausalLM, model_type llama4_text): routed experts stored fused across experts
(`feed_forward.experts.gate_up_proj` [experts, hidden, 2 x intermediate], `down_proj`) beside a shared expert,
the router `feed_forward.router`, MoE layers every `interleave_moe_layer_step`-th layer, chunked attention and
NoPE layers.

Not supported yet, and refused before any work by every method: llm-compressor 0.14 linearizes Llama 4's fused
experts only inside the multimodal Llama4ForConditionalGeneration (its Llama4LinearExperts reads the VLM config's
text_config), and its router returns scores without the expert indices the calibration report counts.

No `name`: not a row of docs/models.md's tables; its prose states the refusal.
"""

from __future__ import annotations

from quantkit.arch.families.base import Family

LLAMA4_TEXT = Family(
    "llama4_text", "Llama4ForCausalLM",
    moe_refusal="{method}: Llama 4's text model (llama4_text) is not supported yet: llm-compressor 0.14 "
                "linearizes its fused experts (feed_forward.experts.gate_up_proj) only inside the multimodal "
                "Llama4ForConditionalGeneration",
)

FAMILIES = (LLAMA4_TEXT,)
