"""Llama 4's text model (Llama4ForCausalLM, model_type llama4_text): routed experts stored fused across experts
(`feed_forward.experts.gate_up_proj` [experts, hidden, 2 x intermediate], gate then up along the last axis;
`down_proj` [experts, intermediate, hidden]) beside a shared expert (`feed_forward.shared_expert`, intermediate_size
wide), the router `feed_forward.router` (top-k of its logits, each chosen expert's input scaled by the sigmoid of
its logit), mixture-of-experts layers every `interleave_moe_layer_step`-th layer (the others a dense MLP
intermediate_size_mlp wide), chunked attention and NoPE layers (no_rope_layers, layer_types), queries and keys
L2-normalized after RoPE (use_qk_norm), and the NoPE layers' queries scaled with the position (attention temperature
tuning: floor_scale, attn_scale).

GGUF: llama.cpp conversion/llama.py's Llama4Model (architecture llama4), for a checkpoint stored in 16 bits. Keys:
LlamaModel's with intermediate_size and intermediate_size_mlp swapped (feed_forward_length is the dense layers'
width), interleave_moe_layer_step and expert_feed_forward_length (intermediate_size). Tensors: gate_up_proj
transposed and cut in halves into ffn_gate_exps (the first) and ffn_up_exps, [experts, intermediate, hidden];
down_proj transposed into ffn_down_exps; the router as ffn_gate_inp (F32 as the converter writes it), the shared
expert as ffn_*_shexp; no q/k permutation (llama.cpp's llama4 rotates adjacent pairs, as transformers' does); a
llama3 RoPE's factors as rope_freqs. Vocabulary: gpt2 (tokenizer.json). The gate's reading joins and transposes the
experts back into transformers' tensors; quantkit's imatrix takes each expert's routed rows as llama-imatrix does
(expert_imatrix_inputs).

llama.cpp's llama4 fixes what transformers reads from config.json: RoPE skipped in every fourth layer
(n_no_rope_layer_step 4), attention in chunks of 8192 positions in the three others and over every position in the
fourth (its window pattern 4; the converter writes no pattern), the NoPE layers' queries scaled by log(floor((pos +
1) / 8192) + 1) x 0.1 + 1, queries and keys normalized unless the model has 128 experts, the router's sigmoid, no
attention output bias. A checkpoint whose no_rope_layers, layer_types, moe_layers, attention_chunk_size,
attn_temperature_tuning, floor_scale, attn_scale, use_qk_norm, attention_bias or hidden_act say otherwise is refused
before work (check_llama_cpp), naming the key and what llama.cpp does; every layer full_attention included (the
converter then writes sliding_window 0, and llama.cpp skips RoPE in the last layer only).

MLX: mlx-lm's llama4 (the VLM's model, whose text model loads alone): config.json nesting the checkpoint's as
text_config (model_type llama4), every tensor under `language_model.`, the fused experts cut into its SwitchGLU's
projections `feed_forward.experts.{gate,up,down}_proj` ([experts, out, in]), as its sanitize cuts them; the routers
16-bit (entry false). Each expert's column importances are the rows transformers' Llama4TextExperts gives it
(expert_rows). mlx-lm's llama4 fixes the same every-fourth-layer pattern (RoPE and chunks), takes one expert per
token and has its own output head: a checkpoint that would compute otherwise is refused before work (check_mlx), as
is a RoPE other than the default or llama3's. It L2-normalizes queries and keys with eps 1e-6 (mx.fast.rms_norm) where
transformers takes rms_norm_eps (1e-5 in Llama 4 Scout's config.json): accepted, as the difference is small (on
the tiny test model, mean relative logit difference 1.4e-5 with eps 1e-5 against 1.4e-6 with
1e-6).

nf4 writes each expert's projections as a 4-bit Linear of their own (quantkit.methods.nf4.split_experts), as
transformers' bitsandbytes reload builds Llama 4's experts (SequentialLlama4TextExperts), cut from the fused
tensors as LLAMA4_MLX.fused says; the routers stay 16-bit.

The llm-compressor methods (fp8, gptq, autoround, nvfp4, mxfp4) take the text checkpoint (LLAMA4_MOE): quantkit
builds llm-compressor's Llama4LinearExperts itself (quantkit.arch.moe.linearize; its class reads the multimodal
config's text_config, which oneshot's linearization cannot give a text model), so every expert's gate, up and down
is a Linear calibrated on the tokens routed to it (the router scales each expert's input by its sigmoid score, so
the others see zeros), written as `feed_forward.experts.<e>.<projection>`: the names vLLM's llama4 maps into its
fused experts and transformers' reload builds as SequentialLlama4TextExperts (it reloads the artifact strictly;
the gate reads it as llm-compressor's linear experts, equal to that reload). The router returns (scores, logits):
its routed-token counts are the top-k of the logits. The routers stay 16-bit. AWQ and SmoothQuant smooth by
LLAMA4_ROWS: the MLP norm's row balances the router with the experts in the MoE layers and the dense MLP in the
others, one row each (Mapping.layers); SmoothQuant leaves that norm out. The multimodal Llama4ForConditionalGeneration stays refused by these methods and nf4 (MoeLayout.vlm
false: its calibration fails llm-compressor's tracing of the multimodal forward).

No `name`: not a row of docs/models.md's tables; its prose states what converts and what is refused.
"""

