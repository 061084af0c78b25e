"""Granite 4 hybrid (GraniteMoeHybridForCausalLM): Mamba-2 layers beside attention layers (`layer_types`), a
shared MLP in every layer (`shared_mlp.input_linear` = gate and up fused, `output_linear` = down), Granite's
multipliers (embedding, residual, attention scale, logits divisor), and, with num_local_experts > 0, routed
experts stored fused across experts (`block_sparse_moe.input_linear` [experts, 2 x intermediate, hidden],
`output_linear`, the router `block_sparse_moe.router.layer`).

What stays 16-bit: the Mamba-2 state parameters (A_log, D, dt_bias), the depthwise conv1d and the gated norm
are no linear layers: llm-compressor quantizes only nn.Linear, vLLM's MambaMixer2 builds its conv1d without a
quantization config and keeps A, D, dt_bias and the norm in float, llama.cpp's converter writes them F32 and
llama-quantize never quantizes them (ssm_conv1d, ssm_a, ssm_d, ssm_dt, ssm_norm). The Mamba in_proj / out_proj
are linear layers every consumer takes quantized (vLLM's MambaMixer2 passes its quant_config to both;
llama.cpp quantizes ssm_in / ssm_out; mlx-lm's quantizer converts every Linear): they are quantized.

GGUF: llama.cpp conversion/granite.py's GraniteHybridModel (on Mamba2Model and GraniteMoeModel). It reads
config.json itself (Mamba2Model.__init__, not AutoConfig), so its `layer_types` are the stored names: only
"attention" is an attention layer, every other layer is converted as a Mamba layer. Keys: TextModel's with
head_dim dropped (GraniteModel), vocab_size and the RoPE dimension count (LlamaModel), the four multipliers as
attention.scale / embedding_scale / residual_scale / logit_scale, the shared MLP's feed-forward length, the
ssm.* sizes (conv kernel, state size, group count, inner size = mamba_expand x hidden, time-step rank = Mamba
heads), head_count_kv per layer (0 for Mamba layers), rope.scaling.finetuned = false and a 2^20 context for a
hybrid (llama.cpp applies no RoPE to it). Tensors: A = -exp(A_log) and D as [heads, 1], conv1d squeezed to
[channels, kernel], dt_bias as ssm_dt.bias, the gated norm as [groups, inner / groups], q/k permuted as
LlamaModel does, the shared MLP's input_linear split into ffn_gate and ffn_up and its output_linear written
as ffn_down. Vocabulary: gpt2 (tokenizer.json).

The MoE variant (Granite 4.0 H-Tiny / H-Small) converts as GraniteMoeModel.modify_tensors writes it: the routed
experts, stored fused across experts, split along their rows (block_sparse_moe.input_linear [experts, 2 x
intermediate, hidden] into ffn_gate_exps and ffn_up_exps; output_linear is ffn_down_exps), the router
block_sparse_moe.router.layer as ffn_gate_inp, and the shared MLP as the shared expert (ffn_gate_shexp /
ffn_up_shexp / ffn_down_shexp). Its keys are the dense variant's: TextModel writes num_local_experts as
expert_count, num_experts_per_tok as expert_used_count and intermediate_size (the experts' width) as
feed_forward_length; shared_intermediate_size is the shared expert's length. A model that routes to more experts
than it has is refused (llama.cpp would not load it). The gate reads the file back into transformers' names of the
same tensors (its conversion mapping renames them while loading: experts.gate_up_proj = gate then up per expert,
experts.down_proj, router.weight).

MLX: mlx-lm's granitemoehybrid. The MoE variant's experts are written as its sanitize leaves them (GRANITE_MOE_MLX):
block_sparse_moe.input_linear cut into the SwitchGLU's switch_mlp.gate_proj (each expert's first half of rows) and
up_proj, output_linear as switch_mlp.down_proj, each expert quantized on its own with the column importances of the
tokens routed to it (recorded on transformers' GraniteMoeHybridExperts); the router (router.layer) stays
16-bit, and the shared MLP is quantized, as that model holds it under the stored names. The dense variant's shared
MLP stays 16-bit in MLX: its sanitize splits and renames it without the quantization scales.

The llm-compressor methods take the MoE variant as every MoE family (GRANITE_MOE: quantkit.arch.moe): llm-compressor
linearizes transformers' GraniteMoeHybridExperts into one Linear per expert projection, calibrates every expert on
every token, and the artifact stores them as vLLM's granitemoehybrid loads quantized experts
(`block_sparse_moe.experts.<e>.{gate,up,down}_proj`, its get_expert_mapping), the router saved back as
block_sparse_moe.router.layer (16-bit: a parameter, no Linear). transformers cannot reload per-expert Granite
experts (its loading only renames the fused tensors), so the gate reads the artifact itself, with linear experts
(quantkit.eval.experts). Granite's router returns the top-k indices first (`router_indices`). The dense hybrids
route to no expert (num_local_experts 0): no layout applies to them (quantkit.arch.moe.moe_layout). nf4 leaves the
fused experts in bf16 (bitsandbytes quantizes Linear modules only).
"""

