"""GPT-OSS (GptOssForCausalLM): every layer a mixture of experts stored fused across experts (`mlp.experts.
gate_up_proj` [experts, hidden, 2 x intermediate] with gate and up interleaved on the last axis, `gate_up_proj_bias`
[experts, 2 x intermediate], `down_proj` [experts, intermediate, hidden], `down_proj_bias`), a router with a bias
(`mlp.router`), a clamped SwiGLU, attention sinks (`self_attn.sinks`, one per head) and alternating sliding-window
layers (`layer_types`: sliding first).

GGUF: llama.cpp conversion/gpt_oss.py's GptOssModel (architecture gpt-oss), for a checkpoint stored in 16 bits (a
fine-tuned one as transformers saves it). Keys: TextModel's (feed_forward_length = intermediate_size, YaRN as
stored) and the class's own, attention.sliding_window and expert_feed_forward_length. Tensors: gate_up_proj
transposed and de-interleaved into ffn_gate_exps (its even columns) and ffn_up_exps (its odd ones), [experts,
intermediate, hidden], its bias likewise into ffn_gate_exps.bias / ffn_up_exps.bias; down_proj transposed into
ffn_down_exps [experts, hidden, intermediate], down_proj_bias as ffn_down_exps.bias; the router as ffn_gate_inp
(weight and bias, F32 as the converter writes it); the sinks as attn_sinks.weight (filter_tensors' renaming).
Vocabulary: gpt2 (tokenizer.json). The gate's reading interleaves and transposes them back into transformers'
tensors; quantkit's imatrix takes the routed tokens and the clamped SwiGLU's output as llama-imatrix does
(quantkit.gguf.imatrix: transformers' experts say their layout, transposed and interleaved with biases).

Refused before work for GGUF: what llama.cpp's gpt-oss would run otherwise than transformers' GPT-OSS does (layers
whose layer_types are not sliding and full in turn, sliding first: llama.cpp takes that pattern whatever the
checkpoint says, since the converter writes no pattern; attention without biases, which llama.cpp requires), and a
checkpoint stored in MXFP4 (`*_blocks` / `*_scales` experts, as openai ships gpt-oss: quantkit.gguf.convert's
check_quantized names it, with the way to convert it).

nf4 quantizes its attention and keeps the fused experts and the router 16-bit, as transformers' bitsandbytes
integration (Linear layers only) leaves them; the report names the fused experts (`kept_fused_experts`).

The llm-compressor methods refuse it before any work: llm-compressor writes GPT-OSS's calibrated experts
one Linear per expert projection (with biases), which transformers' GPT-OSS, reading only the fused tensors, does
not reload, quantkit's reading of such experts does not know the interleaved, clamped layout, and vLLM 0.32's
GptOssModel.load_weights does not load them either: outside MXFP4 and Quark checkpoints it reads the experts as fused
w13/w2 tensors (whole, or `mlp.experts.<e>.w13_weight*` per expert) and passes over any other expert name
(`moe_refusal`).

MLX: mlx-lm's gpt_oss, written as its sanitize leaves an already sanitized checkpoint (GPT_OSS_MLX): each fused
tensor cut into the SwitchGLU's projections `mlp.experts.{gate,up,down}_proj` ([experts, out, in], gate the even
columns of gate_up_proj and up the odd ones) with their biases split the same way; its sanitize cuts
gate_up_proj on the second-to-last axis, the layout of the MXFP4 blocks, not the 16-bit one, so quantkit writes the
cut form, which it leaves as it is. The routers stay 16-bit (entry false; mlx-lm's quant_predicate would take them
at 8 bits), the sinks as stored. Each expert's column importances are the inputs transformers' GptOssExperts gives
it (quantkit.methods.mlx.routed_rows: its routed hidden states, and its clamped gate for down_proj). mlx-lm reads
the YaRN RoPE from `rope_scaling` (mlx_fields), but its YarnRoPE rounds the correction range to whole dimensions,
which transformers does only with `truncate: true`: a checkpoint with `truncate: false` (GPT-OSS's released
config.json) is refused (check_mlx_rope), as mlx-lm would rotate with other frequencies. A checkpoint stored in
MXFP4 (`*_blocks`, `*_scales`, quantization_config mxfp4) is refused by every method as already quantized.

No `name`: not a row of docs/models.md's tables; its prose states what converts and what is refused.
"""

from __future__ import annotations

import numpy as np

from quantkit.arch.families import text
from quantkit.arch.families.base import Family, FusedExperts, Gguf, MlxExperts, Pieces, TensorRule
from quantkit.errors import UnsupportedError

ARCH = "GptOssForCausalLM"

# ---------------------------------------------------------------- GGUF (GptOssModel)