from __future__ import annotations

import re

from quantkit.arch.families import llama
from quantkit.arch.families.base import (
    Family,
    FusedExperts,
    Gguf,
    Mapping,
    MlxExperts,
    MlxLayout,
    MoeLayout,
    TensorRule,
)
from quantkit.arch.families.gpt_oss import swapped_shape, transposed, transposed_back
from quantkit.errors import UnsupportedError

ARCH = "Llama4ForCausalLM"
# what llama.cpp's llama4 (load_arch_hparams, its graph) and mlx-lm's llama4 fix whatever config.json says
NOPE_STEP = 4  # RoPE skipped, and attention over every position, in every fourth layer
CHUNK = 8192  # llama.cpp's n_swa for the chunked layers
TEMPERATURE = {"attn_temperature_tuning": True, "floor_scale": 8192, "attn_scale": 0.1}  # llama.cpp's attn_temp
TEMPERATURE_TEXT = "scales the NoPE layers' queries by log(floor((pos + 1) / 8192) + 1) x 0.1 + 1"
ROPE_TYPES = ("default", "llama3")

# ---------------------------------------------------------------- transformers' Llama4TextConfig


def rope_layers(hp: dict) -> list[int]:
    """Llama4TextConfig's no_rope_layers (1: RoPE, 0: NoPE), one per layer: as stored, else NoPE every
    no_rope_layer_interval-th layer."""
    n, interval = hp["num_hidden_layers"], hp.get("no_rope_layer_interval") or 4
    return [int(v) for v in (hp.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(n)])[:n]]


def layer_kinds(hp: dict) -> list[str]:
    """Llama4TextConfig's layer_types: as stored, else chunked attention where a layer has RoPE, full elsewhere."""
    stored = hp.get("layer_types")
    return list(stored) if stored else ["chunked_attention" if r else "full_attention" for r in rope_layers(hp)]


def moe_layers(hp: dict) -> list[int]:
    """Llama4TextConfig's moe_layers: as stored, else every interleave_moe_layer_step-th layer."""
    step = hp.get("interleave_moe_layer_step") or 1
    stored = hp.get("moe_layers")
    return list(stored) if stored is not None else list(range(step - 1, hp["num_hidden_layers"], step))


def fourth_layer_rope(n_layers: int) -> list[int]:
    """llama.cpp's and mlx-lm's RoPE layers: all but every fourth."""
    return [int((i + 1) % NOPE_STEP != 0) for i in range(n_layers)]


def fourth_layer_kinds(n_layers: int) -> list[str]:
    """llama.cpp's (window pattern 4, chunked first) and mlx-lm's attention: chunked but every fourth layer."""
    return ["chunked_attention" if r else "full_attention" for r in fourth_layer_rope(n_layers)]


def stepped_moe_layers(hp: dict) -> list[int]:
    """llama.cpp's and mlx-lm's mixture-of-experts layers: (i + 1) % interleave_moe_layer_step == 0."""
    step = hp.get("interleave_moe_layer_step") or 1
    return [i for i in range(hp["num_hidden_layers"]) if (i + 1) % step == 0]