from __future__ import annotations

import numpy as np

from quantkit.arch.families import text
from quantkit.arch.families.base import Family, FusedExperts, Gguf, Kept, Mapping, MlxExperts, MoeLayout, TensorRule
from quantkit.errors import UnsupportedError

# ---------------------------------------------------------------- what stays 16-bit and why


def is_dense(config: dict) -> bool:
    """The dense Granite 4 hybrids (num_local_experts 0), not the MoE variant."""
    return not (config.get("num_local_experts") or 0)


KEPT = (
    # no linear layers (llm-compressor and mlx-lm quantize Linear only): vLLM's MambaMixer2 builds its conv1d
    # unquantized and keeps A, D, dt_bias and the norm float; llama.cpp keeps ssm_a/ssm_d/ssm_dt/ssm_conv1d/ssm_norm F32
    Kept(r"re:.*\.mamba(\.conv1d|\.norm)?$", "Mamba-2 state (A_log, D, dt_bias), conv1d and gated norm 16-bit"),
    # mlx-lm's sanitize renames a dense checkpoint's shared MLP (input_linear split into mlp.gate_proj /
    # up_proj, output_linear to mlp.down_proj) without its quantization scales: quantized, it cannot load
    Kept(r"re:.*\.shared_mlp\.(input|output)_linear$", "shared MLP in MLX: mlx-lm's granitemoehybrid sanitize "
         "splits and renames input_linear / output_linear without their scales, so quantized ones do not load",
         methods=("mlx",), when=is_dense),
)

# ---------------------------------------------------------------- smoothing rows

# every layer: the post-attention norm feeds the shared MLP's fused gate/up (input_linear) and, in the MoE variant,
# the router and every expert too (the router is no Linear, so its input cannot be balanced: the row holds only in
# the dense hybrids); attention layers: v feeds o. No row for a layer's input norm: it feeds q/k/v in attention
# layers and in_proj in Mamba layers, and the layer names do not say which (llm-compressor resolves a row's smooth layer by regex across the model:
# "must match a single smooth layer"), so those inputs are not smoothed. No up -> down row: up is fused with
# gate in input_linear (the SiLU gate's half cannot be scaled with it)
GRANITE_HYBRID_ROWS = (
    Mapping("re:.*v_proj$", ("re:.*o_proj$",), smoothquant=False),
    Mapping("re:.*post_attention_layernorm$", ("re:.*shared_mlp.input_linear$",), smoothquant=True, when=is_dense),
)

# ---------------------------------------------------------------- GGUF (GraniteHybridModel)

PREFIXES = ("mamba",)  # GraniteHybridModel.hparam_prefixes


def find_prefixed(hp: dict, keys: tuple[str, ...]):
    """GraniteHybridModel.find_hparam: the keys, then each with the `mamba_` prefix."""
    return text.find(hp, (*keys, *(f"{p}_{k}" for p in PREFIXES for k in keys)))


def attention_layers(hp: dict) -> list[int]:
    """GraniteHybridModel.get_attn_layers: the layers config.json's layer_types names "attention"."""
    return [i for i, kind in enumerate(hp.get("layer_types") or []) if kind == "attention"]


def ssm_layers(hp: dict) -> list[int]:
    attention = attention_layers(hp)
    return [i for i in range(hp["num_hidden_layers"]) if i not in attention]


def d_inner(hp: dict) -> int:
    """GraniteHybridModel's d_inner: (expand or num_heads) x (mamba_head_dim or hidden_size)."""
    return find_prefixed(hp, ("expand", "num_heads")) * find_prefixed(hp, ("mamba_head_dim", "hidden_size", "d_model"))


def n_group(hp: dict) -> int:
    return find_prefixed(hp, ("n_groups", "num_groups"))


