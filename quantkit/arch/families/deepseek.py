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

GGUF: llama.cpp conversion/deepseek.py's DeepseekV2Model (architecture deepseek2): TextModel's keys with the MLA
written as MQA (one key/value head), the MLA sizes (q_lora_rank where there is one, kv_lora_rank, key/value
lengths of the latent and of the decompressed heads, the RoPE dimensions), the dense layers before the first MoE
one, the experts (their width, the shared ones, the routed weights' scale and norm, the groups of the grouped
top-k, the gating function from config.json's scoring_func) and YaRN's log multiplier (0.1 x mscale_all_dim, as
the converter writes it); its GPT-2 style vocabulary from tokenizer.json. Its tensor changes: the routed experts
stacked per projection, the correction bias as exp_probs_b, kv_b_proj split into attn_k_b (each head's key rows,
transposed: [heads, kv_lora_rank, qk_nope_head_dim]) and attn_v_b ([heads, v_head_dim, kv_lora_rank]), which the
gate's reading joins back into kv_b_proj; the MTP layers are not written (the converter's default for
DeepseekV3ForCausalLM: skip_mtp), nor a tied lm_head. Refused before work: what the converter fails on (key/value
heads other than the attention heads: its split asserts them equal), and what llama.cpp's deepseek2 would run
otherwise than transformers does: a router config.json names no sigmoid scoring_func for (llama.cpp then routes
with softmax; transformers' DeepseekV3 always with sigmoid), rope_interleave false (llama.cpp rotates interleaved
pairs), a vocabulary without tokenizer.json (Kimi K2's tiktoken one needs its remote code). The kv_b pieces take
other inputs in llama.cpp's absorbed MLA than kv_b_proj does (each head's q_nope; each head's attention output
over the latent): quantkit's imatrix collects those, as llama-imatrix does (mla_imatrix_inputs). Per-tensor types
(--auto-precision, --fallback) are refused: their sensitivity measurement reads checkpoint tensors, not the pieces.

MLX: mlx-lm's deepseek_v3, the routed experts stacked as `mlp.switch_mlp.*`, the router and its correction bias
16-bit. Its sanitize splits kv_b_proj per head into embed_q / unembed_out (MultiLinear), a quantized one
dequantized and quantized again with mlx's own rounding: kv_b_proj is kept 16-bit for mlx (MLX_KV_B), so the split
is exact. The MTP layers are not written (mlx-lm's model has none); a scaled RoPE is refused (quantkit writes
mlx-lm no rope_scaling for it).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

from quantkit.arch.families import text
from quantkit.arch.families.base import (ExpertCheckpoint, Family, Gguf, Kept, Mapping, MlxExperts, MoeLayout, Pieces,
                                         TensorRule)
from quantkit.arch.families.llama import ROUTED_ROWS
from quantkit.errors import UnsupportedError

# multi-head latent attention: the input norm feeds the two down-projections, each latent norm its up-projection
# (kv_a_layernorm normalizes the latent part of kv_a_proj_with_mqa's output, which kv_b_proj alone reads); no v -> o
# row (o_proj reads the attention over kv_b's values); the MLP rows as the other routed-expert families'
MLA_ROWS = (
    Mapping("re:.*input_layernorm$", ("re:.*q_a_proj$", "re:.*kv_a_proj_with_mqa$"), smoothquant=True),
    Mapping("re:.*q_a_layernorm$", ("re:.*q_b_proj$",), smoothquant=True),
    Mapping("re:.*kv_a_layernorm$", ("re:.*kv_b_proj$",), smoothquant=True),
    *ROUTED_ROWS[2:],  # up -> down
)

# ---------------------------------------------------------------- GGUF (DeepseekV2Model)

ARCH = "DeepseekV3ForCausalLM"


