"""Qwen3.5 (Qwen3_5ForCausalLM, model_type qwen3_5_text): a hybrid decoder, Gated DeltaNet linear-attention
layers (in_proj_qkv / in_proj_z / in_proj_b / in_proj_a, a depthwise causal conv1d, A_log, dt_bias, a gated
RMSNorm, out_proj) beside gated full-attention layers (q_proj twice as wide: query and its output gate; q/k
norms), every `full_attention_interval`-th layer a full-attention one (config.json's `layer_types`). Its
RMSNorms scale by (1 + w), the gated one by w.

What stays 16-bit, and why: in_proj_b / in_proj_a (the delta rule's beta and the decay's alpha gates, one
output per value head; vLLM fuses the two into one in_proj_ba), and what no method quantizes because it is
no linear layer: conv1d (a 4-tap depthwise convolution), A_log and dt_bias (the decay's state parameters) and
the norms.

GGUF: llama.cpp conversion/qwen.py's Qwen3_5TextModel (Qwen3NextModel's keys and tensor changes after
_LinearAttentionVReorderBase's value-head reorder: quantkit.arch.families.deltanet; the recurrent layers
written from layer_types; the MTP layers as its nextn block). MLX: mlx-lm 0.32 has no model for model_type
qwen3_5_text; its qwen3_5 model (the VLM checkpoints', model_type qwen3_5 with a text_config) loads the text model
when it is written as mlx_lm.convert writes that model (QWEN35_MLX): config.json model_type qwen3_5 with the
checkpoint's own as text_config, the tensors under language_model., and what its sanitize does applied (conv1d's
kernel axis last, the (1 + w) RMSNorms stored as 1 + w, the MTP layers dropped, A_log in its stored dtype). It
places the attention layers by full_attention_interval alone (it reads no layer_types): a checkpoint whose
layer_types place them otherwise is refused before work (check_mlx_layers), as is a RoPE type other than default.

GGUF types every tensor as llama-quantize does: conv1d, A_log, dt_bias and the norms F32, ssm_alpha/ssm_beta
(in_proj_a/b) quantized as llama-quantize quantizes them. The MTP layers (`mtp.*`, which transformers does not
load), per format: GGUF writes them as llama.cpp's nextn block (the converter's default); the compressed-tensors
methods carry them as stored (compressed-tensors' own MTP handling: a model_mtp.safetensors shard, `re:^mtp.*`
ignored) for vLLM's MTP draft; nf4 and MLX (mlx-lm's qwen3_5 has no MTP layer) do not write them and say so in
the report.

Qwen3.5-MoE (Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text) and Qwen3-Next (Qwen3NextForCausalLM, the
80B-A3B line) are the same hybrid with every MLP a mixture of experts: routed experts stored one tensor per expert
projection (`mlp.experts.<e>.{gate,up,down}_proj`), a shared expert (`mlp.shared_expert`) scaled by a one-output
sigmoid gate (`mlp.shared_expert_gate`) and the router `mlp.gate`, both kept 16-bit (quantkit.arch.roles; vLLM
builds both unquantized). Qwen3-Next stores the DeltaNet input projections fused (in_proj_qkvz, in_proj_ba: its
beta/alpha gates kept 16-bit as Qwen3.5's). The llm-compressor methods calibrate every expert on every token.

GGUF of the two: conversion/qwen.py's Qwen3_5MoeTextModel (as Qwen3.5, value-head reorder included) and
Qwen3NextModel (no reorder: in_proj_qkvz regrouped from [q, k, v, z] per key head to every head's q, k, v, then z,
written as attn_qkv and attn_gate; in_proj_ba written as it is, ssm_ba), both with Qwen2MoeModel's experts: the
expert widths as keys, the routed experts stacked per projection (ffn_{gate,up,down}_exps), the shared expert as
ffn_{gate,up,down}_shexp and its one-output gate as ffn_gate_inp_shexp, F32 (the converter writes it F32 and
llama-quantize quantizes no single-row weight). Qwen3.5-MoE's MTP layers are written as Qwen3.5's (the nextn
block, their experts stacked as the decoder's: the converter's filter_tensors renames them into the blocks after
the decoder's, `mtp_rename`). So are Qwen3-Next's: its config.json does not count them, and the converter counts
them from the mtp.layers.<i> tensors (counted_mtp, Gguf.tensor_hparams); a checkpoint without them converts as
`convert_hf_to_gguf.py --no-mtp` converts it.

MLX of the two, each as mlx_lm.convert writes its mlx-lm model, the routed experts stacked per projection
(switch_mlp, MlxExperts) and the routers and shared-expert gates 16-bit: Qwen3.5-MoE (no mlx-lm model for
qwen3_5_moe_text) as Qwen3.5 for mlx-lm's qwen3_5_moe (the VLM checkpoints' model: QWEN35_MLX, config.json model_type
qwen3_5_moe with a text_config); Qwen3-Next for mlx-lm's qwen3_next under the Hugging Face names and config.json
(QWEN3_NEXT_MLX), with the norms stored as 1 + w and conv1d's kernel axis last, which its sanitize makes only of a
checkpoint whose experts it still has to stack. Both drop the MTP layers; both place the attention layers by
full_attention_interval (check_mlx_layers).
"""

