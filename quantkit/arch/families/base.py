"""The record of an architecture family, and the records it is made of.

A family (one module of quantkit.arch.families, the way llama.cpp's converter has one module per family in
`conversion/` and mlx-lm one file per model in `models/`) states what every method needs to know about it:
its `model_type` and classes, what stays 16-bit and why, the smoothing rows AWQ and SmoothQuant use, the
expert layout, how llama.cpp's converter converts it (GGUF architecture, hyperparameters, tensor changes,
vocabulary), the mlx-lm model that loads it, and the rules that complete its config.json without
transformers. Nothing here imports torch, transformers or gguf at module level.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

Hparams = dict  # a config.json dict completed with its class's defaults (quantkit.arch.families.text.text_hparams)


# ---------------------------------------------------------------- what stays 16-bit


@dataclass(frozen=True)
class Kept:
    """Linear layers of the family every method keeps 16-bit, and why (the report lists them with the reason)."""

    pattern: str  # llm-compressor's ignore syntax: "re:" + re.match on the module name
    reason: str
    methods: tuple[str, ...] = ()  # the methods that keep it (a consumer of one format lacks it); (): every method
    when: Callable[[dict], bool] | None = None  # when(config.json) -> whether the rule applies; None: always


# ---------------------------------------------------------------- smoothing (AWQ, SmoothQuant)


@dataclass(frozen=True)
class Mapping:
    """One smoothing row (quantkit.arch.mappings says how the methods use them)."""

    smooth: str  # the layer whose output channels are divided by s
    balance: tuple[str, ...]  # the layers whose input columns are multiplied by s
    smoothquant: bool  # SmoothQuant uses this row (a norm's row)
    awq: bool = True  # False: AWQ leaves this row out
    when: Callable[[dict], bool] | None = None  # when(config.json) -> whether the row holds; None: always
    # layers(config.json) -> the decoder layers the row holds in (Llama 4's MoE and dense MLPs in alternate layers;
    # llm-compressor resolves a row layer by layer and fails where one of its balance layers is missing); None: all
    layers: Callable[[dict], list[int]] | None = None


# ---------------------------------------------------------------- mixture of experts


@dataclass(frozen=True)
class MoeLayout:
    """How a loaded MoE model's experts and routers are named (quantkit.arch.moe)."""

    router: str = r".*\.mlp\.gate$"  # module-name regex of the router (transformers 5 names)
    # linear expert projection (llm-compressor's name) -> the checkpoint's name, where they differ
    expert_names: dict[str, str] = field(default_factory=dict)
    # (checkpoint block name, transformers 5 block name) renamed while loading
    block_rename: tuple[str, str] | None = None
    # where the router's forward output holds the top-k expert indices ([tokens, top_k]): last of (logits, weights,
    # indices) for transformers 5's routers, first for Granite's (indices, weights, logits)
    router_indices: int = 2
    # the router's output at router_indices holds its logits ([tokens, experts]), whose top `top_k` (the router's
    # attribute) are the experts it routes to (Llama 4's Llama4Router: (scores, logits))
    router_logits: bool = False
    # linear_experts(cls, module, config, copy) -> llm-compressor's linear experts (`cls`, a LinearExperts2D) of a
    # fused-experts module, its weights copied (copy) or not (on the meta device), where oneshot's own linearization
    # cannot build them (Llama 4's text model: its class reads the multimodal config); None: oneshot's
    linear_experts: Callable[[type, object, object, bool], object] | None = None
    # the layout holds for the family's VLM checkpoints too (False: the text checkpoint only; Llama 4's multimodal
    # checkpoint fails llm-compressor's tracing of its forward and stays refused)
    vlm: bool = True