def add_gpt_oss_params(writer, hp: dict, ftype: int) -> None:
    """GptOssModel.set_gguf_parameters: TextModel's keys, then the sliding window and the experts' width."""
    text.add_text_params(writer, hp, ftype)
    writer.add_sliding_window(hp["sliding_window"])
    writer.add_expert_feed_forward_length(hp["intermediate_size"])


def alternating_layer_types(n_layers: int) -> list[str]:
    """llama.cpp's gpt-oss window pattern (load_swa_pattern(ml, 2) without a pattern key): even layers sliding."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n_layers)]


def check_layer_types(arch: str, hp: dict) -> None:
    """llama.cpp's gpt-oss attends with the window in the even layers and to every position in the odd ones
    whatever the checkpoint's layer_types say (the converter writes only the window's size)."""
    kinds = hp.get("layer_types") or alternating_layer_types(hp["num_hidden_layers"])
    if list(kinds) != alternating_layer_types(hp["num_hidden_layers"]) or not hp.get("sliding_window"):
        raise UnsupportedError(f"GGUF conversion of {arch}: layer_types {kinds} with sliding_window "
                               f"{hp.get('sliding_window')} (llama.cpp's gpt-oss slides a window over the even layers "
                               "and attends to every position in the odd ones, whatever config.json says: it would "
                               "attend otherwise than transformers does)",
                               hint="supported: layer_types sliding_attention and full_attention in turn, sliding "
                                    "first, with a sliding_window, as openai's gpt-oss checkpoints have them")


def check_attention_bias(arch: str, hp: dict) -> None:
    """llama.cpp's gpt-oss requires the q/k/v/o biases (create_tensor without TENSOR_NOT_REQUIRED)."""
    if hp.get("attention_bias") is False:
        raise UnsupportedError(f"GGUF conversion of {arch}: attention_bias false (llama.cpp's gpt-oss requires "
                               "the attention biases and would not load the file)",
                               hint="supported: attention_bias true, as openai's gpt-oss checkpoints have it")