from __future__ import annotations

import re

import numpy as np

from quantkit.arch.families import deltanet, text
from quantkit.arch.families.base import (Family, Gguf, Kept, Mapping, MlxExperts, MlxLayout, MlxRule, MoeLayout,
                                         TensorRule)
from quantkit.arch.families.llama import GATE_UP
from quantkit.arch.families.qwen import FUSED_EXPERT_RULES
from quantkit.errors import ModelError, UnsupportedError

# ---------------------------------------------------------------- what stays 16-bit

# one output per value head; vLLM fuses the two into in_proj_ba
KEPT = (Kept(r"re:.*linear_attn\.in_proj_[ab]$", "Gated DeltaNet's beta/alpha gates (in_proj_b/a) 16-bit"),)

# ---------------------------------------------------------------- smoothing rows

# v -> o holds (the output gate multiplies o_proj's input per channel) and the MLP's rows; input_layernorm has
# none: it feeds q/k/v in a full-attention layer and the four input projections in a linear-attention one under
# the same name, and llm-compressor resolves a row by names only (one row for both fails: "AWQ needs to match a
# single smoothlayer for each mapping"); the linear-attention outputs pass conv1d, the delta rule and the gated
# norm before out_proj, so out_proj has no row either
QWEN35_ROWS = (
    Mapping("re:.*v_proj$", ("re:.*o_proj$",), smoothquant=False),
    Mapping("re:.*post_attention_layernorm$", GATE_UP, smoothquant=True),
    Mapping("re:.*up_proj$", ("re:.*down_proj$",), smoothquant=False),
)

# the MoE variants: the norm feeding the experts also feeds the router, a weight parameter (no Linear to balance):
# v -> o and each expert's up -> down
QWEN35_MOE_ROWS = (QWEN35_ROWS[0], QWEN35_ROWS[2])

# ---------------------------------------------------------------- the checkpoint's layers against its tensors

LINEAR_TENSORS = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "conv1d.weight",
                  "A_log", "dt_bias", "norm.weight", "out_proj.weight")
ATTENTION_TENSORS = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", "q_norm.weight",
                     "k_norm.weight")


def layer_types(config: dict) -> list[str]:
    hp = text.text_hparams(config)
    if hp.get("layer_types") is not None:
        return list(hp["layer_types"])
    interval = hp.get("full_attention_interval", 4)
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(hp["num_hidden_layers"])]