@dataclass(frozen=True)
class ExpertCheckpoint:
    """How an MoE family's checkpoint stores its experts, for what reads it by tensor names without building
    a transformers model: the model-free quantization (quantkit.engines.llmcompressor.model_free_moe) and the
    gate's reading of its artifacts (quantkit.eval.experts).

    A routed expert's projections are `<layer>.mlp.experts.<e>.<projection>.weight` (vLLM's
    ckpt_gate/up/down_proj_name: its expert-parameter mapping loads them into the fused experts' w13 and w2);
    transformers 5 stacks them while loading into `<layer>.mlp.experts.gate_up_proj` ([experts, 2 x
    intermediate, hidden]: gate then up) and `.down_proj` ([experts, hidden, intermediate]). Multi-token-
    prediction layers follow the decoder's as `model.layers.<num_hidden_layers + i>.`: transformers' model
    has no such layer, vLLM's main model skips them (its MTP draft model loads them), and they are kept as
    stored."""

    projections: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # gate, up, down
    mtp_keys: tuple[str, ...] = ()  # config.json keys counting the multi-token-prediction layers


@dataclass(frozen=True)
class FusedExperts:
    """One checkpoint tensor holding every routed expert of one or more projections, `<block>.<tensor>`, in one of
    three layouts (`layout`): "interleaved", `x @ W` ([experts, in, out]) with the projections' columns in turn (column
    j belongs to projection j % len(projections): GPT-OSS's `<block>.experts.gate_up_proj`); "blocks", `x @ W` with
    the projections in equal blocks of columns, gate first (Llama 4's); "rows", F.linear's [experts, out, in] with
    the projections in equal blocks of rows (Granite 4's `<block>.input_linear.weight`: gate rows, then up rows). Its
    bias ([experts, out]) is split the same way. Written as the SwitchGLU's projections
    `<block>.<MlxExperts.module>.<projection>.weight` ([experts, out / len(projections), in]) and `.bias`, the form
    its mlx-lm model's sanitize leaves as it is."""

    tensor: str  # the fused weight's name after `<block>.` ("experts.gate_up_proj", "input_linear.weight")
    projections: tuple[str, ...]  # SwitchGLU's projections it holds, in order ("gate_proj", "up_proj")
    bias: str = ""  # its bias's name after `<block>.` ("experts.gate_up_proj_bias"); "": none
    layout: str = "interleaved"  # "interleaved", "blocks" (both x @ W) or "rows" ([experts, out, in])

    def piece_shape(self, shape) -> tuple[int, int, int]:
        """(experts, out, in) of each projection's piece of the fused weight of this `shape`, as F.linear holds it."""
        experts, outputs, inputs = shape if self.layout == "rows" else (shape[0], shape[2], shape[1])
        return experts, outputs // len(self.projections), inputs


@dataclass(frozen=True)
class MlxExperts:
    """How the family's mlx-lm model stacks the routed experts (its `sanitize`, which stacks them only where the
    per-expert names are present, and its SwitchGLU): the checkpoint's `<block>.experts.<e>.<projection>.weight`
    become one `<block>.<module>.<name>.weight` per projection ([experts, out, in]), `<block>` as stored
    (Mixtral's `block_sparse_moe`), `name` the projection's own or its entry in `renames`; a checkpoint storing
    them fused across experts (`fused`: GPT-OSS) has each fused tensor cut into those projections. A quantized
    artifact stores them so, each expert quantized along its last axis (mlx-lm's QuantizedSwitchLinear)."""

    # checkpoint projection -> SwitchGLU's, where they differ (Mixtral: w1 -> gate_proj)
    renames: dict[str, str] = field(default_factory=dict)
    # tensors (by a part of their name) its model's cast_predicate keeps in their stored dtype, as mlx_lm.convert
    # writes them: the routers' e_score_correction_bias
    uncast: tuple[str, ...] = ()
    module: str = "switch_mlp"  # the SwitchGLU's attribute in its block (GPT-OSS's mlp.experts)
    # the fused expert tensors the checkpoint stores instead of per-expert ones (GPT-OSS's gate_up_proj, down_proj)
    fused: tuple[FusedExperts, ...] = ()
    # inputs(transformers' experts module, its forward's inputs) -> {SwitchGLU projection: each expert's input rows
    # [tokens, columns] (the tokens routed to it)}: the column importances of fused experts, recorded by a forward
    # hook on the module during calibration; None: for fused experts, the rows llama-imatrix collects from a
    # transformers experts module that takes the router's choice (quantkit.methods.mlx.routed_rows), and for per-expert
    # checkpoints the per-expert linears are hooked instead
    inputs: Callable[[object, tuple], dict[str, list]] | None = None
    # the checkpoint may store the experts in transformers' fused layout instead (Qwen3.5-MoE's releases:
    # `<block>.experts.gate_up_proj` [experts, 2 x intermediate, hidden], gate then up, and `.down_proj`): each is cut
    # into the per-expert tensors it holds and written as those are (quantkit.mlx.checkpoint.PerExpertWeights)
    split_fused: bool = False


