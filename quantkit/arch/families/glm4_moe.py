"""GLM-4.5 / 4.6 (Glm4MoeForCausalLM): a decoder whose first `first_k_dense_replace` layers have a dense MLP and
the others routed experts (`mlp.experts.<e>.{gate,up,down}_proj`, stored one tensor per expert projection) beside
a shared expert (`mlp.shared_experts`), a sigmoid router with a correction bias (`mlp.gate`: weight and
e_score_correction_bias) choosing the top-k within groups, partial rotary (`partial_rotary_factor`), optional q/k
norms, and multi-token-prediction layers after the decoder's (`model.layers.<num_hidden_layers + i>.`).

What stays 16-bit, and why: the router (rounding it changes which experts run; vLLM builds it unquantized), as
every MoE family's (quantkit.arch.roles). Every expert is calibrated on every calibration token (quantkit.arch.moe)
and the report lists the tokens the router sent each.

transformers' model has no multi-token-prediction layer: the llm-compressor methods write the decoder alone (vLLM
serves it; its MTP draft needs the layer, which the base checkpoint keeps).
"""

from __future__ import annotations

from quantkit.arch.families.base import ExpertCheckpoint, Family, MoeLayout
from quantkit.arch.families.llama import ROUTED_ROWS

GLM4_MOE = Family("glm4_moe", "Glm4MoeForCausalLM", "GLM-4.5", smoothing=ROUTED_ROWS, moe=MoeLayout(),
                  experts_by_name=ExpertCheckpoint(mtp_keys=("num_nextn_predict_layers",)))

FAMILIES = (GLM4_MOE,)
