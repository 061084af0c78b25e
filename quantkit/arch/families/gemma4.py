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

import numpy as np

from quantkit.arch.families import text
from quantkit.arch.families.base import Family, Gguf, Kept, Mapping, TensorRule
from quantkit.arch.families.gemma import add_gemma3_params, refuse
from quantkit.arch.families.llama import GATE_UP

# ---------------------------------------------------------------- smoothing rows

# pre_feedforward_layernorm feeds the MLP only (post_attention_layernorm and post_feedforward_layernorm
# normalize a branch's output before the residual add, post_per_layer_input_norm the per-layer input's):
# SmoothQuant's row. input_layernorm feeds q/k/v, but a KV-shared layer has q alone, and llm-compressor resolves
# a row only where every balance layer exists ("final incomplete set"): neither method takes it (AWQ, as for
# Gemma 3 with q/k norms after the projections, leaves it out anyway: llm-compressor issue #2522). v_proj ->
# o_proj is no row: v_norm (an RMSNorm without scale) normalizes the values, so scaled v channels would not come
# out scaled. per_layer_input_gate reads the residual stream itself (no norm to fold a scale into).
GEMMA4_ROWS = (
    Mapping("re:.*pre_feedforward_layernorm$", GATE_UP, smoothquant=True),
    Mapping("re:.*up_proj$", ("re:.*down_proj$",), smoothquant=False),
)

# llm-compressor's tracer leaves Gemma4TextModel.project_per_layer_inputs opaque (its default tracing_ignore:
# its reshape unpacks a shape, which torch.fx cannot trace), so per_layer_model_projection, called inside it,
# is no node of the sequential pipeline's graph: it would gather a Hessian but never its weight statistics
# (GPTQ: "No statistics available"). The calibrated llm-compressor methods keep it 16-bit; fp8's data-free run
# and the other formats quantize it.
UNTRACED = (Kept(r"re:(.*\.)?per_layer_model_projection$",
                 "per_layer_model_projection: runs inside project_per_layer_inputs, which llm-compressor's "
                 "sequential tracing leaves untraced (no calibration statistics)"),)



# ---------------------------------------------------------------- GGUF (llama.cpp conversion/gemma.py's Gemma4Model)


def global_override(hp: dict, key: str):
    """Gemma4Model: `global_<key>` where config.json has it, else the first full-attention layer's value in
    per_layer_config (what transformers 5 saves when the global layers differ)."""
    if (value := hp.get(f"global_{key}" if key == "head_dim" else "num_global_key_value_heads")) is not None:
        return value
    layer_types = hp.get("layer_types") or []
    for index, overrides in (hp.get("per_layer_config") or {}).items():
        index = int(index)
        if index < len(layer_types) and layer_types[index] == "full_attention" and key in overrides:
            return overrides[key]
    return None


def full_head_dim(hp: dict) -> int:
    """The global layers' head width; transformers' own default (512) is never left out of a saved config
    that differs from head_dim, and one equal to head_dim is saved as no override at all."""
    value = global_override(hp, "head_dim")
    return hp["head_dim"] if value is None else value


def add_gemma4_params(writer, hp: dict, ftype: int) -> None:
    """Gemma4Model.set_gguf_parameters: Gemma 3's keys, then the shared KV layers, the per-layer input width,
    the sliding-window pattern, each layer type's head width and rotary dimensions, per-layer key/value heads
    where the global layers have their own."""
    add_gemma3_params(writer, hp, ftype)
    layer_types, n_layer = hp["layer_types"], hp["num_hidden_layers"]
    shared = hp["num_kv_shared_layers"]
    writer.add_shared_kv_layers(shared)
    writer.add_embedding_length_per_layer_input(hp.get("hidden_size_per_layer_input") or 0)
    swa = [t == "sliding_attention" for t in layer_types]
    writer.add_sliding_window_pattern(swa)
    head_full, head_swa = full_head_dim(hp), hp["head_dim"]
    writer.add_key_length(head_full)
    writer.add_value_length(head_full)
    writer.add_key_length_swa(head_swa)
    writer.add_value_length_swa(head_swa)
    if (expert := text.find(hp, ("expert_intermediate_size", "moe_intermediate_size"))) is not None:
        writer.add_expert_feed_forward_length(expert)
    if hp.get("use_double_wide_mlp"):
        n_ff = hp["intermediate_size"]
        writer.add_feed_forward_length([n_ff if i < n_layer - shared else 2 * n_ff for i in range(n_layer)])
    kv_full, kv_swa = global_override(hp, "num_key_value_heads"), hp.get("num_key_value_heads")
    if kv_full is not None and kv_swa is not None:
        writer.add_head_count_kv([kv_swa if s else kv_full for s in swa])
    partial_swa = text.rope_parameters(hp).get("partial_rotary_factor", 1.0)  # the per-type dictionary's: 1.0
    writer.add_rope_dimension_count(int(head_full))
    writer.add_rope_dimension_count_swa(int(head_swa * partial_swa))