@dataclass(frozen=True)
class MlxRule:
    """One value change the family's mlx-lm `sanitize` makes of a Hugging Face tensor (those whose name matches
    `pattern`, re.search): the artifact stores the changed tensor, as mlx_lm.convert writes it (its sanitize then
    leaves it as it is), and quantkit's reading takes it back."""

    pattern: str
    forward: Callable  # forward(torch tensor as stored) -> the tensor mlx-lm's sanitize makes of it
    inverse: Callable  # inverse(torch tensor read from the artifact) -> the Hugging Face tensor (any device: meta too)


@dataclass(frozen=True)
class MlxLayout:
    """How the family's mlx-lm model holds a text checkpoint where it is not under the Hugging Face names and values
    (a VLM's model that also loads the text model alone: Qwen3.5's qwen3_5; a model whose sanitize converts values
    only in a checkpoint it also restacks: Qwen3-Next's qwen3_next), in the form mlx_lm.convert writes: config.json
    with the family's `mlx` as model_type and (`nested`) the checkpoint's own config.json as `text_config`, every
    tensor under `prefix` (the text model's module path), `rules` applied, `dropped` not written."""

    prefix: str  # prepended to each Hugging Face tensor name (mlx-lm's module path of the text model)
    nested: bool = True  # config.json nests the checkpoint's as text_config (False: the checkpoint's own, flat)
    rules: tuple[MlxRule, ...] = ()
    dropped: tuple[str, ...] = ()  # name prefixes of the tensors its sanitize drops (the MTP layers): not written
    uncast: tuple[str, ...] = ()  # name suffixes its cast_predicate keeps in their stored dtype (A_log)


# ---------------------------------------------------------------- GGUF (llama.cpp's converter class, as data)


@dataclass(frozen=True)
class Pieces:
    """How a split tensor (TensorRule.split) is cut where its pieces are not equal blocks of its rows: pieces of
    their own shapes (DeepSeek's kv_b_proj: attn_k_b, each head's rows transposed, and attn_v_b), and the way back.
    Each callable takes the hyperparameters last; shapes are numpy order."""

    # shapes(Hugging Face shape) -> each piece's written shape, in TensorRule.split's order
    shapes: Callable[[tuple[int, ...], Hparams], tuple[tuple[int, ...], ...]]
    # cut(float32 values after TensorRule.forward, in the Hugging Face shape) -> the pieces' values, in that order
    cut: Callable[[np.ndarray, Hparams], tuple[np.ndarray, ...]]
    # join(the pieces' float32 values read from the file, in that order) -> the tensor (before TensorRule.inverse)
    join: Callable[[list[np.ndarray], Hparams], np.ndarray]
    # hf_shape(the pieces' written shapes) -> the Hugging Face shape of the joined tensor
    hf_shape: Callable[[list[tuple[int, ...]], Hparams], tuple[int, ...]]