def add_granite_hybrid_params(writer, hp: dict, ftype: int) -> None:
    """GraniteHybridModel.set_gguf_parameters: GraniteMoeModel's (LlamaModel's without head_dim, the
    multipliers, the shared MLP's length), then the Mamba-2 sizes and the per-layer key/value heads."""
    hp = {k: v for k, v in hp.items() if k != "head_dim"}  # GraniteModel pops it
    text.add_text_params(writer, hp, ftype)
    writer.add_vocab_size(hp["vocab_size"])
    writer.add_rope_dimension_count(hp["hidden_size"] // hp["num_attention_heads"])
    for key, add in (("attention_multiplier", writer.add_attention_scale),
                     ("embedding_multiplier", writer.add_embedding_scale),
                     ("residual_multiplier", writer.add_residual_scale),
                     ("logits_scaling", writer.add_logit_scale),
                     ("shared_intermediate_size", writer.add_expert_shared_feed_forward_length)):
        if hp.get(key):
            add(hp[key])
    writer.add_ssm_conv_kernel(find_prefixed(hp, ("conv_kernel", "d_conv")))
    writer.add_ssm_state_size(find_prefixed(hp, ("state_size", "d_state", "state_dim", "ssm_state_size")))
    writer.add_ssm_group_count(n_group(hp))
    writer.add_ssm_inner_size(d_inner(hp))
    writer.add_ssm_time_step_rank(find_prefixed(hp, ("n_heads", "num_heads")))
    if rope_dim := hp.get("attn_rotary_emb"):
        writer.add_rope_dimension_count(rope_dim)
    writer.add_head_count_kv(layer_kv_heads(hp))
    use_rope = not ssm_layers(hp)
    writer.add_rope_scaling_finetuned(use_rope)
    if not use_rope:
        writer.add_context_length(2**20)


def layer_kv_heads(hp: dict) -> list[int]:
    """head_count_kv per layer: the key/value heads in attention layers, 0 in Mamba layers."""
    attention, kv_heads = attention_layers(hp), find_prefixed(hp, ("num_key_value_heads", "n_head_kv"))
    return [kv_heads if i in attention else 0 for i in range(hp["num_hidden_layers"])]


LAYER_KINDS = ("mamba", "attention")


def check_layer_types(arch: str, hp: dict) -> None:
    """The converter reads layer_types from config.json and takes only "attention" for an attention layer:
    the names transformers 5 saves ("linear_attention", "full_attention") would make every layer a Mamba
    layer, a file llama.cpp cannot load."""
    kinds = hp.get("layer_types")
    if not kinds or len(kinds) != hp["num_hidden_layers"] or set(kinds) - set(LAYER_KINDS):
        raise UnsupportedError(
            f"GGUF conversion of {arch}: config.json's layer_types {kinds} (llama.cpp's converter reads them from "
            "config.json and knows only \"mamba\" and \"attention\", one per layer)",
            hint="write layer_types in config.json as IBM's Granite 4 checkpoints have them: \"mamba\" for "
                 "\"linear_attention\", \"attention\" for \"full_attention\"")


def check_hybrid_rope(arch: str, hp: dict) -> None:
    """A hybrid is converted without RoPE (rope.scaling.finetuned = false): one that uses it would change."""
    if ssm_layers(hp) and hp.get("position_embedding_type") == "rope":
        raise UnsupportedError(f"GGUF conversion of {arch}: position_embedding_type = \"rope\" in a hybrid model "
                               "(llama.cpp's converter marks every hybrid Granite as without RoPE)",
                               hint="Granite 4 hybrid checkpoints use \"nope\"")


def check_mamba_shape(arch: str, hp: dict) -> None:
    """GraniteHybridModel's validation (silu, d_inner a multiple of the Mamba head size) and Mamba2Model's
    vocabulary padding, which quantkit does not reproduce."""
    head = find_prefixed(hp, ("d_head",)) or 64
    if hp.get("hidden_act") not in (None, "silu") or d_inner(hp) % head:
        raise UnsupportedError(f"GGUF conversion of {arch}: hidden_act {hp.get('hidden_act')!r}, Mamba inner size "
                               f"{d_inner(hp)} with heads of {head} (llama.cpp's converter takes silu and an inner "
                               "size that is a multiple of the head size)", hint="Granite 4 checkpoints have both")
    if ssm_layers(hp) and hp["vocab_size"] % 8:
        raise UnsupportedError(f"GGUF conversion of {arch}: vocab_size {hp['vocab_size']} is not a multiple of 8 "
                               "(llama.cpp's converter pads a hybrid's vocabulary to one; quantkit does not)",
                               hint="Granite 4 checkpoints have a vocabulary of 100352")


def check_experts(arch: str, hp: dict) -> None:
    """The converter writes num_experts_per_tok as expert_used_count and num_local_experts as expert_count, and
    llama.cpp refuses to load a file that uses more experts than it has (GGML_ASSERT n_expert_used_max <=
    n_expert): a dense model must route to no expert, an MoE one to at most its experts."""
    experts, used = hp.get("num_local_experts") or 0, hp.get("num_experts_per_tok") or 0
    if used > experts:
        what = "no experts" if not experts else f"num_local_experts = {experts}"
        raise UnsupportedError(f"GGUF conversion of {arch}: num_experts_per_tok = {used} with {what} (llama.cpp's "
                               "converter writes them as expert_used_count and expert_count, and llama.cpp refuses "
                               "to load a file that uses more experts than it has)",
                               hint="set num_experts_per_tok to 0 in config.json for a dense model, as IBM's dense "
                                    "Granite 4 checkpoints have it, or to at most num_local_experts")


def minus_exp(data: np.ndarray, hp: dict, dtype: str) -> np.ndarray:
    """Mamba2Model.modify_tensors: A = -exp(A_log) as [heads, 1], computed by torch as the converter does
    (float32 for bf16 / f32 sources, float16 for f16 ones)."""
    import torch

    values = torch.from_numpy(np.ascontiguousarray(data))
    values = values.to(torch.float16) if dtype == "F16" else values
    return (-torch.exp(values)).to(torch.float32).numpy().reshape(-1, 1)


def log_minus(data: np.ndarray, hp: dict) -> np.ndarray:
    return np.log(-data.astype(np.float32)).reshape(-1)


def column(shape: tuple[int, ...], hp: dict) -> tuple[int, ...]:
    return (*shape, 1)


def flat(shape: tuple[int, ...], hp: dict) -> tuple[int, ...]:
    return (int(np.prod(shape)),)


def squeeze_shape(shape: tuple[int, ...], hp: dict) -> tuple[int, ...]:
    return tuple(d for d in shape if d != 1)


def conv_shape(shape: tuple[int, ...], hp: dict) -> tuple[int, ...]:
    return (shape[0], 1, shape[1])


def grouped(shape: tuple[int, ...], hp: dict) -> tuple[int, ...]:
    return (n_group(hp), d_inner(hp) // n_group(hp))


def reshaped(shape_of):
    """A forward that only reshapes (the values written as they are)."""
    def forward(data: np.ndarray, hp: dict, dtype: str) -> np.ndarray:
        return data.reshape(shape_of(data.shape, hp))
    return forward


def unshaped(shape_of):
    def inverse(data: np.ndarray, hp: dict) -> np.ndarray:
        return data.reshape(shape_of(data.shape, hp))
    return inverse


def dense(hp: dict) -> bool:
    return not hp.get("num_local_experts")


def moe(hp: dict) -> bool:
    return not dense(hp)


def layer_tensor(kind: str) -> tuple[str, str]:
    """(regex, replacement) naming a layer's tensor as GraniteMoeModel.modify_tensors does
    (format_tensor_name(kind, bid): `blk.<layer>.<kind>.weight`, which TensorNameMap maps to itself)."""
    return r"^model\.layers\.(\d+)\..*$", rf"blk.\1.{kind}.weight"


# the routed experts (GraniteMoeModel.modify_tensors): input_linear [experts, 2 x intermediate, hidden] split along
# its rows into ffn_gate_exps / ffn_up_exps, output_linear (ffn_down_exps) and the router (ffn_gate_inp) mapped by
# TensorNameMap as stored. The patterns also match transformers' names of the same tensors (its conversion mapping
# renames them while loading: experts.gate_up_proj, experts.down_proj, router.weight): the gate reads the file back
# into them
EXPERT_RULES = (
    TensorRule(r"\.block_sparse_moe\.(input_linear\.weight|experts\.gate_up_proj)$", when=moe,
               split=(layer_tensor("ffn_gate_exps"), layer_tensor("ffn_up_exps"))),
    TensorRule(r"\.block_sparse_moe\.experts\.down_proj$", when=moe,
               rename=(r"\.experts\.down_proj$", ".output_linear.weight")),
    TensorRule(r"\.block_sparse_moe\.router\.weight$", when=moe, rename=(r"\.router\.weight$", ".router.layer.weight")),
    # beside experts the shared MLP is the shared expert: input_linear split into ffn_gate_shexp / ffn_up_shexp,
    # output_linear mapped by TensorNameMap (ffn_down_shexp)
    TensorRule(r"\.shared_mlp\.input_linear\.weight$", when=moe,
               split=(layer_tensor("ffn_gate_shexp"), layer_tensor("ffn_up_shexp"))),
)

GRANITE_HYBRID_RULES = (
    TensorRule(r"\.mamba\.A_log$", forward=minus_exp, inverse=log_minus, shape=column, hf_shape=flat),
    TensorRule(r"\.mamba\.D$", forward=reshaped(column), inverse=unshaped(flat), shape=column, hf_shape=flat),
    TensorRule(r"\.mamba\.conv1d\.weight$", forward=reshaped(squeeze_shape), inverse=unshaped(conv_shape),
               shape=squeeze_shape, hf_shape=conv_shape),
    TensorRule(r"\.mamba\.dt_bias$", rename=(r"\.dt_bias$", ".dt_proj.bias")),  # Mamba2Model.filter_tensors
    TensorRule(r"\.mamba\.norm\.weight$", forward=reshaped(grouped), inverse=unshaped(flat), shape=grouped,
               hf_shape=flat),
    # GraniteMoeModel.modify_tensors without experts: the shared MLP is the layer's MLP
    TensorRule(r"\.shared_mlp\.input_linear\.weight$", when=dense,
               split=((r"\.shared_mlp\.input_linear\.", ".mlp.gate_proj."),
                      (r"\.shared_mlp\.input_linear\.", ".mlp.up_proj."))),
    TensorRule(r"\.shared_mlp\.output_linear\.weight$", when=dense,
               rename=(r"\.shared_mlp\.output_linear\.", ".mlp.down_proj.")),
    *EXPERT_RULES,
)

GRANITE_HYBRID_GGUF = Gguf("GRANITE_HYBRID", add_granite_hybrid_params, "gpt2", permute_qk=True, experts="stacked",
                           rope_types=("default",),
                           checks=(check_experts, check_layer_types, check_hybrid_rope, check_mamba_shape),
                           rules=GRANITE_HYBRID_RULES, raw_config=True, layer_kv_heads=layer_kv_heads)

# ---------------------------------------------------------------- the MoE variant

# the llm-compressor methods' experts: the router block_sparse_moe.router (indices first in its output); the linear
# experts' names are the ones vLLM's get_expert_mapping loads (gate_proj, up_proj, down_proj)
GRANITE_MOE = MoeLayout(router=r".*\.block_sparse_moe\.router$", router_indices=0)


# mlx-lm's granitemoehybrid GraniteMoeHybridMoE: its SwitchGLU is block_sparse_moe.switch_mlp, cut by its sanitize
# from input_linear (gate rows, then up rows) and output_linear; its router block_sparse_moe.router.layer as stored
GRANITE_MOE_MLX = MlxExperts(
    module="block_sparse_moe.switch_mlp",
    fused=(FusedExperts("block_sparse_moe.input_linear.weight", ("gate_proj", "up_proj"), layout="rows"),
           FusedExperts("block_sparse_moe.output_linear.weight", ("down_proj",), layout="rows")),
)


SMOOTHQUANT_REFUSAL = ("in Granite 4's MoE variant the post-attention norm feeds the router too, a parameter and no "
                       "Linear whose input could be balanced, and the input norm feeds q/k/v in attention layers and "
                       "in_proj in Mamba layers under the same name")

GRANITE_HYBRID = Family(
    "granitemoehybrid", "GraniteMoeHybridForCausalLM", "Granite 4 (hybrid, and its MoE variant)",
    kept=KEPT,
    smoothing=GRANITE_HYBRID_ROWS,
    gguf={"GraniteMoeHybridForCausalLM": GRANITE_HYBRID_GGUF},
    mlx="granitemoehybrid", mlx_experts=GRANITE_MOE_MLX,
    moe=GRANITE_MOE,
    smoothquant_refusal=SMOOTHQUANT_REFUSAL,
)

FAMILIES = (GRANITE_HYBRID,)
