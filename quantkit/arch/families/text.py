"""What every text family shares: the hyperparameters as llama.cpp's converter reads them, TextModel's
set_gguf_parameters keys (llama.cpp conversion/base.py), and the rules transformers' configuration classes
have in common (head_dim from the widths, key/value heads, the RoPE dictionary's standardization).

The family modules build on these the way the converter's model classes build on TextModel.
"""

from __future__ import annotations

import numpy as np

# ---------------------------------------------------------------- hyperparameters as the converter reads them


def text_hparams(config: dict) -> dict:
    """TextModel.__init__: a VLM's text_config moved to the root level."""
    return {**config, **config["text_config"]} if isinstance(config.get("text_config"), dict) else dict(config)


def find(hp: dict, keys: tuple[str, ...]):
    """ModelBase.find_hparam(optional=True): the value of the first key present."""
    return next((hp[k] for k in keys if k in hp), None)


def rope_parameters(hp: dict) -> dict:
    """TextModel.__init__'s rope_parameters (rope_scaling / top-level theta mirrored in)."""
    rope = dict(hp.get("rope_parameters", hp.get("rope_scaling")) or {})
    if "full_attention" in rope or "sliding_attention" in rope:
        return rope
    local = find(hp, ("local_rope_theta", "rope_local_theta", "rope_theta_local", "swa_rope_theta",
                      "rope_local_base_freq"))
    if local is not None:
        rope["sliding_attention"] = {"rope_theta": local}
    mirrored = {"rope_theta": ("global_rope_theta", "rope_global_theta", "rope_theta_global", "rope_theta",
                               "rotary_emb_base"),
                "partial_rotary_factor": ("partial_rotary_factor", "rope_pct", "rope_percent"),
                "original_max_position_embeddings": ("original_max_position_embeddings",)}
    for key, names in mirrored.items():
        if key not in rope and (value := find(hp, names)) is not None:
            rope[key] = value
    if "rope_type" not in rope and rope.get("type") is not None:
        rope["rope_type"] = rope["type"]
    return rope


def full_rope(hp: dict) -> dict:
    rope = rope_parameters(hp)
    return rope.get("full_attention", rope)


def head_dim_of(hp: dict) -> int:
    return hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]


# ---------------------------------------------------------------- TextModel.set_gguf_parameters


def add_text_params(writer, hp: dict, ftype: int) -> None:
    """TextModel.set_gguf_parameters (the keys that can occur for the supported architectures)."""
    writer.add_block_count(hp["num_hidden_layers"])
    for keys, add in ((("max_position_embeddings", "n_ctx", "n_positions", "max_length", "max_sequence_length",
                        "model_max_length"), writer.add_context_length),
                      (("hidden_size", "n_embd", "dim"), writer.add_embedding_length),
                      (("prefix_dense_intermediate_size", "dense_intermediate_size", "intermediate_size",
                        "n_inner", "hidden_dim"), writer.add_feed_forward_length),
                      (("num_attention_heads", "n_head", "n_heads"), writer.add_head_count),
                      (("num_key_value_heads", "n_kv_heads"), writer.add_head_count_kv)):
        if (value := find(hp, keys)) is not None:
            add(value)
    if hp.get("is_causal") is False:
        writer.add_causal_attention(False)
    add_rope(writer, rope_parameters(hp))
    for keys, add in ((("rms_norm_eps", "norm_eps"), writer.add_layer_norm_rms_eps),
                      (("layer_norm_eps", "layer_norm_epsilon", "norm_epsilon"), writer.add_layer_norm_eps),
                      (("num_local_experts", "num_experts", "n_routed_experts"), writer.add_expert_count),
                      (("num_experts_per_tok", "num_experts_per_token", "top_k_experts"),
                       writer.add_expert_used_count)):
        if (value := find(hp, keys)) is not None:
            add(value)
    for key, add in (("n_group", writer.add_expert_group_count), ("topk_group", writer.add_expert_group_used_count)):
        if hp.get(key) is not None:
            add(hp[key])
    add_gating_func(writer, hp)
    if (head_dim := hp.get("head_dim")) is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type(ftype)


SCORE_FUNCTION_KEYS = ("score_function", "scoring_func", "score_func", "moe_router_activation",
                       "moe_router_activation_func", "expert_selection_fn")


def add_gating_func(writer, hp: dict) -> None:
    """TextModel.set_gguf_parameters' expert gating function, from the router's score function where config.json
    names one."""
    import gguf

    if (function := find(hp, SCORE_FUNCTION_KEYS)) is None:
        return
    kind = getattr(gguf.ExpertGatingFuncType, str(function).upper(), None)  # gguf-py 0.19: SOFTMAX, SIGMOID
    if kind is None:
        from quantkit.errors import UnsupportedError

        raise UnsupportedError(f"GGUF conversion: expert score function '{function}' has no gating function in "
                               "the installed gguf-py", hint="llama.cpp's converter takes sigmoid and softmax here")
    writer.add_expert_gating_func(kind)