@dataclass(frozen=True)
class TensorRule:
    """One step of the converter's `modify_tensors` for the Hugging Face tensors whose name matches `pattern`
    (re.search, on the name the converter maps): a new name before gguf-py's TensorNameMap, new values, and
    the way back for quantkit's reading of the file (the gate)."""

    pattern: str
    rename: tuple[str, str] | None = None  # (regex, replacement) applied to the name
    # forward(float32 values, hparams, source dtype "F32"/"F16"/"BF16") -> the values the converter writes
    forward: Callable[[np.ndarray, Hparams, str], np.ndarray] | None = None
    # inverse(float32 values read from the file, hparams) -> the Hugging Face values
    inverse: Callable[[np.ndarray, Hparams], np.ndarray] | None = None
    # shape(Hugging Face shape, hparams) -> the written shape (numpy order); None: the same
    shape: Callable[[tuple[int, ...], Hparams], tuple[int, ...]] | None = None
    # hf_shape(written shape, hparams) -> the Hugging Face shape; None: the same
    hf_shape: Callable[[tuple[int, ...], Hparams], tuple[int, ...]] | None = None
    # when(hparams) -> whether the step applies (the converter's branch on the hyperparameters); None: always
    when: Callable[[Hparams], bool] | None = None
    # one fused tensor written as pieces: the (regex, replacement) renames of each piece, the tensor (after
    # `forward`, in the written shape) cut into that many equal parts along its second-to-last axis (its rows;
    # each expert's rows for stacked experts; `split_rows` sizes the blocks where they differ, `pieces` cuts it
    # otherwise); the reading joins them again. (): one tensor
    split: tuple[tuple[str, str], ...] = ()
    # the split's pieces where they are not equal row blocks (Pieces: their shapes, the cut and the join); the
    # pieces then take other inputs in llama.cpp's graph than the Hugging Face linear does: the family's
    # Gguf.imatrix_inputs collects them (quantkit's imatrix skips the linear). None: equal row blocks
    pieces: Pieces | None = None
    # split_rows(written shape, hparams) -> each piece's rows where the pieces are row blocks of unequal sizes
    # (Qwen3-Next's in_proj_qkvz: attn_qkv, then attn_gate); None: equal row blocks
    split_rows: Callable[[tuple[int, ...], Hparams], tuple[int, ...]] | None = None
    # target(name, hparams) -> the GGUF name, where gguf-py's TensorNameMap has none (Qwen3.5's nextn tensors, which
    # gguf 0.19's qwen35 tables lack); None: TensorNameMap's name of the (renamed) name
    target: Callable[[str, Hparams], str] | None = None


@dataclass(frozen=True)
class MetadataTensor:
    """A per-layer tensor of one value (`model.layers.<i>.<suffix>`) that the converter takes out of the tensors
    and writes, one float per layer in layer order, as the metadata array `key`; the GGUF reader gives it back
    in `shape` (the Hugging Face one) from that array."""

    suffix: str  # e.g. "mlp.act_fn.alpha_p"
    key: str  # the GGUF key, e.g. "xielu.alpha_p"
    shape: tuple[int, ...] = ()


def no_params(writer, hp: Hparams, ftype: int) -> None:
    return None


def no_tensors(hp: Hparams) -> dict[str, np.ndarray]:
    return {}