def uses_qk_norm(hp: dict) -> bool:
    return bool(hp.get("use_qk_norm", True))


def fixed_pattern(hp: dict) -> list[tuple[str, object, str]]:
    """(config key, its value, what llama.cpp's and mlx-lm's llama4 do instead) where the checkpoint's layer pattern
    differs from the one both fix (RoPE, chunks and experts by the layer's index)."""
    n, found = hp["num_hidden_layers"], []
    rope, kinds, experts = fourth_layer_rope(n), fourth_layer_kinds(n), stepped_moe_layers(hp)
    if rope_layers(hp) != rope:
        found.append(("no_rope_layers", rope_layers(hp), f"skips RoPE in every fourth layer alone: {rope}"))
    if layer_kinds(hp) != kinds:
        found.append(("layer_types", layer_kinds(hp), f"attends in chunks in every layer but every fourth: {kinds}"))
    if moe_layers(hp) != experts:
        stepped = f"puts experts in every interleave_moe_layer_step-th layer: {experts}"
        found.append(("moe_layers", moe_layers(hp), stepped))
    if (act := hp.get("hidden_act", "silu")) != "silu":
        found.append(("hidden_act", act, "gates its MLPs with SiLU"))
    return found


def refuse(what: str, key: str, value, instead: str, engine: str, hint: str) -> None:
    raise UnsupportedError(f"{what}: {key} {value} ({engine} {instead}, whatever config.json says: it would compute "
                           "otherwise than transformers does)", hint=hint)


# ---------------------------------------------------------------- GGUF (Llama4Model)

GGUF_HINT = ("supported: the layout and attention of Meta's Llama 4 checkpoints (their config.json values for these "
             "keys), which llama.cpp's llama4 runs as transformers does")


def add_llama4_params(writer, hp: dict, ftype: int) -> None:
    """Llama4Model.set_gguf_parameters: LlamaModel's with intermediate_size and intermediate_size_mlp swapped (its
    __init__), then the MoE layers' step and the experts' width. (Its sliding_window 0 for every layer
    full_attention is never written: check_llama_cpp refuses those.)"""
    llama.add_llama_params(writer, {**hp, "intermediate_size": hp["intermediate_size_mlp"]}, ftype)
    writer.add_interleave_moe_layer_step(hp["interleave_moe_layer_step"])
    writer.add_expert_feed_forward_length(hp["intermediate_size"])


def llama_cpp_fixed(hp: dict) -> list[tuple[str, object, str]]:
    """(key, value, what llama.cpp's llama4 does) for every value its runtime fixes that the checkpoint states
    otherwise (load_arch_hparams and its graph)."""
    found = fixed_pattern(hp)
    if (chunk := hp.get("attention_chunk_size", CHUNK)) != CHUNK:
        found.append(("attention_chunk_size", chunk, f"attends in chunks of {CHUNK} positions"))
    for key, value in TEMPERATURE.items():
        stored = hp.get(key, value)
        if (bool(stored) if isinstance(value, bool) else stored) != value:  # Meta's config.json: tuning 4 (on)
            found.append((key, stored, TEMPERATURE_TEXT))
    experts = hp.get("num_local_experts")
    if uses_qk_norm(hp) != (experts != 128):
        normed = f"L2-normalizes queries and keys in the RoPE layers but with 128 experts; it has {experts}"
        found.append(("use_qk_norm", uses_qk_norm(hp), normed))
    if hp.get("attention_bias"):
        found.append(("attention_bias", True, "has no attention output bias, and would not load the file"))
    return found


def check_llama_cpp(arch: str, hp: dict) -> None:
    """What llama.cpp's llama4 would run otherwise than transformers' Llama 4: refused, naming the first key."""
    for key, value, instead in llama_cpp_fixed(hp)[:1]:
        refuse(f"GGUF conversion of {arch}", key, value, instead, "llama.cpp's llama4", GGUF_HINT)