def add_deepseek_params(writer, hp: dict, ftype: int) -> None:
    """DeepseekV2Model.set_gguf_parameters: TextModel's keys with one key/value head (MLA written as MQA) and
    rms_norm_eps defaulting to 1e-6; then the class's own (its key/value lengths replace TextModel's head_dim
    ones)."""
    text.add_text_params(writer, {**hp, "num_key_value_heads": 1, "rms_norm_eps": hp.get("rms_norm_eps", 1e-6),
                                  "head_dim": None}, ftype)
    dense = hp.get("first_k_dense_replace")
    if dense is None:
        dense = hp["num_hidden_layers"] if hp.get("n_routed_experts") is None else 0
    writer.add_leading_dense_block_count(dense)
    writer.add_vocab_size(hp["vocab_size"])
    if hp.get("q_lora_rank") is not None:
        writer.add_q_lora_rank(hp["q_lora_rank"])
    kv_lora_rank = hp.get("kv_lora_rank", 512)
    writer.add_kv_lora_rank(kv_lora_rank)
    writer.add_key_length(kv_lora_rank + hp["qk_rope_head_dim"])
    writer.add_value_length(kv_lora_rank)
    writer.add_key_length_mla(hp["qk_nope_head_dim"] + hp["qk_rope_head_dim"])
    writer.add_value_length_mla(hp["v_head_dim"])
    writer.add_expert_feed_forward_length(text.find(hp, ("moe_intermediate_size", "intermediate_size")))
    writer.add_expert_shared_count(hp.get("n_shared_experts", 0))  # the expert count: TextModel's key
    if hp.get("routed_scaling_factor") is not None:
        writer.add_expert_weights_scale(hp["routed_scaling_factor"])
    if hp.get("norm_topk_prob"):
        writer.add_expert_weights_norm(hp["norm_topk_prob"])
    writer.add_rope_dimension_count(hp["qk_rope_head_dim"])
    if (mscale_all_dim := text.rope_parameters(hp).get("mscale_all_dim")) is not None:
        writer.add_rope_scaling_yarn_log_mul(0.1 * mscale_all_dim)


def check_heads(arch: str, hp: dict) -> None:
    """kv_b_proj holds num_attention_heads heads; the converter splits it by num_key_value_heads (it asserts
    they agree)."""
    kv, heads = hp.get("num_key_value_heads"), hp["num_attention_heads"]
    if kv is not None and kv != heads:
        raise UnsupportedError(f"GGUF conversion of {arch}: num_key_value_heads = {kv} with {heads} attention heads "
                               "(llama.cpp's converter splits kv_b_proj by num_key_value_heads and fails unless "
                               "they are equal)", hint="DeepSeek-V3 and Kimi K2 configs state them equal: set "
                                                       f"num_key_value_heads to {heads} in config.json")


def check_scoring(arch: str, hp: dict) -> None:
    """transformers' DeepseekV3 routes with sigmoid scores whatever config.json says; llama.cpp's deepseek2 with
    the gating function the file names (softmax where it names none)."""
    function = text.find(hp, text.SCORE_FUNCTION_KEYS)
    if function != "sigmoid":
        what = f"scoring_func = {function!r}" if function is not None else "config.json names no scoring_func"
        raise UnsupportedError(f"GGUF conversion of {arch}: {what} (llama.cpp's deepseek2 would route its experts "
                               "with softmax scores; transformers' DeepseekV3 routes with sigmoid)",
                               hint='DeepSeek-V3 and Kimi K2 configs state "scoring_func": "sigmoid": add it to '
                                    "config.json")


def check_rope_interleave(arch: str, hp: dict) -> None:
    if hp.get("rope_interleave", True) is False:
        raise UnsupportedError(f"GGUF conversion of {arch}: rope_interleave = false (llama.cpp's deepseek2 rotates "
                               "interleaved pairs, the layout DeepSeek-V3's weights have; the converter does not "
                               "reorder them)", hint="DeepSeek-V3 checkpoints use interleaved RoPE (the default)")


