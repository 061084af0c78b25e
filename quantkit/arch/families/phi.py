"""Phi-3 / Phi-4 (Phi3ForCausalLM): q/k/v fused into qkv_proj and gate/up into gate_up_proj, on both sides
(llama.cpp keeps them fused: attn_qkv, ffn_up); LongRoPE's factors written as tensors. GGUF: llama.cpp
conversion/phi.py (Phi3MiniModel).
"""

from __future__ import annotations

import math

import numpy as np

from quantkit.arch.families import text
from quantkit.arch.families.base import ConfigRules, Family, Gguf, Mapping

# AWQ's qkv_proj -> o_proj row is skipped by llm-compressor wherever qkv_proj's width differs from o_proj's input (GQA)
PHI3_ROWS = (
    Mapping("re:.*input_layernorm$", ("re:.*qkv_proj$",), smoothquant=True),
    Mapping("re:.*qkv_proj$", ("re:.*o_proj$",), smoothquant=False),
    Mapping("re:.*post_attention_layernorm$", ("re:.*gate_up_proj$",), smoothquant=True),
    Mapping("re:.*gate_up_proj$", ("re:.*down_proj$",), smoothquant=False),
)


def phi3_rope(hp: dict, kwargs: dict, entry: dict) -> None:
    """Phi3Config.convert_rope_params_to_dict: partial_rotary_factor 1.0 by default, su / yarn read as longrope."""
    rope = kwargs.pop("rope_scaling", None) or hp["rope_parameters"] or {}
    rope.setdefault("rope_theta", kwargs.pop("rope_theta", 10_000.0))
    rope.setdefault("partial_rotary_factor", kwargs.get("partial_rotary_factor", 1.0))
    hp["rope_parameters"] = rope
    text.standardize(hp, entry)
    if rope.get("rope_type") in ("su", "yarn"):
        rope["rope_type"] = "longrope"


def add_phi3_params(writer, hp: dict, ftype: int) -> None:
    """Phi3MiniModel.set_gguf_parameters (its own keys; LongRoPE factors are tensors)."""
    rope = text.rope_parameters(hp)
    n_embd, n_head = text.find(hp, ("hidden_size", "n_embd")), text.find(hp, ("num_attention_heads", "n_head"))
    writer.add_context_length(text.find(hp, ("n_positions", "max_position_embeddings")))
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_embedding_length(n_embd)
    writer.add_feed_forward_length(hp["intermediate_size"])
    writer.add_block_count(hp["num_hidden_layers"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(text.find(hp, ("num_key_value_heads", "n_head_kv")))
    writer.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * n_embd) // n_head)
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    writer.add_file_type(ftype)
    writer.add_sliding_window(hp.get("sliding_window") or 0)
    if rope.get("long_factor"):
        writer.add_rope_scaling_attn_factors(phi3_attn_factor(hp, rope))


def phi3_attn_factor(hp: dict, rope: dict) -> float:
    """Phi3MiniModel.generate_extra_tensors' attention factor for LongRoPE."""
    orig = rope["original_max_position_embeddings"]
    scale = text.find(hp, ("n_positions", "max_position_embeddings")) / orig
    return math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1.0 else 1.0


def phi3_extra_tensors(hp: dict) -> dict[str, np.ndarray]:
    """Phi3MiniModel.generate_extra_tensors: LongRoPE's long and short factors."""
    rope = text.full_rope(hp)
    if not rope.get("long_factor"):
        return {}
    return {"rope_factors_long.weight": np.asarray(rope["long_factor"], dtype=np.float32),
            "rope_factors_short.weight": np.asarray(rope["short_factor"], dtype=np.float32)}


PHI3 = Family(
    "phi3", "Phi3ForCausalLM", "Phi-3 / Phi-4",
    smoothing=PHI3_ROWS,
    gguf={"Phi3ForCausalLM": Gguf("PHI3", add_phi3_params, "phi3", rope_types=("default", "longrope", "su"),
                                  windowed=True, fused_qkv_mlp=True, extra_tensors=phi3_extra_tensors)},
    mlx="phi3",
    config=ConfigRules((text.kv_heads,), phi3_rope),
)

FAMILIES = (PHI3,)