def check_layers(info) -> None:
    """config.json's layer_types against num_hidden_layers, and each layer's tensors against its type: a
    disagreement is refused before work, naming what is missing."""
    hp = text.text_hparams(info.config)
    n, types = hp.get("num_hidden_layers", 0), layer_types(info.config)
    if len(types) != n:
        raise ModelError(f"config.json: layer_types lists {len(types)} layer types for num_hidden_layers = {n}",
                         hint="the checkpoint's config and tensors disagree: give one type per layer "
                              "(linear_attention or full_attention)")
    prefix = next((p for p in ("model.language_model.layers.", "model.layers.")
                   if any(k.startswith(p) for k in info.tensors)), "model.layers.")
    mtp, stored = mtp_layers(hp), sorted({k.split(".")[2] for k in info.tensors if k.startswith("mtp.layers.")})
    if mtp and not any(k.startswith("mtp.") for k in info.tensors):
        raise ModelError(f"config.json: mtp_num_hidden_layers = {mtp}, but the checkpoint has no mtp.* tensor "
                         "(no tensor mtp.fc.weight)", hint="the checkpoint's config and tensors disagree: set "
                                                           "mtp_num_hidden_layers to 0 or save the MTP layers too")
    if stored and len(stored) != mtp:
        raise ModelError(f"the checkpoint stores {len(stored)} MTP layer(s) (mtp.layers.*) for mtp_num_hidden_layers = "
                         f"{mtp}", hint="the checkpoint's config and tensors disagree: fix mtp_num_hidden_layers")
    for i, kind in enumerate(types):
        part, names = (("linear_attn", LINEAR_TENSORS) if kind == "linear_attention" else ("self_attn", ATTENTION_TENSORS))
        missing = [f"{prefix}{i}.{part}.{t}" for t in names if f"{prefix}{i}.{part}.{t}" not in info.tensors]
        if missing:
            raise ModelError(f"the checkpoint has no tensor {missing[0]} (layer_types says layer {i} is {kind})",
                             hint="the checkpoint's config and tensors disagree: save it again with transformers' "
                                  "save_pretrained, or fix layer_types")


# ---------------------------------------------------------------- GGUF (Qwen3_5TextModel)

QWEN35_MROPE_SECTION = [11, 11, 10, 0]  # _Qwen35MRopeMixin: written where rope_parameters has none


def mtp_layers(hp: dict) -> int:
    """The checkpoint's multi-token-prediction layers (config.json's mtp_num_hidden_layers): _QwenMtpMixin writes
    them as the blocks after the decoder's (llama.cpp's nextn layer, its speculative draft)."""
    return int(hp.get("mtp_num_hidden_layers") or 0)


def blocks(hp: dict) -> int:
    return hp["num_hidden_layers"] + mtp_layers(hp)


def add_qwen3_next_params(writer, hp: dict, ftype: int) -> None:
    """Qwen3NextModel.set_gguf_parameters: TextModel's keys (the block count with the MTP layers),
    Qwen2MoeModel's expert widths (where config.json has them), _QwenMtpMixin's nextn layer count, its own (the
    DeltaNet sizes, which blocks are recurrent, the attention interval, the partial RoPE's dimensions). A
    checkpoint with no MTP layer converts as `convert_hf_to_gguf.py --no-mtp` converts it (without it the
    converter stops on such a checkpoint: it asserts there is one)."""
    text.add_text_params(writer, {**hp, "num_hidden_layers": blocks(hp)}, ftype)
    if (n_ff := hp.get("moe_intermediate_size")) is not None:
        writer.add_expert_feed_forward_length(n_ff)
    if (n_ff := hp.get("shared_expert_intermediate_size")) is not None:
        writer.add_expert_shared_feed_forward_length(n_ff)
    if mtp_layers(hp):
        writer.add_nextn_predict_layers(mtp_layers(hp))
    writer.add_ssm_conv_kernel(hp["linear_conv_kernel_dim"])
    writer.add_ssm_state_size(hp["linear_key_head_dim"])
    writer.add_ssm_group_count(hp["linear_num_key_heads"])
    writer.add_ssm_time_step_rank(hp["linear_num_value_heads"])
    writer.add_ssm_inner_size(hp["linear_value_head_dim"] * hp["linear_num_value_heads"])
    if hp.get("layer_types") is not None:  # gguf-py's add_recurrent_layers; the MTP blocks are attention blocks
        writer.add_array(f"{writer.arch}.attention.recurrent_layers",
                         [kind == "linear_attention" for kind in hp["layer_types"]] + [False] * mtp_layers(hp))
    writer.add_full_attention_interval(hp.get("full_attention_interval", 4))
    rope_dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    writer.add_rope_dimension_count(int(rope_dim * text.rope_parameters(hp).get("partial_rotary_factor", 0.25)))


def add_qwen35_params(writer, hp: dict, ftype: int) -> None:
    """Qwen3_5TextModel / Qwen3_5MoeTextModel.set_gguf_parameters: Qwen3NextModel's keys, then
    _Qwen35MRopeMixin's default RoPE sections."""
    add_qwen3_next_params(writer, hp, ftype)
    if "mrope_section" not in text.rope_parameters(hp):
        writer.add_rope_dimension_sections(QWEN35_MROPE_SECTION)


