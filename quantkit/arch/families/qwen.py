"""Qwen2 / 2.5 (Qwen2ForCausalLM), Qwen3 (Qwen3ForCausalLM), Qwen2-MoE, Qwen3-MoE, and the text models of
Qwen2-VL, Qwen2.5-VL and Qwen3-VL (their decoder layers are Qwen2's / Qwen3's).

GGUF: llama.cpp conversion/qwen.py (Qwen2Model, Qwen2MoeModel, Qwen3Model, Qwen3MoeModel) and qwenvl.py / qwen3vl.py for the
VLMs' language models (multimodal RoPE sections; Qwen3-VL's deepstack layer count).

MLX: mlx-lm's qwen2_moe and qwen3_moe, the routed experts stacked as `mlp.switch_mlp.*`, the routers (`mlp.gate`,
Qwen2-MoE's `shared_expert_gate`) 16-bit; both read the expert count as `num_experts` (written beside transformers
5's `num_local_experts`). mlx-lm's qwen2_moe routes every layer and never renormalises the top-k weights: a
Qwen2-MoE config.json with dense layers or norm_topk_prob is refused.
"""

from __future__ import annotations

from quantkit.arch.families import text
from quantkit.arch.families.base import (ConfigRules, ExpertCheckpoint, Family, Gguf, MlxExperts, MoeLayout,
                                         TensorRule)
from quantkit.arch.families.llama import LLAMA_LIKE, MOE_ROWS, decoder_rows
from quantkit.errors import UnsupportedError

# Qwen2-MoE also feeds its shared expert and `shared_expert_gate` from the MLP norm: they are balance layers of
# the same row (llm-compressor's MoE list leaves them out, which would scale the shared expert's input
# uncompensated)
SHARED_EXPERT = ("re:.*mlp.shared_expert.gate_proj$", "re:.*mlp.shared_expert.up_proj$", "re:.*mlp.shared_expert_gate$")
QWEN2_MOE_ROWS = decoder_rows("post_attention_layernorm",
                              mlp_balance=("re:.*mlp.gate$", "re:.*mlp.experts.*.gate_proj$",
                                           "re:.*mlp.experts.*.up_proj$") + SHARED_EXPERT,
                              smoothquant_mlp=False)

# ---------------------------------------------------------------- config.json rules (Qwen2Config, Qwen3Config, ...)


def qwen_window(hp: dict, kwargs: dict) -> None:
    """Qwen2/Qwen3(-MoE): the window only where use_sliding_window is set."""
    hp["sliding_window"] = hp["sliding_window"] if hp["use_sliding_window"] else None


def qwen_layer_types(hp: dict, kwargs: dict) -> None:
    if hp["layer_types"] is None:
        hp["layer_types"] = ["sliding_attention" if hp["sliding_window"] is not None and i >= hp["max_window_layers"]
                             else "full_attention" for i in range(hp["num_hidden_layers"])]


def mlp_only_layers(hp: dict, kwargs: dict) -> None:
    if hp["mlp_only_layers"] is None:
        hp["mlp_only_layers"] = []


# ---------------------------------------------------------------- GGUF


def add_qwen_moe_params(writer, hp: dict, ftype: int) -> None:
    """Qwen2MoeModel.set_gguf_parameters: TextModel's + the expert and shared-expert feed-forward lengths (where
    config.json has them: Qwen3-MoE has no shared expert)."""
    text.add_text_params(writer, hp, ftype)
    if (n_ff := hp.get("moe_intermediate_size")) is not None:
        writer.add_expert_feed_forward_length(n_ff)
    if (n_ff := hp.get("shared_expert_intermediate_size")) is not None:
        writer.add_expert_shared_feed_forward_length(n_ff)


def add_qwen3vl_params(writer, hp: dict, ftype: int) -> None:
    """Qwen3VLTextModel.set_gguf_parameters: TextModel's + how many deepstack mergers feed the decoder."""
    text.add_text_params(writer, hp, ftype)
    writer.add_num_deepstack_layers(len((hp.get("vision_config") or {}).get("deepstack_visual_indexes", [])))


def check_topk_renormalised(arch: str, hp: dict) -> None:
    if not hp.get("norm_topk_prob", False):
        raise UnsupportedError(
            f"GGUF conversion of {arch}: norm_topk_prob = false (llama.cpp's qwen3moe always renormalises the "
            "top-k weights)", hint="supported: every layer a routed-expert layer, top-k weights renormalised, "
                                   "no shared experts")


def check_qwen2_moe_routing(arch: str, hp: dict) -> None:
    """llama.cpp's qwen2moe: the top-k weights never renormalised, a shared expert in every layer."""
    hint = "supported: norm_topk_prob false and a shared expert (shared_expert_intermediate_size > 0), as " \
           "Qwen1.5-MoE and Qwen2-MoE are released"
    if hp.get("norm_topk_prob", False):
        raise UnsupportedError(f"GGUF conversion of {arch}: norm_topk_prob = true (llama.cpp's qwen2moe never "
                               "renormalises the top-k weights)", hint=hint)
    if not hp.get("shared_expert_intermediate_size"):
        raise UnsupportedError(f"GGUF conversion of {arch}: no shared expert (llama.cpp's qwen2moe loads one in "
                               "every layer)", hint=hint)


