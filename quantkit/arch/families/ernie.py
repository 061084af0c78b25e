"""ERNIE 4.5 dense (Ernie4_5ForCausalLM): a Llama-style decoder with interleaved (GLM-style) RoPE and, by default,
tied embeddings. GGUF: llama.cpp conversion/ernie.py's Ernie4_5Model (TextModel's keys; no q/k permutation: its
ernie4_5 graph rotates interleaved pairs, as transformers does), whose vocabulary is the SentencePiece
tokenizer.model alone (`_set_vocab_sentencepiece`, then add_prefix_space from tokenizer_config.json): a checkpoint
without one is refused, as the converter fails on it. llama.cpp's ernie4_5 model loads no feed-forward biases, so
a checkpoint with `use_bias` is refused for GGUF (the file would not load).

ERNIE 4.5 MoE (Ernie4_5_MoeForCausalLM): the same attention, MoE layers from `moe_layer_start_index` every
`moe_layer_interval` layers, routed experts stored one tensor per expert projection beside shared experts
(`mlp.shared_experts`), a softmax router (`mlp.gate`, kept 16-bit) whose correction bias is stored as
`mlp.moe_statics.e_score_correction_bias` (transformers moves it under the router: quantkit's reading renames it
as transformers does, quantkit.arch.moe.load_renamings). The llm-compressor methods calibrate every expert on
every token. GGUF: conversion/ernie.py's Ernie4_5MoeModel: Ernie4_5Model's keys and vocabulary, the expert
counts, the dense layers before the first MoE one and the MoE interval, the shared experts (their feed-forward
length written as intermediate_size // num_key_value_heads, as the converter computes it); the experts stacked
per projection, the correction bias as ffn_exp_probs_b; the MTP tensors dropped. MLX refuses it (mlx_refusal):
mlx-lm's ernie4_5_moe routes without the correction bias.
"""

from __future__ import annotations

from pathlib import Path

from quantkit.arch.families import text
from quantkit.arch.families.base import ExpertCheckpoint, Family, Gguf, MoeLayout, TensorRule
from quantkit.arch.families.llama import LLAMA_LIKE, ROUTED_ROWS
from quantkit.errors import UnsupportedError

ARCH = "Ernie4_5ForCausalLM"


def check_no_bias(arch: str, hp: dict) -> None:
    if hp.get("use_bias"):
        raise UnsupportedError(f"GGUF conversion of {arch}: use_bias = true (llama.cpp's ernie4_5 model loads no "
                               "feed-forward biases; the converter writes them and the file fails to load)",
                               hint="ERNIE 4.5 checkpoints have none; use a compressed-tensors method or mlx for "
                                    "this one")


def check_tokenizer_model(model_dir: Path, hp: dict) -> None:
    """Ernie4_5Model.set_vocab reads tokenizer.model only (its _set_vocab_sentencepiece fails without one)."""
    if not (Path(model_dir) / "tokenizer.model").is_file():
        raise UnsupportedError(f"GGUF conversion of {ARCH}: no tokenizer.model in {model_dir} (llama.cpp's converter "
                               "reads ERNIE 4.5's vocabulary only from its SentencePiece tokenizer.model)",
                               hint="copy tokenizer.model from the original ERNIE 4.5 checkpoint into the model "
                                    "directory")


ERNIE4_5 = Family(
    "ernie4_5", ARCH, "ERNIE 4.5",
    smoothing=LLAMA_LIKE,
    gguf={ARCH: Gguf("ERNIE4_5", text.add_text_params, "ernie4_5", checks=(check_no_bias,),
                     vocab_check=check_tokenizer_model)},
    mlx="ernie4_5",
)

def add_ernie_moe_params(writer, hp: dict, ftype: int) -> None:
    """Ernie4_5MoeModel.set_gguf_parameters: Ernie4_5Model's + the experts, the dense layers before the first MoE one
    and the MoE layers' interval, the shared experts (their feed-forward length as the converter computes it:
    intermediate_size // num_key_value_heads)."""
    text.add_text_params(writer, hp, ftype)
    writer.add_expert_count(hp["moe_num_experts"])
    writer.add_expert_used_count(hp["moe_k"])
    writer.add_interleave_moe_layer_step(hp["moe_layer_interval"])
    writer.add_leading_dense_block_count(hp["moe_layer_start_index"])
    if (n_ff := hp.get("moe_intermediate_size")) is not None:
        writer.add_expert_feed_forward_length(n_ff)
    if (shared := hp.get("moe_num_shared_experts")) is not None:
        writer.add_expert_shared_count(shared)
        if shared > 0 and hp.get("intermediate_size") is not None and hp.get("num_key_value_heads") is not None:
            writer.add_expert_shared_feed_forward_length(hp["intermediate_size"] // hp["num_key_value_heads"])


# the reading of the file: the model's name of the correction bias (transformers moves it under the router) back to
# the checkpoint's, which the converter maps
MOE_RULES = (TensorRule(r"\.gate\.moe_statics\.e_score_correction_bias$",
                        rename=(r"\.gate\.moe_statics\.", ".moe_statics.")),)
MOE_ARCH = "Ernie4_5_MoeForCausalLM"
ERNIE4_5_MOE = Family(
    "ernie4_5_moe", MOE_ARCH, "ERNIE 4.5 MoE", smoothing=ROUTED_ROWS, moe=MoeLayout(), experts_by_name=ExpertCheckpoint(),
    gguf={MOE_ARCH: Gguf("ERNIE4_5_MOE", add_ernie_moe_params, "ernie4_5", experts="qwen", checks=(check_no_bias,),
                         vocab_check=check_tokenizer_model,
                         rules=MOE_RULES)},
    mlx_refusal="mlx-lm's ernie4_5_moe drops the routers' e_score_correction_bias, which transformers adds to the "
                "scores it takes the top-k experts by: it would route otherwise",
)

FAMILIES = (ERNIE4_5, ERNIE4_5_MOE)