def counted_mtp(hp: dict, names: list[str]) -> dict:
    """_QwenMtpMixin.filter_tensors on a config.json without mtp_num_hidden_layers (Qwen3-Next's): the MTP layers
    counted from the checkpoint's mtp.layers.<i>. tensors (the largest i, plus one)."""
    if hp.get("mtp_num_hidden_layers"):
        return hp
    stored = [int(n.split(".")[2]) for n in (n.removeprefix("model.") for n in names)
              if n.startswith("mtp.layers.") and n.split(".")[2].isdecimal()]
    return {**hp, "mtp_num_hidden_layers": max(stored) + 1} if stored else hp


# _QwenMtpMixin.filter_tensors: mtp.fc / pre_fc_norm_embedding / pre_fc_norm_hidden / norm -> the first MTP
# block's eh_proj / enorm / hnorm / shared_head.norm
MTP_PARTS = {"fc": "eh_proj", "pre_fc_norm_embedding": "enorm", "pre_fc_norm_hidden": "hnorm",
             "norm": "shared_head.norm"}


def mtp_rename(name: str, hp: dict) -> str:
    """_QwenMtpMixin.filter_tensors: the MTP layers as the blocks after the decoder's (mtp.layers.i.* ->
    model.layers.<num_hidden_layers + i>.*, their experts stacked as the decoder's), the MTP block's own tensors
    under the first of them."""
    name = name.removeprefix("model.") if name.startswith("model.mtp.") else name
    parts, n = name.split(".", 3), hp["num_hidden_layers"]
    if parts[0] != "mtp":
        return name
    if len(parts) == 4 and parts[1] == "layers" and parts[2].isdecimal():
        return f"model.layers.{n + int(parts[2])}.{parts[3]}"
    if len(parts) == 3 and parts[1] in MTP_PARTS:
        return f"model.layers.{n}.{MTP_PARTS[parts[1]]}.{parts[2]}"
    return name


def nextn_target(name: str, hp: dict) -> str:
    """The nextn tensors as llama.cpp names them (gguf 0.19's tables for qwen35 / qwen35moe have no nextn names)."""
    m = re.match(r"^model\.layers\.(\d+)\.(eh_proj|enorm|hnorm|shared_head\.norm)\.(weight|bias)$", name)
    if m is None:
        raise UnsupportedError(f"cannot map tensor '{name}' to a GGUF name",
                               hint="the checkpoint's MTP block holds a tensor llama.cpp has no name for")
    return f"blk.{m.group(1)}.nextn.{m.group(2).replace('.', '_')}.{m.group(3)}"


def shift(x, hp, dtype):
    return text.shift_norm(x, dtype)


def unshift(x, hp):
    return x - np.float32(1)


# Qwen3NextModel: every RMSNorm but the gated one (linear_attn.norm) stored as w + 1
NORM_RULE = TensorRule(r"(?<!linear_attn\.)norm\.weight$", forward=shift, inverse=unshift)
# the MTP block's own tensors (after mtp_rename); its norms are (1 + w) ones too
NEXTN_RULES = (
    TensorRule(r"\.(enorm|hnorm|shared_head\.norm)\.weight$", forward=shift, inverse=unshift, target=nextn_target),
    TensorRule(r"\.eh_proj\.weight$", target=nextn_target),
)
# _LinearAttentionVReorderBase's value-head reorder, then Qwen3NextModel's steps
DELTANET_RULES = (
    TensorRule(r"linear_attn\.in_proj_qkv\.weight$", forward=deltanet.qkv, inverse=deltanet.qkv_back),
    TensorRule(r"linear_attn\.in_proj_z\.weight$", forward=deltanet.z, inverse=deltanet.z_back),
    TensorRule(r"linear_attn\.in_proj_[ab]\.weight$", forward=deltanet.per_head, inverse=deltanet.per_head_back),
    TensorRule(r"linear_attn\.out_proj\.weight$", forward=deltanet.out_proj, inverse=deltanet.out_proj_back),
    TensorRule(r"linear_attn\.conv1d\.weight$", forward=deltanet.conv1d, inverse=deltanet.conv1d_back,
               shape=deltanet.conv1d_shape, hf_shape=deltanet.conv1d_hf_shape),
    TensorRule(r"linear_attn\.A_log$", forward=deltanet.a_log, inverse=deltanet.a_log_back),
    TensorRule(r"linear_attn\.dt_bias$", rename=(r"\.dt_bias$", ".dt_proj.bias"), forward=deltanet.per_head,
               inverse=deltanet.per_head_back),
    NORM_RULE,
)
QWEN35_RULES = NEXTN_RULES + DELTANET_RULES