@dataclass(frozen=True)
class Gguf:
    """How convert_hf_to_gguf.py converts one Hugging Face architecture (its model class, as data and functions).

    `params(writer, hparams, ftype)` writes the class's set_gguf_parameters keys; `checks` refuse, from the
    hyperparameters alone, what the conversion does not reproduce (each `check(architecture, hparams)` raises
    UnsupportedError); `extra_tensors(hparams)` are its generate_extra_tensors; `rules` its modify_tensors.
    """

    arch: str  # gguf.MODEL_ARCH member name
    params: Callable[[object, Hparams, int], None]
    vocab: str  # set_vocab flavour (quantkit.gguf.vocab.VOCAB_KINDS)
    permute_qk: bool = False  # llama.cpp LLAMA_ROPE_TYPE_NORM: undo HF's rotate_half layout
    norm_shift: bool = False  # Gemma RMSNorm scales by (1 + w): stored weight = w + 1
    drops_lm_head: bool = False  # lm_head never written (Gemma 1/2): the output is the tied embedding
    # how the checkpoint stores the routed experts: one tensor per expert, stacked into ffn_*_exps ("mixtral" or
    # "qwen": the names of quantkit.gguf.convert.EXPERT_LAYOUTS), or "stacked": one 3-D tensor per layer already
    # (Granite 4's block_sparse_moe.input_linear), written by the family's `rules`; "": no experts
    experts: str = ""
    shared_expert: bool = False  # Qwen2MoeModel's shared expert (mlp.shared_expert, shared_expert_intermediate_size
    # wide, scaled by the one-output sigmoid gate mlp.shared_expert_gate): ffn_*_shexp and ffn_gate_inp_shexp
    trims_vocab: bool = False  # Gemma 3: token_embd rows beyond the tokenizer's vocabulary dropped
    fused_qkv_mlp: bool = False  # Phi-3: qkv_proj -> attn_qkv, gate_up_proj -> ffn_up (fused on both sides)
    rope_types: tuple[str, ...] = ("default", "linear", "yarn")
    windowed: bool = False  # the converter writes a sliding window (else one in the config is refused)
    text_types: tuple[str, ...] = ()  # a VLM's text_config.model_type values converted (Mistral3: ministral3 and
    # mistral4 take other converter classes); empty: any
    mrope: bool = False  # Qwen2/2.5/3-VL's multimodal RoPE: mrope_section written as rope.dimension_sections
    strips_text_model: bool = False  # LlamaModel.filter_tensors: SmolVLM's `text_model.` dropped from the names
    # renames(name, hparams) -> the name the converter maps, where its filter_tensors renames it (Qwen's MTP layers
    # as the blocks after the decoder's); None: as it is
    renames: Callable[[str, Hparams], str] | None = None
    checks: tuple[Callable[[str, Hparams], None], ...] = ()
    # tensor_hparams(hparams, the checkpoint's tensor names) -> the hyperparameters with those the converter class
    # counts from the tensors where config.json lacks them (Qwen3NextModel: its MTP layers); None: config.json's
    tensor_hparams: Callable[[Hparams, list[str]], Hparams] | None = None
    # checks of the checkpoint's tensor names too (each `check(architecture, hparams, names)` raises
    # UnsupportedError): what the tensors hold that the conversion does not reproduce (MTP layers it does not write)
    tensor_checks: tuple[Callable[[str, Hparams, list[str]], None], ...] = ()
    extra_tensors: Callable[[Hparams], dict[str, np.ndarray]] = no_tensors
    rules: tuple[TensorRule, ...] = ()
    # the converter class reads config.json itself, not transformers' AutoConfig.to_dict() (Mamba2Model.__init__:
    # no defaults filled in, layer_types as stored): its hyperparameters are config.json's
    raw_config: bool = False
    # the per-layer key/value head counts the class writes (head_count_kv as an array, 0 for a layer without
    # attention, or one count for all: DeepSeek's MLA written as MQA); llama-quantize's n_gqa() reads layer 0's.
    # None: num_key_value_heads in every layer
    layer_kv_heads: Callable[[Hparams], list[int]] | None = None
    # blocks(hparams) -> the GGUF's block count where it is not num_hidden_layers (Qwen3.5: + its MTP layers; what
    # llama-quantize's per-layer type choice counts); None: num_hidden_layers
    blocks: Callable[[Hparams], int] | None = None
    mrope_optional: bool = False  # Qwen3.5: mrope_section in the RoPE parameters or not (the converter writes
    # default sections where there are none)
    # vocab_check(model dir, hparams): refuses before work (UnsupportedError) what the class's set_vocab cannot write
    vocab_check: Callable[[Path, Hparams], None] | None = None
    # per-layer scalar tensors the converter writes as metadata arrays instead of tensors (Apertus' xIELU)
    metadata_tensors: tuple[MetadataTensor, ...] = ()
    # drops(name the converter maps, hparams) -> whether the class's modify_tensors writes nothing for the tensor
    # (DeepseekV2Model: the MTP layers after the decoder's, a tied lm_head); None: it writes every tensor
    drops: Callable[[str, Hparams], bool] | None = None
    # imatrix_inputs(model, hparams, add) -> hook handles: the inputs llama.cpp's graph multiplies by tensors no
    # Hugging Face linear takes as its input (DeepSeek's attn_k_b / attn_v_b in the absorbed MLA; experts given their
    # routed rows alone, without the routing: Llama 4's), collected during
    # quantkit's imatrix forwards by forward hooks the family registers on the transformers model; each hook calls
    # add(GGUF name, rows: [matrices, tokens, columns]), one matrix per slice of a 3-D tensor. None: none
    imatrix_inputs: Callable[[object, Hparams, Callable], list] | None = None
    own_names: bool = False  # tensors named beyond the Llama-style decoder's: the GGUF reader maps the
    # transformers model's own names (as it does for a family with rules)