def rope_freqs(hp: dict) -> dict[str, np.ndarray]:
    """Gemma4Model.generate_extra_tensors: the global layers' proportional RoPE as frequency factors (1 for
    the rotated pairs, 1e30 for the unrotated ones: ggml's neox RoPE rotates a prefix only)."""
    full = hp["rope_parameters"]["full_attention"]
    head = full_head_dim(hp)
    rotated = int(head * full["partial_rotary_factor"] / 2)
    return {"rope_freqs.weight": np.array([1.0] * rotated + [1e30] * (head // 2 - rotated), dtype=np.float32)}


def check_dense(arch: str, hp: dict) -> None:
    """Gemma 4's MoE checkpoints (enable_moe_block): not converted here yet."""
    if hp.get("enable_moe_block"):
        refuse(arch, "a mixture-of-experts Gemma 4 (enable_moe_block: router, fused experts)",
               "quantkit converts the dense Gemma 4 checkpoints; use a compressed-tensors method for this one")


def check_proportional(arch: str, hp: dict) -> None:
    """The converter writes rope_freqs for the global layers' proportional RoPE and asserts that type."""
    full = (hp.get("rope_parameters") or {}).get("full_attention") or {}
    if full.get("rope_type") != "proportional" or "partial_rotary_factor" not in full:
        refuse(arch, f"the global layers' RoPE is '{full.get('rope_type')}' (llama.cpp's converter takes "
               "proportional RoPE with a partial_rotary_factor only)", "Gemma 4 checkpoints have it")


GEMMA4_GGUF = Gguf("GEMMA4", add_gemma4_params, "gemma4", trims_vocab=True, windowed=True,
                   rope_types=("proportional",), checks=(check_dense, check_proportional),
                   extra_tensors=rope_freqs,
                   # Gemma4Model.filter_tensors: the per-layer output scale is named as a weight
                   rules=(TensorRule(r"\.layer_scalar$", rename=(r"$", ".weight")),))


def whole_text_model(hp: dict) -> list[str] | None:
    """With KV shared across layers, the whole text model is one subgraph of llm-compressor's sequential
    pipeline: the layers hand their keys and values to the later ones in `shared_kv_states`, a dictionary the
    tracer freezes into each layer's call as an empty constant (`shared_kv_states = {}`), so layer by layer the
    KV-shared layers would find nothing (KeyError 'sliding_attention'). Without KV sharing: one layer each."""
    return ["Gemma4TextModel"] if hp.get("num_kv_shared_layers") else None


def mlx_fields(config: dict) -> dict:
    """The global layers' head width (and key/value heads) that transformers 5 saves in `per_layer_config`
    (nothing where they equal the others'), at the top level where mlx-lm's gemma4_text reads them
    (`global_head_dim`, its default 512 otherwise; `num_global_key_value_heads`)."""
    layer_types = config.get("layer_types") or []
    if "per_layer_config" not in config or "full_attention" not in layer_types:
        return {}
    overrides = {int(i): v for i, v in (config.get("per_layer_config") or {}).items()}
    full = overrides.get(layer_types.index("full_attention"), {})
    fields = {"global_head_dim": full.get("head_dim", config.get("head_dim"))}
    if "num_key_value_heads" in full:
        fields["num_global_key_value_heads"] = full["num_key_value_heads"]
    return fields


GEMMA4 = Family(
    "gemma4_text", "Gemma4ForCausalLM", "Gemma 4 (text)",
    smoothing=GEMMA4_ROWS, untraced=UNTRACED, sequential=whole_text_model,
    gguf={"Gemma4ForCausalLM": GEMMA4_GGUF, "Gemma4ForConditionalGeneration": GEMMA4_GGUF},
    mlx="gemma4_text", mlx_fields=mlx_fields,
)

FAMILIES = (GEMMA4,)