QWEN35_GGUF = Gguf("QWEN35", add_qwen35_params, "gpt2", rules=QWEN35_RULES, blocks=blocks,
                   mrope_optional=True, renames=mtp_rename)
# Qwen3_5MoeTextModel: the dense model's steps and Qwen2MoeModel's experts (the MTP layers' too)
QWEN35_MOE_GGUF = Gguf("QWEN35MOE", add_qwen35_params, "gpt2", experts="qwen", shared_expert=True,
                       rules=QWEN35_RULES + FUSED_EXPERT_RULES, blocks=blocks, mrope_optional=True,
                       renames=mtp_rename)

# Qwen3NextModel.modify_tensors: no value-head reorder; in_proj_qkvz regrouped and written as attn_qkv and
# attn_gate, in_proj_ba as it is (ssm_ba)
QWEN3_NEXT_RULES = (
    TensorRule(r"linear_attn\.in_proj_qkvz\.weight$", forward=deltanet.qkvz, inverse=deltanet.qkvz_back,
               split=((r"\.in_proj_qkvz\.", ".in_proj_qkv."), (r"\.in_proj_qkvz\.", ".in_proj_z.")),
               split_rows=deltanet.qkvz_rows),
    TensorRule(r"linear_attn\.conv1d\.weight$", forward=deltanet.squeeze, inverse=deltanet.unsqueeze,
               shape=deltanet.conv1d_shape, hf_shape=deltanet.conv1d_hf_shape),
    TensorRule(r"linear_attn\.A_log$", forward=deltanet.neg_exp, inverse=deltanet.log_neg),
    TensorRule(r"linear_attn\.dt_bias$", rename=(r"\.dt_bias$", ".dt_proj.bias")),
    NORM_RULE,
)
QWEN3_NEXT_GGUF = Gguf("QWEN3NEXT", add_qwen3_next_params, "gpt2", experts="qwen", shared_expert=True,
                       rules=NEXTN_RULES + QWEN3_NEXT_RULES + FUSED_EXPERT_RULES, blocks=blocks, renames=mtp_rename,
                       tensor_hparams=counted_mtp)

# ---------------------------------------------------------------- MLX (mlx-lm's qwen3_5, qwen3_5_moe, qwen3_next)


def mlx_placement(hp: dict) -> list[str]:
    """The layer types mlx-lm's qwen3_5 (and qwen3_5_moe, qwen3_next) builds: every full_attention_interval-th layer a full-attention one (its
    DecoderLayer reads no layer_types; its default interval 4, as transformers')."""
    interval = hp.get("full_attention_interval") or 4
    return ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(hp["num_hidden_layers"])]


def check_mlx_layers(config: dict) -> None:
    """mlx-lm's qwen3_5 and qwen3_next place the attention layers by full_attention_interval alone: a checkpoint
    whose layer_types place them otherwise would be another model there (refused before work)."""
    hp = text.text_hparams(config)
    ours, theirs, interval = layer_types(config), mlx_placement(hp), hp.get("full_attention_interval") or 4
    if ours != theirs:
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
        raise UnsupportedError(f"mlx: layer_types makes layer {first} "
                               f"{ours[first] if first < len(ours) else 'absent'}, but mlx-lm's model places the "
                               f"attention layers by full_attention_interval = {interval} alone (it reads no "
                               "layer_types): it would build another model",
                               hint="use --method gguf for llama.cpp on Apple silicon (it writes the layer types)")


def check_mlx_rope(config: dict) -> None:
    """mlx-lm's qwen3_5 and qwen3_next hand the RoPE parameters to their own initialize_rope; quantkit proves it
    against transformers for the default RoPE (Qwen3.5's) only."""
    kind = text.rope_parameters(text.text_hparams(config)).get("rope_type", "default")
    if kind != "default":
        raise UnsupportedError(f"mlx: RoPE type '{kind}': mlx-lm's model is written by quantkit for the default "
                               "RoPE only", hint="use --method gguf for llama.cpp on Apple silicon")