def check_tokenizer_json(model_dir: Path, hp: dict) -> None:
    """DeepseekV2Model.set_vocab: tokenizer.json through _set_vocab_gpt2; without it, Kimi K2's tiktoken vocabulary
    through its remote code (trust_remote_code), which quantkit does not run."""
    if not (Path(model_dir) / "tokenizer.json").is_file():
        raise UnsupportedError(f"GGUF conversion of {ARCH}: no tokenizer.json in {model_dir} (llama.cpp's converter "
                               "reads another vocabulary, Kimi K2's tiktoken one, only through the model's remote "
                               "code)", hint="save a tokenizer.json beside it (a fast tokenizer's save_pretrained)")


def mtp_or_tied_head(name: str, hp: dict) -> bool:
    """DeepseekV2Model.modify_tensors' skips: a tied lm_head, and the MTP layers (model.layers.<i>, i at or after
    num_hidden_layers: skip_mtp)."""
    if hp.get("tie_word_embeddings", False) and name in ("lm_head.weight", "model.lm_head.weight"):
        return True
    m = re.match(r"model.layers.(\d+)", name)
    return m is not None and int(m.group(1)) >= hp["num_hidden_layers"]


def kv_b_shapes(shape: tuple[int, ...], hp: dict) -> tuple[tuple[int, ...], ...]:
    heads, nope, v = hp["num_attention_heads"], hp["qk_nope_head_dim"], hp["v_head_dim"]
    return (heads, shape[-1], nope), (heads, v, shape[-1])


def kv_b_cut(values: np.ndarray, hp: dict) -> tuple[np.ndarray, np.ndarray]:
    """kv_b_proj [heads x (nope + v), kv_lora_rank] -> k_b [heads, kv_lora_rank, nope] (transposed), v_b [heads,
    v, kv_lora_rank]."""
    nope = hp["qk_nope_head_dim"]
    per_head = values.reshape(hp["num_attention_heads"], nope + hp["v_head_dim"], values.shape[-1])
    return np.ascontiguousarray(per_head[:, :nope].transpose(0, 2, 1)), np.ascontiguousarray(per_head[:, nope:])


def kv_b_join(pieces: list[np.ndarray], hp: dict) -> np.ndarray:
    k_b, v_b = pieces
    joined = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
    return joined.reshape(-1, joined.shape[-1])


def kv_b_hf_shape(shapes: list[tuple[int, ...]], hp: dict) -> tuple[int, ...]:
    (heads, kv_lora_rank, nope), (_, v, _) = shapes
    return heads * (nope + v), kv_lora_rank


KV_B = Pieces(kv_b_shapes, kv_b_cut, kv_b_join, kv_b_hf_shape)


