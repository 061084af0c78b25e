"""GPT-OSS (GptOssForCausalLM): every layer a mixture of experts stored fused across experts (`mlp.experts.
gate_up_proj` [experts, hidden, 2 x intermediate] with gate and up interleaved, their biases, `down_proj`), a
router with a bias (`mlp.router`), a clamped SwiGLU, attention sinks and alternating sliding-window layers.

Not supported yet by the llm-compressor methods and nf4, and refused by them before any work: llm-compressor
writes GPT-OSS's calibrated experts one Linear per expert projection (with biases), which transformers' GPT-OSS,
reading only the fused tensors, does not reload, and quantkit's reading of such experts does not know the
interleaved, clamped layout.

MLX: mlx-lm's gpt_oss, written as its sanitize leaves an already sanitized checkpoint (GPT_OSS_MLX): each fused
tensor cut into the SwitchGLU's projections `mlp.experts.{gate,up,down}_proj` ([experts, out, in], gate the even
columns of gate_up_proj and up the odd ones) with their biases split the same way; its sanitize cuts
gate_up_proj on the second-to-last axis, the layout of the MXFP4 blocks, not the 16-bit one, so quantkit writes the
cut form, which it leaves as it is. The routers stay 16-bit (entry false; mlx-lm's quant_predicate would take them
at 8 bits), the sinks as stored. Each expert's column importances are the inputs transformers' GptOssExperts gives
it (expert_inputs: its routed hidden states, and its clamped gate for down_proj). mlx-lm reads the YaRN RoPE from
`rope_scaling` (mlx_fields), but its YarnRoPE rounds the correction range to whole dimensions, which transformers
does only with `truncate: true`: a checkpoint with `truncate: false` (GPT-OSS's released config.json) is refused
(check_mlx_rope), as mlx-lm would rotate with other frequencies. A checkpoint stored in MXFP4 (`*_blocks`,
`*_scales`, quantization_config mxfp4) is refused by every method as already quantized.

No `name`: not a row of docs/models.md's tables; its prose states what is supported.
"""

from __future__ import annotations

from quantkit.arch.families.base import Family, FusedExperts, MlxExperts
from quantkit.errors import UnsupportedError

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


def expert_inputs(module, inputs: tuple) -> dict[str, list]:
    """Per expert, the rows its SwitchGLU projections take in transformers' GptOssExperts (its forward's inputs:
    hidden states [tokens, hidden], router indices [tokens, top-k]): the routed hidden states for gate and up, the
    clamped gated output (module._apply_gate of x @ gate_up_proj + bias) for down."""
    import torch

    hidden = inputs[0].detach().reshape(-1, inputs[0].shape[-1])
    indices = inputs[1].reshape(hidden.shape[0], -1)
    rows: dict[str, list] = {"gate_proj": [], "up_proj": [], "down_proj": []}
    with torch.no_grad():
        for e in range(module.gate_up_proj.shape[0]):
            x = hidden[(indices == e).any(-1)]
            gated = module._apply_gate(x @ module.gate_up_proj[e] + module.gate_up_proj_bias[e])
            rows["gate_proj"].append(x)
            rows["up_proj"].append(x)
            rows["down_proj"].append(gated)
    return rows


# mlx-lm's gpt_oss MLPBlock: its SwitchGLU is `experts` (gate_proj, up_proj, down_proj SwitchLinear, with biases)
GPT_OSS_MLX = MlxExperts(
    module="experts",
    fused=(FusedExperts("gate_up_proj", ("gate_proj", "up_proj"), "gate_up_proj_bias"),
           FusedExperts("down_proj", ("down_proj",), "down_proj_bias")),
    inputs=expert_inputs,
)

GPT_OSS = Family(
    "gpt_oss", "GptOssForCausalLM",
    mlx="gpt_oss", mlx_experts=GPT_OSS_MLX, mlx_fields=mlx_fields, mlx_checks=(check_mlx_rope,),
    moe_refusal="{method}: GPT-OSS (gpt_oss) is not supported yet: its experts are stored fused across experts "
                "(mlp.experts.gate_up_proj, gate and up interleaved, with biases), and the calibrated experts "
                "llm-compressor writes (one Linear per expert projection) are not a checkpoint transformers "
                "reloads or quantkit reads",
)

FAMILIES = (GPT_OSS,)