# Llama4Model.modify_tensors on the names the converter maps (transformers' model holds the same names, so the
# gate's reading finds each rule by its own tensor's name): gate_up_proj transposed to [experts, 2 x intermediate,
# hidden] and cut in halves (gate first), down_proj transposed
RULES = (
    TensorRule(r"\.feed_forward\.experts\.gate_up_proj$", forward=transposed, inverse=transposed_back,
               shape=swapped_shape, hf_shape=swapped_shape,
               split=((r"\.gate_up_proj$", ".gate_proj.weight"), (r"\.gate_up_proj$", ".up_proj.weight"))),
    TensorRule(r"\.feed_forward\.experts\.down_proj$", rename=(r"\.down_proj$", ".down_proj.weight"),
               forward=transposed, inverse=transposed_back, shape=swapped_shape, hf_shape=swapped_shape),
)


def expert_rows(module, inputs: tuple) -> dict[str, list]:
    """Per expert, the rows its projections take in transformers' Llama4TextExperts (its forward's input: every
    token once per expert, [experts x tokens, hidden], scaled by the router's sigmoid where the router chose that
    expert and 0 where it did not): the chosen tokens' scaled hidden states for gate and up, act(gate) * up of them
    for down; what llama.cpp's llama4 multiplies (its inputs weighted before the experts) and mlx-lm's SwitchGLU
    takes."""
    import torch

    routed = inputs[0].detach().reshape(module.num_experts, -1, module.hidden_size)
    rows: dict[str, list] = {"gate_proj": [], "up_proj": [], "down_proj": []}
    with torch.no_grad():
        for e in range(module.num_experts):
            x = routed[e][(routed[e] != 0).any(-1)]
            gate, up = (x @ module.gate_up_proj[e]).chunk(2, dim=-1)
            rows["gate_proj"].append(x)
            rows["up_proj"].append(x)
            rows["down_proj"].append(module.act_fn(gate) * up)
    return rows


def expert_imatrix_inputs(model, hp: dict, add) -> list:
    """What llama-imatrix collects for ffn_gate_exps / ffn_up_exps / ffn_down_exps (MUL_MAT_ID: each expert's routed
    rows), from forward hooks on transformers' Llama4TextExperts (expert_rows), one matrix per expert."""
    import torch

    handles = []
    for name, module in model.named_modules():
        if not (name.endswith("feed_forward.experts") and hasattr(module, "gate_up_proj")):
            continue
        layer = int(re.search(r"layers\.(\d+)\.", name).group(1))

        def collect(module, inputs, _output, layer=layer):
            rows = expert_rows(module, inputs)
            for projection, tensor in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
                add(f"blk.{layer}.ffn_{tensor}_exps.weight", [r.to(torch.float64) for r in rows[projection]])

        handles.append(module.register_forward_hook(collect))
    return handles


LLAMA4_GGUF = Gguf("LLAMA4", add_llama4_params, "gpt2", experts="stacked", rope_types=ROPE_TYPES,
                   checks=(check_llama_cpp,), extra_tensors=llama.llama_extra_tensors, rules=RULES,
                   imatrix_inputs=expert_imatrix_inputs,
                   own_names=True)  # the router is feed_forward.router, the MLP feed_forward, not mlp

# ---------------------------------------------------------------- MLX (mlx-lm llama4)

MLX_HINT = "use --method gguf (llama.cpp's llama4 reads these as transformers does)"


def mlx_fields(config: dict) -> dict:
    """mlx-lm's llama4 TextArgs requires rope_scaling (None for the default RoPE; llama3's is derived from
    rope_parameters by quantkit.mlx.checkpoint)."""
    kind = (config.get("rope_parameters") or {}).get("rope_type", "default")
    return {} if kind == "llama3" else {"rope_scaling": None}


def mlx_fixed(config: dict) -> list[tuple[str, object, str]]:
    """(key, value, what mlx-lm's llama4 does) for every value its model fixes that the checkpoint states
    otherwise."""
    found = fixed_pattern(config)
    if (k := config.get("num_experts_per_tok", 1)) != 1:
        found.append(("num_experts_per_tok", k, "routes each token to one expert: its MoE asserts top_k == 1"))
    if config.get("tie_word_embeddings"):
        found.append(("tie_word_embeddings", True, "has an output head of its own, which a tied checkpoint lacks"))
    kind = (config.get("rope_parameters") or {}).get("rope_type", "default")
    if kind not in ROPE_TYPES:
        found.append(("rope_parameters.rope_type", kind, "rotates with the default or llama3 RoPE alone"))
    return found