def conv1d_to_mlx(x):
    return x.movedim(2, 1)  # [channels, 1, kernel] -> mlx's Conv1d [channels, kernel, 1]


def conv1d_from_mlx(x):
    return x.movedim(1, 2)


def norm_to_mlx(x):
    return (x.float() + 1).to(x.dtype)  # mlx-lm's nn.RMSNorm scales by its weight: 1 + w, rounded to the stored dtype


def norm_from_mlx(x):
    return x.float() - 1  # exact in float32: the (1 + w) mlx-lm computes with, as transformers' 1 + w


# mlx-lm's qwen3_5 sanitize, as mlx_lm.convert writes its result: the text model under language_model. (lm_head as
# language_model.lm_head), conv1d's kernel axis last, every (1 + w) RMSNorm (not the gated linear_attn.norm) stored
# as 1 + w, the MTP layers dropped, A_log in its stored dtype (its cast_predicate)
QWEN35_MLX = MlxLayout(
    prefix="language_model.",
    rules=(MlxRule(r"linear_attn\.conv1d\.weight$", conv1d_to_mlx, conv1d_from_mlx),
           MlxRule(r"(\.input_layernorm|\.post_attention_layernorm|\.q_norm|\.k_norm|^model\.norm)\.weight$",
                   norm_to_mlx, norm_from_mlx)),
    dropped=("mtp.",),
    uncast=("A_log",),
)
# mlx-lm's qwen3_next takes the Hugging Face names and config.json as they are, but its sanitize makes the same two
# value changes (conv1d's kernel axis last, the (1 + w) norms as 1 + w) only in a checkpoint that stores the experts
# one tensor per expert, the ones it stacks: the artifact stores them stacked and so the values changed, as
# mlx_lm.convert writes them (A_log cast with the rest: the model has no cast_predicate); its MTP layers dropped
QWEN3_NEXT_MLX = MlxLayout(prefix="", nested=False, rules=QWEN35_MLX.rules, dropped=("mtp.",))


QWEN35 = Family(
    "qwen3_5_text", "Qwen3_5ForCausalLM", "Qwen3.5",
    kept=KEPT,
    smoothing=QWEN35_ROWS,
    gguf={"Qwen3_5ForCausalLM": QWEN35_GGUF, "Qwen3_5ForConditionalGeneration": QWEN35_GGUF},
    checks=(check_layers,),
    mlx="qwen3_5", mlx_layout=QWEN35_MLX, mlx_checks=(check_mlx_layers, check_mlx_rope),
)

QWEN35_MOE = Family(
    "qwen3_5_moe_text", "Qwen3_5MoeForCausalLM", "Qwen3.5-MoE",
    kept=KEPT,
    smoothing=QWEN35_MOE_ROWS,
    moe=MoeLayout(),
    gguf={"Qwen3_5MoeForCausalLM": QWEN35_MOE_GGUF, "Qwen3_5MoeForConditionalGeneration": QWEN35_MOE_GGUF},
    checks=(check_layers,),
    mlx="qwen3_5_moe", mlx_layout=QWEN35_MLX, mlx_experts=MlxExperts(split_fused=True),
    mlx_checks=(check_mlx_layers, check_mlx_rope),
)

QWEN3_NEXT = Family(
    "qwen3_next", "Qwen3NextForCausalLM", "Qwen3-Next",
    kept=(Kept(r"re:.*linear_attn\.in_proj_ba$", "Gated DeltaNet's beta/alpha gates (in_proj_ba) 16-bit"),),
    smoothing=QWEN35_MOE_ROWS,
    moe=MoeLayout(),
    gguf={"Qwen3NextForCausalLM": QWEN3_NEXT_GGUF},
    mlx="qwen3_next", mlx_layout=QWEN3_NEXT_MLX, mlx_experts=MlxExperts(split_fused=True),
    mlx_checks=(check_mlx_layers, check_mlx_rope),
)

FAMILIES = (QWEN35, QWEN35_MOE, QWEN3_NEXT)