def gate_up_shapes(shape: tuple[int, ...], hp: dict) -> tuple[tuple[int, ...], ...]:
    """gate_up_proj [experts, hidden, 2 x intermediate] -> ffn_gate_exps and ffn_up_exps [experts, intermediate,
    hidden]; its bias [experts, 2 x intermediate] -> two [experts, intermediate]."""
    if len(shape) == 3:
        experts, hidden, both = shape
        return ((experts, both // 2, hidden),) * 2
    return ((*shape[:-1], shape[-1] // 2),) * 2


def deinterleave(values: np.ndarray, hp: dict) -> tuple[np.ndarray, np.ndarray]:
    """GptOssModel.modify_tensors: the weight transposed to [experts, 2 x intermediate, hidden], gate its even rows
    and up its odd ones; the bias' even and odd entries."""
    if values.ndim == 3:
        rows = values.swapaxes(-1, -2)
        return np.ascontiguousarray(rows[:, ::2, :]), np.ascontiguousarray(rows[:, 1::2, :])
    return np.ascontiguousarray(values[..., ::2]), np.ascontiguousarray(values[..., 1::2])


def interleave(parts: list[np.ndarray], hp: dict) -> np.ndarray:
    """`deinterleave` undone: gate and up in turn along the last axis of transformers' tensor."""
    gate, up = parts
    if gate.ndim == 3:
        gate, up = gate.swapaxes(-1, -2), up.swapaxes(-1, -2)
    return np.stack([gate, up], axis=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])


def gate_up_hf_shape(shapes: list[tuple[int, ...]], hp: dict) -> tuple[int, ...]:
    first = shapes[0]
    if len(first) == 3:
        experts, intermediate, hidden = first
        return experts, hidden, 2 * intermediate
    return (*first[:-1], 2 * first[-1])


GATE_UP = Pieces(gate_up_shapes, deinterleave, interleave, gate_up_hf_shape)


def transposed(data: np.ndarray, hp: dict, dtype: str) -> np.ndarray:
    """down_proj [experts, intermediate, hidden] -> ffn_down_exps [experts, hidden, intermediate]."""
    return np.ascontiguousarray(data.swapaxes(-1, -2))


def transposed_back(data: np.ndarray, hp: dict) -> np.ndarray:
    return np.ascontiguousarray(data.swapaxes(-1, -2))


def swapped_shape(shape: tuple[int, ...], hp: dict) -> tuple[int, ...]:
    return (*shape[:-2], shape[-1], shape[-2])


# GptOssModel's modify_tensors on the names the converter maps (transformers' model holds the same names, so the
# gate's reading finds each rule by its own tensor's name)
RULES = (
    TensorRule(r"\.self_attn\.sinks$", rename=(r"\.sinks$", ".sinks.weight")),  # filter_tensors
    TensorRule(r"\.mlp\.experts\.gate_up_proj$", pieces=GATE_UP,
               split=((r"\.gate_up_proj$", ".gate_proj.weight"), (r"\.gate_up_proj$", ".up_proj.weight"))),
    TensorRule(r"\.mlp\.experts\.gate_up_proj_bias$", pieces=GATE_UP,
               split=((r"\.gate_up_proj_bias$", ".gate_proj.bias"), (r"\.gate_up_proj_bias$", ".up_proj.bias"))),
    TensorRule(r"\.mlp\.experts\.down_proj$", rename=(r"\.down_proj$", ".down_proj.weight"), forward=transposed,
               inverse=transposed_back, shape=swapped_shape, hf_shape=swapped_shape),
    TensorRule(r"\.mlp\.experts\.down_proj_bias$", rename=(r"\.down_proj_bias$", ".down_proj.bias")),
)

GPT_OSS_GGUF = Gguf("GPT_OSS", add_gpt_oss_params, "gpt2", experts="stacked", windowed=True,
                    rope_types=("default", "yarn"), checks=(check_layer_types, check_attention_bias), rules=RULES,
                    own_names=True)  # the router is mlp.router, not the Llama-style decoder's mlp.gate

# ---------------------------------------------------------------- MLX (mlx-lm gpt_oss)

YARN_KEYS = {"rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "truncate"}  # the YaRN parameters mlx-lm's YarnRoPE reads as transformers does (truncate: checked)


def rope(config: dict) -> dict:
    return config.get("rope_parameters") or {}


def mlx_fields(config: dict) -> dict:
    """mlx-lm's gpt_oss reads a YaRN RoPE from `rope_scaling` (transformers 5 keeps it in rope_parameters)."""
    found = rope(config)
    if found.get("rope_type") != "yarn":
        return {}
    return {"rope_scaling": {k: v for k, v in found.items() if k != "rope_theta"} | {"type": "yarn"}}


def check_mlx_rope(config: dict) -> None:
    """mlx-lm's YarnRoPE floors and ceils the correction range (transformers: only with truncate true) and reads no
    attention_factor or mscale: anything else would rotate with other frequencies or scales than transformers."""
    found = rope(config)
    kind = found.get("rope_type", "default")
    if kind == "default":
        return
    if kind != "yarn":
        raise UnsupportedError(f"mlx: RoPE type '{kind}': quantkit writes mlx-lm's gpt_oss the default or YaRN RoPE "
                               "only", hint="use --method gguf")
    if extra := sorted(set(found) - YARN_KEYS):
        raise UnsupportedError(f"mlx: YaRN RoPE with {', '.join(extra)}: mlx-lm 0.32's gpt_oss does not read them "
                               "as transformers does", hint="use --method gguf")
    if not found.get("truncate", True):
        raise UnsupportedError(
            "mlx: the YaRN RoPE has truncate false (GPT-OSS's released config.json): mlx-lm 0.32's YarnRoPE always "
            "rounds the correction range to whole dimensions (floor, ceil), which transformers does only with "
            "truncate true, so mlx-lm's rotary frequencies would differ from the model's",
            hint="use --method gguf; or, to accept mlx-lm's rounded range as the model, set rope_parameters.truncate "
                 "to true in a copy of the checkpoint (the gate then measures the change)")


# mlx-lm's gpt_oss MLPBlock: its SwitchGLU is `experts` (gate_proj, up_proj, down_proj SwitchLinear, with biases)
GPT_OSS_MLX = MlxExperts(
    module="experts",
    fused=(FusedExperts("experts.gate_up_proj", ("gate_proj", "up_proj"), "experts.gate_up_proj_bias"),
           FusedExperts("experts.down_proj", ("down_proj",), "experts.down_proj_bias")),
)

GPT_OSS = Family(
    "gpt_oss", ARCH,
    gguf={ARCH: GPT_OSS_GGUF},
    mlx="gpt_oss", mlx_experts=GPT_OSS_MLX, mlx_fields=mlx_fields, mlx_checks=(check_mlx_rope,),
    moe_refusal="{method}: GPT-OSS (gpt_oss) is not supported yet: its experts are stored fused across experts "
                "(mlp.experts.gate_up_proj, gate and up interleaved, with biases), and the calibrated experts "
                "llm-compressor writes (one Linear per expert projection) are not a checkpoint transformers "
                "reloads or quantkit reads, nor one vLLM 0.32's gpt_oss loads (it reads experts only as fused "
                "w13/w2 tensors, whole or per expert, and passes over experts.N.gate_proj.* names); --method gguf "
                "converts it as llama.cpp's converter does, --method mlx as mlx-lm's gpt_oss holds it",
)

FAMILIES = (GPT_OSS,)
