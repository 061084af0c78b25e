"""DeepSeek-V3 (DeepseekV3ForCausalLM; Kimi K2 uses it): read by tensor names for the model-free paths (its
experts stored per expert; multi-token-prediction layers after the decoder's, kept as stored)."""

from __future__ import annotations

from quantkit.arch.families.base import ExpertCheckpoint, Family

DEEPSEEK_V3 = Family("deepseek_v3", "DeepseekV3ForCausalLM",
                     experts_by_name=ExpertCheckpoint(mtp_keys=("num_nextn_predict_layers", "num_mtp_layers")))

FAMILIES = (DEEPSEEK_V3,)
