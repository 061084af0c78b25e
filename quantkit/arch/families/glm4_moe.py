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

GGUF: llama.cpp conversion/glm.py's Glm4MoeModel: TextModel's keys with the block count counting the MTP layers
(num_hidden_layers + num_nextn_predict_layers, as the converter counts them by default, without --no-mtp), the
RoPE dimension count (head_dim x partial_rotary_factor, 0.5 where the RoPE parameters state none), the routed
experts' count and width, the shared experts' count, the dense layers before the first MoE one
(first_k_dense_replace), the sigmoid gating function, routed_scaling_factor as the experts' weight scale,
norm_topk_prob, the MTP layer count. Tensors as TensorNameMap names them: the routed experts stacked per
projection (ffn_{gate,up,down}_exps), the shared experts as ffn_*_shexp, the correction bias as exp_probs_b,
q/k norms and attention biases where the checkpoint has them; no q/k permutation (GLM-4.5 rotates NeoX halves,
as llama.cpp's glm4moe graph does). The MTP layers (`model.layers.<num_hidden_layers + i>.`) are written as the
converter writes them by default: blocks num_hidden_layers + i, their decoder tensors under the usual names and
eh_proj / enorm / hnorm / shared_head.norm (/ shared_head.head / embed_tokens) as blk.N.nextn.* (llama.cpp's
speculative draft; a llama.cpp without MTP ignores them); a checkpoint saved by transformers has none, and the file
then has the blocks counted without their tensors, as the converter writes it (llama.cpp loads the decoder alone).
Reading the file back (the gate) skips those blocks: transformers' model has no module for them. The vocabulary
(TextModel._set_vocab_glm): tokenizer.json's byte-level BPE, then bos [gMASK], eot <|user|>, unk <|endoftext|>, eom
<|observation|> where the tokenizer files name none of that kind (quantkit.gguf.vocab's "glm" kind); a tokenizer
without those four added tokens is refused before work (the converter fails on it).

MLX: mlx-lm's glm4_moe, the routed experts stacked as `mlp.switch_mlp.*` (its MoEGate holds the router and its
correction bias, 16-bit); it requires a top-level rope_scaling key (written null) and rotates without scaling, so
a scaled RoPE is refused; its sanitize drops the MTP layer.
"""

from __future__ import annotations

from quantkit.arch.families import text
from quantkit.arch.families.base import ExpertCheckpoint, Family, Gguf, MlxExperts, MoeLayout
from quantkit.arch.families.llama import ROUTED_ROWS

ARCH = "Glm4MoeForCausalLM"


def mtp_layers(hp: dict) -> int:
    """The checkpoint's multi-token-prediction layers (num_nextn_predict_layers), counted as blocks by default."""
    return int(hp.get("num_nextn_predict_layers") or 0)


def blocks(hp: dict) -> int:
    """Glm4MoeModel.__init__'s block count: the decoder's layers and the MTP layers after them."""
    return hp["num_hidden_layers"] + mtp_layers(hp)


def add_glm4_moe_params(writer, hp: dict, ftype: int) -> None:
    """Glm4MoeModel.set_gguf_parameters: TextModel's keys (the block count with the MTP layers; the expert count
    from n_routed_experts, which the class writes again with the same value), then its own."""
    import gguf

    text.add_text_params(writer, {**hp, "num_hidden_layers": blocks(hp)}, ftype)
    rope_dim = hp.get("head_dim") or hp["hidden_size"] // hp["num_attention_heads"]
    writer.add_rope_dimension_count(int(rope_dim * text.rope_parameters(hp).get("partial_rotary_factor", 0.5)))
    if (n_ff := hp.get("moe_intermediate_size")) is not None:
        writer.add_expert_feed_forward_length(n_ff)
    if (shared := hp.get("n_shared_experts")) is not None:
        writer.add_expert_shared_count(shared)
    if (dense := hp.get("first_k_dense_replace")) is not None:
        writer.add_leading_dense_block_count(dense)
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if (scale := hp.get("routed_scaling_factor")) is not None:
        writer.add_expert_weights_scale(scale)
    if (norm := hp.get("norm_topk_prob")) is not None:
        writer.add_expert_weights_norm(norm)
    if hp.get("num_nextn_predict_layers") is not None:
        writer.add_nextn_predict_layers(hp["num_nextn_predict_layers"])


GLM4_MOE = Family("glm4_moe", ARCH, "GLM-4.5", smoothing=ROUTED_ROWS, moe=MoeLayout(),
                  experts_by_name=ExpertCheckpoint(mtp_keys=("num_nextn_predict_layers",)),
                  gguf={ARCH: Gguf("GLM4_MOE", add_glm4_moe_params, "glm", experts="qwen", blocks=blocks,
                                   own_names=True)},
                  mlx="glm4_moe", mlx_experts=MlxExperts(uncast=("e_score_correction_bias",)), mlx_fields=lambda config: {"rope_scaling": None},
                  mlx_checks=(text.check_mlx_rope_unscaled,))

FAMILIES = (GLM4_MOE,)