def add_rope(writer, rope: dict) -> None:
    """TextModel.set_gguf_parameters' RoPE keys (full-attention parameters; swa theta)."""
    import gguf

    params = rope.get("full_attention", rope)
    kind, factor = params.get("rope_type"), params.get("factor")
    if kind == "linear" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(factor)
    elif kind == "yarn" and factor is not None:
        add_yarn(writer, params)
    elif kind in ("su", "longrope"):
        writer.add_rope_scaling_type(gguf.RopeScalingType.LONGROPE)
    if (sections := rope.get("mrope_section")) is not None:  # padded to [time, height, width, extra]
        writer.add_rope_dimension_sections((list(sections) + [0, 0, 0, 0])[:4])
    if (theta := params.get("rope_theta")) is not None:
        writer.add_rope_freq_base(theta)
    if (local := (rope.get("sliding_attention") or {}).get("rope_theta")) is not None:
        writer.add_rope_freq_base_swa(local)


def add_yarn(writer, params: dict) -> None:
    import gguf

    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(params["factor"])
    writer.add_rope_scaling_orig_ctx_len(params["original_max_position_embeddings"])
    for key, add in (("extrapolation_factor", writer.add_rope_scaling_yarn_ext_factor),
                     ("beta_fast", writer.add_rope_scaling_yarn_beta_fast),
                     ("beta_slow", writer.add_rope_scaling_yarn_beta_slow)):
        if params.get(key) is not None:
            add(params[key])
    if (attn := params.get("attention_factor", params.get("attn_factor"))) is not None:
        writer.add_rope_scaling_yarn_attn_factor(attn)


# ---------------------------------------------------------------- configuration classes' shared rules


SCALED_ROPE = ("llama3", "yarn", "longrope")


def head_dim(hp: dict, kwargs: dict) -> None:
    if hp["head_dim"] is None:
        hp["head_dim"] = hp["hidden_size"] // hp["num_attention_heads"]


def kv_heads(hp: dict, kwargs: dict) -> None:
    if hp["num_key_value_heads"] is None:
        hp["num_key_value_heads"] = hp["num_attention_heads"]


def rope_dict(hp: dict, kwargs: dict, entry: dict) -> None:
    """convert_rope_params_to_dict: rope_scaling (or rope_parameters) with rope_theta moved in."""
    rope = kwargs.pop("rope_scaling", None) or hp["rope_parameters"] or {}
    rope.setdefault("rope_theta", kwargs.pop("rope_theta", entry["default_theta"]))
    if (partial := kwargs.get("partial_rotary_factor", hp.get("partial_rotary_factor"))) is not None:
        rope.setdefault("partial_rotary_factor", partial)
    hp["rope_parameters"] = rope
    standardize(hp, entry)


def standardize(hp: dict, entry: dict) -> None:
    """standardize_rope_params: rope_type (from `type`), original_max_position_embeddings for the
    scaled types, one dictionary or one per layer type."""
    rope, layer_types = hp["rope_parameters"], hp.get("layer_types")
    if layer_types is None or not rope or set(rope).isdisjoint(layer_types):
        standardize_one(hp, rope, entry, own_context=True)
        return
    for layer_type in set(layer_types):
        if rope.get(layer_type) is not None:
            standardize_one(hp, rope[layer_type], entry, own_context=False)


def standardize_one(hp: dict, rope: dict, entry: dict, own_context: bool) -> None:
    rope.setdefault("rope_type", rope.get("type", "default"))
    rope.setdefault("rope_theta", None)
    if hp.get("partial_rotary_factor") is not None:
        rope.setdefault("partial_rotary_factor", hp["partial_rotary_factor"])
    if entry["default_rope_type"] != "default" and rope["rope_type"] == "default":
        rope["rope_type"] = entry["default_rope_type"]
    if rope["rope_type"] in SCALED_ROPE:
        if own_context and "original_max_position_embeddings" in hp:
            rope["original_max_position_embeddings"] = hp["original_max_position_embeddings"]
        else:
            rope.setdefault("original_max_position_embeddings", hp["max_position_embeddings"])


def shift_norm(data: np.ndarray, source_dtype: str) -> np.ndarray:
    """w + 1 as convert_hf_to_gguf.py computes it: in float32 for F32/BF16 sources (it casts bf16
    to float32 before modify_tensors), in float16 for F16 sources (torch half add, then exact f32)."""
    if source_dtype == "F16":
        return (data.astype(np.float16) + np.float16(1)).astype(np.float32)
    return data + np.float32(1)


def check_mlx_rope_unscaled(config: dict) -> None:
    """mlx-lm's model of the family (glm4_moe, deepseek_v3, minimax) is given no rope_scaling by quantkit (it
    writes only llama3 / longrope's, quantkit.mlx.checkpoint): a scaled RoPE would be read as none
    (Family.mlx_checks)."""
    from quantkit.errors import UnsupportedError

    kind = (config.get("rope_parameters") or {}).get("rope_type", "default")
    if kind != "default":
        raise UnsupportedError(f"mlx: RoPE type '{kind}': quantkit writes mlx-lm no rope_scaling for it, so mlx-lm "
                               f"would rotate unscaled", hint="use --method gguf for llama.cpp on Apple silicon")