def check_mlx(config: dict) -> None:
    """What mlx-lm's llama4 would compute otherwise than transformers' Llama 4: refused, naming the first key."""
    for key, value, instead in mlx_fixed(config)[:1]:
        refuse("mlx", key, value, instead, "mlx-lm's llama4", MLX_HINT)


LLAMA4_MLX = MlxExperts(
    module="experts",
    fused=(FusedExperts("experts.gate_up_proj", ("gate_proj", "up_proj"), layout="blocks"),
           FusedExperts("experts.down_proj", ("down_proj",))),
    inputs=expert_rows,
)

def linear_experts(cls, module, config, copy: bool):
    """llm-compressor's Llama4LinearExperts of Llama4TextExperts: from the module (its from_experts_module, which
    reads the text config as the multimodal config's text_config: the text model's config is given it under that
    name), or without weights (on the meta device)."""
    from types import SimpleNamespace

    multimodal = config if hasattr(config, "text_config") else SimpleNamespace(text_config=config)
    if copy:
        return cls.from_experts_module(module, multimodal)
    return cls(module.num_experts, module.hidden_size, module.expert_dim, multimodal.text_config)


# the router feed_forward.router returns (scores, logits); llm-compressor linearizes the experts as
# Llama4LinearExperts, each expert's gate the first half of gate_up_proj's columns; the text checkpoint only (the
# multimodal Llama4ForConditionalGeneration fails llm-compressor's tracing of its forward: refused)
LLAMA4_MOE = MoeLayout(router=r".*\.feed_forward\.router$", router_indices=1, router_logits=True,
                       linear_experts=linear_experts, vlm=False)

def dense_layers(config: dict) -> list[int]:
    """The decoder layers whose MLP is dense (Llama4TextMLP): those moe_layers leaves out."""
    return sorted(set(range(config["num_hidden_layers"])) - set(moe_layers(config)))


# the smoothing rows of Llama4TextDecoderLayer (its MLP the block `feed_forward`), as llm-compressor's
# _llama4_default_mappings, whose one MLP-norm row resolves only where every layer is MoE (Scout): here one row for the
# MoE layers and one for the dense ones (Mapping.layers). In the MoE layers the norm balances the router (Llama4Router,
# a Linear) with the routed experts' and the shared expert's gate/up: the routed experts take the norm's output times
# the router's scores, so scaling it leaves both the routing and their input unchanged. SmoothQuant leaves that norm
# out, as for every MoE family (quantkit.arch.mappings).
QKV_ROW, VO_ROW, _MLP_ROW, UP_DOWN_ROW = llama.LLAMA_LIKE
LLAMA4_ROWS = (
    QKV_ROW, VO_ROW,
    Mapping("re:.*post_attention_layernorm$", ("re:.*feed_forward.router$", "re:.*feed_forward.experts.*.gate_proj$",
                                               "re:.*feed_forward.experts.*.up_proj$",
                                               "re:.*feed_forward.shared_expert.gate_proj$",
                                               "re:.*feed_forward.shared_expert.up_proj$"),
            smoothquant=False, layers=moe_layers),
    Mapping("re:.*post_attention_layernorm$", ("re:.*feed_forward.gate_proj$", "re:.*feed_forward.up_proj$"),
            smoothquant=False, layers=dense_layers),
    UP_DOWN_ROW,
)

LLAMA4_TEXT = Family(
    "llama4_text", ARCH, moe=LLAMA4_MOE, smoothing=LLAMA4_ROWS,
    gguf={ARCH: LLAMA4_GGUF},
    mlx="llama4", mlx_layout=MlxLayout(prefix="language_model."), mlx_experts=LLAMA4_MLX, mlx_fields=mlx_fields,
    mlx_checks=(check_mlx,),
)

FAMILIES = (LLAMA4_TEXT,)