def mlx_expert_count(config: dict) -> dict:
    """mlx-lm's qwen2_moe / qwen3_moe read the expert count as `num_experts`, which transformers 5 writes
    `num_local_experts`."""
    return {"num_experts": config["num_local_experts"]} if "num_local_experts" in config else {}


def check_mlx_qwen2_moe(config: dict) -> None:
    """mlx-lm's qwen2_moe: every layer a routed one, its top-k weights not renormalised."""
    if config.get("mlp_only_layers") or config.get("decoder_sparse_step", 1) != 1 or config.get("norm_topk_prob"):
        raise UnsupportedError("mlx: Qwen2-MoE with dense layers (mlp_only_layers, decoder_sparse_step) or "
                               "norm_topk_prob: mlx-lm's qwen2_moe routes every layer and never renormalises the "
                               "top-k weights", hint="use --method gguf for llama.cpp on Apple silicon")


QWEN2_GGUF = Gguf("QWEN2", text.add_text_params, "qwen2")
QWEN2VL_GGUF = Gguf("QWEN2VL", text.add_text_params, "qwen2", mrope=True)
QWEN_RULES = ConfigRules((qwen_window, text.kv_heads, qwen_layer_types))

QWEN2 = Family("qwen2", "Qwen2ForCausalLM", "Qwen2.5", smoothing=LLAMA_LIKE, gguf={"Qwen2ForCausalLM": QWEN2_GGUF},
               mlx="qwen2", config=QWEN_RULES)
QWEN3 = Family("qwen3", "Qwen3ForCausalLM", "Qwen3", smoothing=LLAMA_LIKE,
               gguf={"Qwen3ForCausalLM": Gguf("QWEN3", text.add_text_params, "qwen2")}, mlx="qwen3", config=QWEN_RULES)
# Qwen2MoeModel.modify_tensors (and its subclasses': Qwen3-MoE, Qwen3.5-MoE, Qwen3-Next) takes routed experts stored
# fused as well as one tensor per expert: gate_up_proj ([experts, 2 x intermediate, hidden]) cut into its gate and
# up halves along the rows, down_proj ([experts, hidden, intermediate]) as it is, each written as the stacked per-expert
# tensors would be (Qwen3.5-MoE's released checkpoints store them so)
FUSED_EXPERT_RULES = (
    TensorRule(r"\.mlp\.experts\.gate_up_proj$",
               split=((r"gate_up_proj$", "gate_proj.weight"), (r"gate_up_proj$", "up_proj.weight"))),
    TensorRule(r"\.mlp\.experts\.down_proj$", rename=(r"down_proj$", "down_proj.weight")),
)
# Qwen2MoeModel: TextModel's vocabulary (BPE), the experts stacked (or cut from fused storage), the shared expert
# and its one-output gate as ffn_*_shexp and ffn_gate_inp_shexp
QWEN2_MOE = Family("qwen2_moe", "Qwen2MoeForCausalLM", "Qwen2-MoE", smoothing=QWEN2_MOE_ROWS, moe=MoeLayout(),
                   gguf={"Qwen2MoeForCausalLM": Gguf("QWEN2MOE", add_qwen_moe_params, "gpt2", experts="qwen",
                                                     shared_expert=True, checks=(check_qwen2_moe_routing,),
                                                     rules=FUSED_EXPERT_RULES)},
                   mlx="qwen2_moe", mlx_experts=MlxExperts(), mlx_fields=mlx_expert_count,
                   mlx_checks=(check_mlx_qwen2_moe,))
QWEN3_MOE = Family(
    "qwen3_moe", "Qwen3MoeForCausalLM", "Qwen3-MoE", smoothing=MOE_ROWS, moe=MoeLayout(),
    experts_by_name=ExpertCheckpoint(),
    gguf={"Qwen3MoeForCausalLM": Gguf("QWEN3MOE", add_qwen_moe_params, "qwen2", experts="qwen",
                                      checks=(check_topk_renormalised,), rules=FUSED_EXPERT_RULES)},
    config=ConfigRules((qwen_window, mlp_only_layers)),
    mlx="qwen3_moe", mlx_experts=MlxExperts(split_fused=True), mlx_fields=mlx_expert_count,
)
# the text models of the Qwen VLMs: their decoder layers are Qwen2's / Qwen3's
QWEN2_VL_TEXT = Family("qwen2_vl_text", smoothing=LLAMA_LIKE, gguf={"Qwen2VLForConditionalGeneration": QWEN2VL_GGUF})
QWEN2_5_VL_TEXT = Family("qwen2_5_vl_text", smoothing=LLAMA_LIKE,
                         gguf={"Qwen2_5_VLForConditionalGeneration": QWEN2VL_GGUF})
QWEN3_VL_TEXT = Family("qwen3_vl_text", smoothing=LLAMA_LIKE,
                       gguf={"Qwen3VLForConditionalGeneration": Gguf("QWEN3VL", add_qwen3vl_params, "qwen2",
                                                                     mrope=True)})

FAMILIES = (QWEN2, QWEN3, QWEN2_MOE, QWEN3_MOE, QWEN2_VL_TEXT, QWEN2_5_VL_TEXT, QWEN3_VL_TEXT)
