"""DeepSeek-V3 (DeepseekV3ForCausalLM; Kimi K2 and DeepSeek-V3.1 use it): multi-head latent attention (q_a_proj /
q_a_layernorm / q_b_proj, kv_a_proj_with_mqa / kv_a_layernorm / kv_b_proj), `first_k_dense_replace` dense layers,
then routed experts stored one tensor per expert projection (`mlp.experts.<e>.{gate,up,down}_proj`) beside shared
experts (`mlp.shared_experts`), a sigmoid router with a correction bias (`mlp.gate`: weight and the float32
e_score_correction_bias) choosing the top-k within groups, and multi-token-prediction layers after the decoder's
(`model.layers.<num_hidden_layers + i>.`, counted by num_nextn_predict_layers).

What stays 16-bit: the router (quantkit.arch.roles). The MLA projections are quantized: vLLM fuses q_a_proj with
kv_a_proj_with_mqa and absorbs kv_b_proj into its MLA kernels from the dequantized weight, whatever its format.

Two paths: the llm-compressor methods load the model in transformers, calibrate every expert on every token and
write the decoder (transformers' model has no MTP layer); the model-free ones (fp8-block, nvfp4/mxfp4 weights
only: quantkit.engines.llmcompressor.model_free_moe) read the checkpoint by tensor names, write the MTP layers as
stored and never hold the model.
"""

from __future__ import annotations

from quantkit.arch.families.base import ExpertCheckpoint, Family, Mapping, MoeLayout
from quantkit.arch.families.llama import ROUTED_ROWS

# multi-head latent attention: the input norm feeds the two down-projections, each latent norm its up-projection
# (kv_a_layernorm normalizes the latent part of kv_a_proj_with_mqa's output, which kv_b_proj alone reads); no v -> o
# row (o_proj reads the attention over kv_b's values); the MLP rows as the other routed-expert families'
MLA_ROWS = (
    Mapping("re:.*input_layernorm$", ("re:.*q_a_proj$", "re:.*kv_a_proj_with_mqa$"), smoothquant=True),
    Mapping("re:.*q_a_layernorm$", ("re:.*q_b_proj$",), smoothquant=True),
    Mapping("re:.*kv_a_layernorm$", ("re:.*kv_b_proj$",), smoothquant=True),
    *ROUTED_ROWS[2:],  # up -> down
)

DEEPSEEK_V3 = Family("deepseek_v3", "DeepseekV3ForCausalLM", "DeepSeek-V3", smoothing=MLA_ROWS, moe=MoeLayout(),
                     experts_by_name=ExpertCheckpoint(mtp_keys=("num_nextn_predict_layers", "num_mtp_layers")))

FAMILIES = (DEEPSEEK_V3,)