def mla_imatrix_inputs(model, hp: dict, add) -> list:
    """What llama-imatrix collects for the kv_b pieces in llama.cpp's absorbed MLA (deepseek2's graph): attn_k_b
    multiplies each head's q_nope (the query before RoPE's part), attn_v_b each head's attention output over the
    normalized latent (softmax(q k^T x scale) @ kv_a_layernorm's output, causal). Hooks on each attention module:
    its projections' outputs are kept as they are computed, and at its end the two inputs are formed from them (the
    scores as transformers' DeepseekV3Attention computes them) and handed to `add`, one matrix per head."""
    import torch
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (apply_rotary_pos_emb,
                                                                       apply_rotary_pos_emb_interleave)

    heads, nope, rope = hp["num_attention_heads"], hp["qk_nope_head_dim"], hp["qk_rope_head_dim"]
    kv_lora_rank, rotate = hp.get("kv_lora_rank", 512), (apply_rotary_pos_emb_interleave if
                                                         hp.get("rope_interleave", True) else apply_rotary_pos_emb)
    handles = []
    for name, module in model.named_modules():
        if not (hasattr(module, "kv_b_proj") and hasattr(module, "kv_a_layernorm")):
            continue
        layer, seen = int(re.search(r"layers\.(\d+)\.", name + ".").group(1)), {}

        def keep(key, seen=seen):
            return lambda _module, _inputs, output: seen.__setitem__(key, output.detach())

        query = module.q_proj if getattr(module, "q_proj", None) is not None else module.q_b_proj
        for key, part in (("q", query), ("kv_a", module.kv_a_proj_with_mqa), ("latent", module.kv_a_layernorm),
                          ("kv_b", module.kv_b_proj)):
            handles.append(part.register_forward_hook(keep(key)))

        def finish(attention, args, kwargs, _output, seen=seen, layer=layer):
            cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
            q = seen["q"].float()
            batch, length = q.shape[:2]
            q = q.view(batch, length, heads, nope + rope).transpose(1, 2)
            q_nope, q_rot = torch.split(q, [nope, rope], dim=-1)
            k_rot = seen["kv_a"].float()[..., kv_lora_rank:].reshape(batch, 1, length, rope)
            q_rot, k_rot = rotate(q_rot, k_rot, cos.float(), sin.float())
            k_nope = seen["kv_b"].float().view(batch, length, heads, -1).transpose(1, 2)[..., :nope]
            keys = torch.cat([k_nope, k_rot.expand(-1, heads, -1, -1)], dim=-1)
            scores = torch.cat([q_nope, q_rot], dim=-1) @ keys.transpose(-1, -2) * attention.scaling
            causal = torch.ones(length, length, dtype=torch.bool, device=scores.device).triu(1)
            weights = scores.masked_fill(causal, float("-inf")).softmax(dim=-1)
            latent = weights @ seen["latent"].float().view(batch, 1, length, kv_lora_rank)
            for piece, rows in (("attn_k_b", q_nope), ("attn_v_b", latent)):  # [heads, tokens, columns]
                add(f"blk.{layer}.{piece}.weight", rows.transpose(0, 1).reshape(heads, batch * length, -1)
                    .to(torch.float64))
            seen.clear()

        handles.append(module.register_forward_hook(finish, with_kwargs=True))
    return handles


RULES = (TensorRule(r"self_attn\.kv_b_proj\.weight$", split=((r"kv_b_proj", "k_b_proj"), (r"kv_b_proj", "v_b_proj")),
                    pieces=KV_B),)

# mlx-lm's deepseek_v3 sanitize splits kv_b_proj per head into embed_q / unembed_out, a quantized one dequantized and
# quantized again with its own rounding along other columns: kept 16-bit, it splits the weight exactly
MLX_KV_B = Kept(r"re:.*\.self_attn\.kv_b_proj$", "MLA's kv_b_proj in MLX: mlx-lm's deepseek_v3 splits it per head and "
                "would quantize a quantized one again with its own rounding", methods=("mlx",))

DEEPSEEK_V3 = Family("deepseek_v3", ARCH, "DeepSeek-V3", smoothing=MLA_ROWS, moe=MoeLayout(),
                     experts_by_name=ExpertCheckpoint(mtp_keys=("num_nextn_predict_layers", "num_mtp_layers")),
                     gguf={ARCH: Gguf("DEEPSEEK2", add_deepseek_params, "gpt2", experts="qwen", rules=RULES,
                                      checks=(check_heads, check_scoring, check_rope_interleave),
                                      vocab_check=check_tokenizer_json, drops=mtp_or_tied_head,
                                      layer_kv_heads=lambda hp: [1] * hp["num_hidden_layers"],
                                      imatrix_inputs=mla_imatrix_inputs)},
                     kept=(MLX_KV_B,), mlx="deepseek_v3", mlx_experts=MlxExperts(uncast=("e_score_correction_bias",)),
                     mlx_checks=(text.check_mlx_rope_unscaled,))

FAMILIES = (DEEPSEEK_V3,)
