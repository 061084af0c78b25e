"""MiniMax-M2 (MiniMaxM2ForCausalLM): every layer a mixture of experts stored as Mixtral stores them
(`block_sparse_moe.experts.<e>.w1/w3/w2`, the router `block_sparse_moe.gate` and its sigmoid correction bias
`block_sparse_moe.e_score_correction_bias`), which transformers 5 loads fused under `mlp`; q/k norms across all
heads; partial rotary (`rotary_dim` of each head).

What stays 16-bit: the router (quantkit.arch.roles). The llm-compressor methods calibrate every expert on every
token and write the experts back under the checkpoint's names (w1 = gate, w3 = up, w2 = down), as vLLM's
MiniMaxM2 loader reads them.

GGUF: llama.cpp conversion/minimax.py's MiniMaxM2Model: TextModel's keys, the experts' feed-forward length
(intermediate_size) and the RoPE dimension count (config.json's rotary_dim: a checkpoint without it is refused, as
the converter fails on it); the experts stacked per projection, the correction bias as ffn_exp_probs_b.

MLX: mlx-lm's minimax (MODEL_REMAPPING's minimax_m2), the experts stacked as `block_sparse_moe.switch_mlp.*` (w1,
w3, w2: gate, up, down), the router and its correction bias 16-bit; its ModelArgs require shared_intermediate_size
(MiniMax-M2 has no shared expert: written 0).
"""

from __future__ import annotations

from quantkit.arch.families import text
from quantkit.arch.families.base import Family, Gguf, MlxExperts, MoeLayout, TensorRule
from quantkit.arch.families.llama import ROUTED_ROWS
from quantkit.errors import UnsupportedError

ARCH = "MiniMaxM2ForCausalLM"


def add_minimax_m2_params(writer, hp: dict, ftype: int) -> None:
    """MiniMaxM2Model.set_gguf_parameters: TextModel's + the experts' width and the rotary dimensions."""
    text.add_text_params(writer, hp, ftype)
    writer.add_expert_feed_forward_length(hp["intermediate_size"])
    writer.add_rope_dimension_count(hp["rotary_dim"])


def check_rotary_dim(arch: str, hp: dict) -> None:
    if hp.get("rotary_dim") is None:
        raise UnsupportedError(f"GGUF conversion of {arch}: config.json has no rotary_dim (llama.cpp's converter "
                               "reads the RoPE dimension count from it and fails without it)",
                               hint="MiniMax-M2's released config.json states it (64): add it to config.json")


# the reading of the file: the model's name of the correction bias (transformers moves it under `mlp`) back to the
# checkpoint's, which the converter maps
RULES = (TensorRule(r"\.mlp\.e_score_correction_bias$", rename=(r"\.mlp\.", ".block_sparse_moe.")),)

MINIMAX_M2 = Family(
    "minimax_m2", ARCH, "MiniMax-M2",
    smoothing=ROUTED_ROWS,
    moe=MoeLayout(expert_names={"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"},
                  block_rename=("block_sparse_moe", "mlp")),
    gguf={ARCH: Gguf("MINIMAXM2", add_minimax_m2_params, "gpt2", experts="mixtral", checks=(check_rotary_dim,),
                     rules=RULES)},
    mlx="minimax", mlx_experts=MlxExperts({"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"},
                                     uncast=("e_score_correction_bias",)),
    mlx_fields=lambda config: {"shared_intermediate_size": 0},  # required by mlx-lm's ModelArgs, never read
    mlx_checks=(text.check_mlx_rope_unscaled,),
)

FAMILIES = (MINIMAX_M2,)