# ---------------------------------------------------------------- config.json completed without transformers


def no_rope(hp: dict, kwargs: dict, entry: dict) -> None:
    return None


@dataclass(frozen=True)
class ConfigRules:
    """What the family's configuration class does on top of its field defaults (quantkit.arch.hf_config):
    `rules(hp, kwargs)` in order (its __post_init__), then `rope(hp, kwargs, entry)` (its RoPE dictionary)."""

    rules: tuple[Callable[[dict, dict], None], ...] = ()
    rope: Callable[[dict, dict, dict], None] | None = None  # None: quantkit.arch.families.text.rope_dict


# ---------------------------------------------------------------- the family


@dataclass(frozen=True)
class Family:
    """One architecture family: every method reads it (quantkit.arch.families finds it by model_type or class).

    A record with `name` is a row of docs/models.md's tables (tested on a tiny model of it); the others are
    families quantkit reads without claiming them there (a VLM's text model, an older generation)."""

    model_type: str  # config.json model_type
    architecture: str = ""  # config.json architectures[0] of its causal LM ("" for a VLM's text model)
    name: str = ""  # as people name it; "" keeps it out of the docs' tables
    kept: tuple[Kept, ...] = ()
    smoothing: tuple[Mapping, ...] = ()  # AWQ and SmoothQuant rows; () refuses both
    moe: MoeLayout | None = None  # the llm-compressor methods' expert layout; None: dense, or not supported
    experts_by_name: ExpertCheckpoint | None = None  # read by tensor names (model-free paths, the gate's reading)
    gguf: dict[str, Gguf] = field(default_factory=dict)  # architecture (this one's, and the VLMs' built on it) ->
    # its conversion
    mlx: str = ""  # the mlx_lm.models module that loads it with the Hugging Face tensor names; "": refused
    # an MoE family's routed experts as that model stacks them (None: a dense family, or its MoE refused by mlx)
    mlx_experts: MlxExperts | None = None
    mlx_refusal: str = ""  # why the mlx method refuses the family ("": the generic reason)
    # why the gguf method refuses the family where llama.cpp's converter has a class for its architecture that
    # cannot convert what quantkit reads (`gguf` empty); "": the generic reason (no such class)
    gguf_refusal: str = ""
    # the text checkpoint as that model holds it under other names (None: under the Hugging Face names as stored)
    mlx_layout: MlxLayout | None = None
    config: ConfigRules | None = None  # None: config.json is completed through transformers
    # why the llm-compressor methods refuse the family's mixture-of-experts variant ({method}: the method's
    # name), where its experts have no layout (`moe` None); "": the generic refusal
    moe_refusal: str = ""
    # check(info) for every method, before any work: raises (ModelError, UnsupportedError) where the checkpoint's
    # config and tensors disagree (`info`: quantkit.io.checkpoint.ModelInfo)
    checks: tuple[Callable[[object], None], ...] = ()
    # mlx_fields(config.json dict) -> the top-level fields its mlx-lm model reads that transformers 5 nests
    # (beyond quantkit.mlx.checkpoint.derived_mlx_lm_fields' own); None: none
    mlx_fields: Callable[[dict], dict] | None = None
    # why SmoothQuant (norm rows only) refuses a family whose `smoothing` has no norm row ("": a generic reason)
    smoothquant_refusal: str = ""
    # refusals of the mlx method from config.json (each check(config) raises UnsupportedError): what mlx-lm's
    # model would read otherwise than transformers does
    mlx_checks: tuple[Callable[[dict], None], ...] = ()
    # linear layers llm-compressor's sequential pipeline cannot calibrate (called inside a function its tracer
    # leaves opaque: they would gather a Hessian but never their weight statistics): kept 16-bit, with the
    # reason, by the llm-compressor methods that calibrate; the data-free ones quantize them
    untraced: tuple[Kept, ...] = ()
    # sequential(hparams) -> llm-compressor's sequential_targets for this checkpoint (None: its default, one
    # decoder layer per subgraph); a family whose layers pass state to later layers outside the traced graph
    # calibrates a module holding all of them as one
    sequential: Callable[[Hparams], list[str] | None] | None = None
