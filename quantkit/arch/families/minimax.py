"""MiniMax-M2 (MiniMaxM2ForCausalLM): every layer a mixture of experts stored as Mixtral stores them
(`block_sparse_moe.experts.<e>.w1/w3/w2`, the router `block_sparse_moe.gate` and its sigmoid correction bias
`block_sparse_moe.e_score_correction_bias`), which transformers 5 loads fused under `mlp`; q/k norms across all
heads; partial rotary.

What stays 16-bit: the router (quantkit.arch.roles). The llm-compressor methods calibrate every expert on every
token and write the experts back under the checkpoint's names (w1 = gate, w3 = up, w2 = down), as vLLM's
MiniMaxM2 loader reads them.
"""

from __future__ import annotations

from quantkit.arch.families.base import Family, MoeLayout

MINIMAX_M2 = Family("minimax_m2", "MiniMaxM2ForCausalLM", "MiniMax-M2",
                    moe=MoeLayout(expert_names={"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"},
                                  block_rename=("block_sparse_moe", "mlp")))

FAMILIES = (MINIMAX_M2,)
