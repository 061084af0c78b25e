"""GPT-OSS (GptOssForCausalLM): every layer a mixture of experts stored fused across experts (`mlp.experts.
gate_up_proj` [experts, hidden, 2 x intermediate] with gate and up interleaved, their biases, `down_proj`), a
router with a bias (`mlp.router`), a clamped SwiGLU, attention sinks and alternating sliding-window layers.

Not supported yet, and refused before any work by every method: llm-compressor writes GPT-OSS's calibrated
experts one Linear per expert projection (with biases), which transformers' GPT-OSS, reading only the fused
tensors, does not reload, and quantkit's reading of such experts does not know the interleaved, clamped layout.

No `name`: not a row of docs/models.md's tables; its prose states the refusal.
"""

from __future__ import annotations

from quantkit.arch.families.base import Family

GPT_OSS = Family(
    "gpt_oss", "GptOssForCausalLM",
    moe_refusal="{method}: GPT-OSS (gpt_oss) is not supported yet: its experts are stored fused across experts "
                "(mlp.experts.gate_up_proj, gate and up interleaved, with biases), and the calibrated experts "
                "llm-compressor writes (one Linear per expert projection) are not a checkpoint transformers "
                "reloads or quantkit reads",
)

FAMILIES = (GPT_OSS,)
