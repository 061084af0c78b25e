"""Per-tensor GGUF type choice, exactly as llama-quantize's llama_tensor_get_type (src/llama-quant.cpp).

`choose_types(tensors, "Q4_K_M", facts)` returns {gguf tensor name: GGMLQuantizationType} for every
tensor of a model, given its GGUF names and numpy shapes (rows, cols) — ggml's ne[0] is the last
numpy dimension. Tensors are visited in llama-quantize's order (llama_model_loader's weights_map:
by block number, non-block tensors first, then by name) because the attn_v counter depends on it.

Covered file types: Q2_K, Q3_K_S/M/L, Q4_K_S/M, Q5_K_S/M, Q6_K, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1,
F16, BF16, F32 and the i-quant mixes IQ4_NL, IQ4_XS, IQ3_XXS, IQ3_XS, IQ3_S, IQ3_M, IQ2_XXS,
IQ2_XS, IQ2_S, IQ2_M, IQ1_S, IQ1_M. A mix may name ggml types quantkit has no kernel for yet
(`missing_kernels` lists them; the CLI refuses such a mix before any work), and the lowest types
need an imatrix (`needs_imatrix`, llama-quant.cpp's tensor_requires_imatrix).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gguf import GGML_QUANT_SIZES
from gguf import GGMLQuantizationType as T
from gguf import LlamaFileType as F

from quantkit.errors import InputError

# file type name -> (general.file_type, default tensor type) — llama_ftype_get_default_type
FILE_TYPES: dict[str, tuple[F, T]] = {
    "F32": (F.ALL_F32, T.F32),
    "F16": (F.MOSTLY_F16, T.F16),
    "BF16": (F.MOSTLY_BF16, T.BF16),
    "Q8_0": (F.MOSTLY_Q8_0, T.Q8_0),
    "Q4_0": (F.MOSTLY_Q4_0, T.Q4_0),
    "Q4_1": (F.MOSTLY_Q4_1, T.Q4_1),
    "Q5_0": (F.MOSTLY_Q5_0, T.Q5_0),
    "Q5_1": (F.MOSTLY_Q5_1, T.Q5_1),
    "Q2_K": (F.MOSTLY_Q2_K, T.Q2_K),
    "Q3_K_S": (F.MOSTLY_Q3_K_S, T.Q3_K),
    "Q3_K_M": (F.MOSTLY_Q3_K_M, T.Q3_K),
    "Q3_K_L": (F.MOSTLY_Q3_K_L, T.Q3_K),
    "Q4_K_S": (F.MOSTLY_Q4_K_S, T.Q4_K),
    "Q4_K_M": (F.MOSTLY_Q4_K_M, T.Q4_K),
    "Q5_K_S": (F.MOSTLY_Q5_K_S, T.Q5_K),
    "Q5_K_M": (F.MOSTLY_Q5_K_M, T.Q5_K),
    "Q6_K": (F.MOSTLY_Q6_K, T.Q6_K),
    "IQ4_NL": (F.MOSTLY_IQ4_NL, T.IQ4_NL),
    "IQ4_XS": (F.MOSTLY_IQ4_XS, T.IQ4_XS),
    "IQ3_XXS": (F.MOSTLY_IQ3_XXS, T.IQ3_XXS),
    "IQ3_XS": (F.MOSTLY_IQ3_XS, T.IQ3_S),
    "IQ3_S": (F.MOSTLY_IQ3_S, T.IQ3_S),
    "IQ3_M": (F.MOSTLY_IQ3_M, T.IQ3_S),
    "IQ2_XXS": (F.MOSTLY_IQ2_XXS, T.IQ2_XXS),
    "IQ2_XS": (F.MOSTLY_IQ2_XS, T.IQ2_XS),
    "IQ2_S": (F.MOSTLY_IQ2_S, T.IQ2_XS),
    "IQ2_M": (F.MOSTLY_IQ2_M, T.IQ2_S),
    "IQ1_S": (F.MOSTLY_IQ1_S, T.IQ1_S),
    "IQ1_M": (F.MOSTLY_IQ1_M, T.IQ1_M),
}
# llama-quantize's aliases (tools/quantize/quantize.cpp QUANT_OPTIONS)
ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}
UNQUANTIZED = (T.F32, T.F16, T.BF16)

# tensor_type_fallback: a 256-block type on a row that is not a multiple of 256
FALLBACK = {T.Q2_K: T.Q4_0, T.Q3_K: T.Q4_0, T.Q4_K: T.Q5_0, T.Q5_K: T.Q5_1, T.Q6_K: T.Q8_0,
            **dict.fromkeys((T.IQ1_S, T.IQ1_M, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ3_XXS, T.IQ3_S, T.IQ4_XS),
                            T.IQ4_NL)}
# tensor_requires_imatrix: types llama.cpp refuses to make without an imatrix (except for
# token_embd / output.weight)
IMATRIX_TYPES = (T.IQ3_XXS, T.IQ2_XXS, T.IQ2_XS, T.IQ2_S, T.IQ1_M, T.IQ1_S)
# the i-quant mixes with their own branch in llama_tensor_get_type_impl
LOW_IQ = ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M")
# ... and those whose output.weight is Q5_K (the rest: Q6_K)
OUTPUT_Q5_K = ("IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M")

# tensor_get_category: (category, substring), first match wins after the exact names
CATEGORIES = [("attn_v", "attn_qkv.weight"), ("attn_v", "attn_kv_b.weight"), ("attn_v", "attn_v.weight"),
              ("attn_k", "attn_k.weight"), ("attn_q", "attn_q.weight"), ("attn_output", "attn_output.weight"),
              ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"), ("ffn_down", "ffn_down")]
# tensor_allows_quantization: substrings that keep a 2-D weight unquantized (those that can occur here)
NEVER_QUANTIZED = ("_norm.weight", "ffn_gate_inp.weight", "altup", "laurel", "per_layer_model_proj",
                   "ssm_conv1d", "time_mix_", "attn_rel_b.weight", ".position_embd", ".patch_embd")


@dataclass(frozen=True)
class ModelFacts:
    """The hyper-parameters llama_tensor_get_type looks at."""

    arch: str  # GGUF architecture string: llama, qwen2, qwen3, falcon ...
    n_layer: int
    n_head: int
    n_head_kv: int
    n_expert: int = 0

    @property
    def n_gqa(self) -> int:
        return self.n_head // self.n_head_kv if self.n_head_kv else 0

    @property
    def is_70b(self) -> bool:
        """LLM_TYPE_70B as llama.cpp's load_hparams sets it for the architectures quantkit converts."""
        if self.arch == "llama":
            return self.n_layer == 80 and self.n_head != self.n_head_kv
        return self.arch == "qwen2" and self.n_layer == 80


def file_type(name: str) -> tuple[str, F, T]:
    """(canonical name, LlamaFileType, default tensor type) or InputError naming the known ones."""
    key = ALIASES.get(name.upper(), name.upper())
    if key not in FILE_TYPES:
        raise InputError(f"unknown GGUF type '{name}'", hint="choose one of: " + ", ".join(FILE_TYPES))
    return (key, *FILE_TYPES[key])


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


def layer_of(name: str) -> int:
    m = re.match(r"blk\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


def llama_order(names) -> list[str]:
    """llama_model_loader::weight_name_comparer order."""
    return sorted(names, key=lambda n: (layer_of(n), n))


def category(name: str) -> str:
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for cat, needle in CATEGORIES:
        if needle in name:
            return cat
    return "other"


def n_dims(shape: tuple[int, ...]) -> int:
    """ggml_n_dims of a tensor of this numpy shape: its dimensions up to the last one above 1 in ggml's order
    (ne[0] is the last numpy dimension), at least 1; a [1, n] weight has one."""
    ne = tuple(reversed(shape))
    return max([i + 1 for i, size in enumerate(ne) if size > 1] or [1])


def allows_quantization(name: str, shape: tuple[int, ...]) -> bool:
    """tensor_allows_quantization: weights of 2 or 3 ggml dimensions (a single-row weight, Qwen's one-output
    shared-expert gate, is not quantized) outside the names llama-quantize keeps."""
    return n_dims(shape) >= 2 and name.endswith("weight") and not any(s in name for s in NEVER_QUANTIZED)


@dataclass
class _State:
    n_attention_wv: int
    tied: bool
    i_attention_wv: int = 0
    i_ffn_down: int = 0
    i_ffn_gate: int = 0
    i_ffn_up: int = 0


def choose_types(tensors: dict[str, tuple[int, ...]], ftype: str, facts: ModelFacts,
                 has_imatrix: bool = False) -> dict[str, T]:
    """GGUF type of every tensor (unquantizable ones: F32, as the converter writes them)."""
    name, _, default = file_type(ftype)
    cats = {n: category(n) for n in tensors}
    state = _State(n_attention_wv=sum(c == "attn_v" for c in cats.values()),
                   tied="output.weight" not in tensors)
    types = {}
    for tname in llama_order(tensors):
        shape = tuple(tensors[tname])
        if not allows_quantization(tname, shape):
            types[tname] = T.F32
        elif default in UNQUANTIZED:
            types[tname] = default
        else:
            chosen = tensor_type(tname, shape, cats[tname], name, default, facts, state, has_imatrix)
            types[tname] = fallback(chosen, shape[-1])
    return types


def fallback(qtype: T, ncols: int) -> T:
    """tensor_type_fallback: demote to a 32-block type, else F16, when ncols is not a block multiple."""
    if ncols % GGML_QUANT_SIZES[qtype][0] == 0:
        return qtype
    new = FALLBACK.get(qtype, qtype)
    return new if ncols % GGML_QUANT_SIZES[new][0] == 0 else T.F16


def tensor_type(name: str, shape, cat: str, ftype: str, new: T, facts: ModelFacts, st: _State,
                has_imatrix: bool) -> T:
    """llama_tensor_get_type_impl: the branches in llama.cpp's order."""
    if cat == "output" or (st.tied and cat == "token_embd"):
        return output_type(shape, ftype, new, facts)
    if cat == "token_embd":
        return token_embd_type(ftype, new)
    if ftype in LOW_IQ:
        return low_iq_type(cat, ftype, new, facts, st)
    if cat == "attn_v":
        new = attn_v_type(ftype, new, facts, st, has_imatrix)
        st.i_attention_wv += 1
        return new
    if cat == "attn_k":
        return T.Q8_0 if facts.n_expert == 8 else {"IQ3_XS": T.IQ3_XXS, "IQ3_XXS": T.IQ2_S}.get(ftype, new)
    if cat == "attn_q":
        return {"IQ3_XS": T.IQ3_XXS, "IQ3_XXS": T.IQ2_S}.get(ftype, new)
    if cat == "ffn_down":
        i_layer = layer_of(name) if facts.n_expert > 1 else st.i_ffn_down
        st.i_ffn_down += 1
        return ffn_down_type(ftype, new, facts, i_layer, has_imatrix)
    if cat == "attn_output":
        return attn_output_type(ftype, new, facts)
    if cat in ("ffn_gate", "ffn_up"):
        counter = f"i_{cat}"
        i_layer = layer_of(name) if facts.n_expert > 1 else getattr(st, counter)
        setattr(st, counter, getattr(st, counter) + 1)
        n = facts.n_layer
        return T.IQ3_XXS if ftype == "IQ3_XS" and n // 8 <= i_layer < 7 * n // 8 else new
    return new


def output_type(shape, ftype: str, new: T, facts: ModelFacts) -> T:
    if facts.arch == "falcon" or shape[-1] % GGML_QUANT_SIZES[new][0] != 0:
        return T.Q8_0
    if ftype in OUTPUT_Q5_K:
        return T.Q5_K
    return T.Q6_K if new != T.Q8_0 else new


def token_embd_type(ftype: str, new: T) -> T:
    """An untied token_embd: the 2-bit and 1-bit i-quant mixes give it Q2_K or IQ3_S."""
    if ftype in ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"):
        return T.Q2_K
    if ftype in ("IQ2_S", "IQ2_M", "IQ3_XXS"):
        return T.IQ3_S
    return new


def low_iq_type(cat: str, ftype: str, new: T, facts: ModelFacts, st: _State) -> T:
    """The branch of the IQ2_XXS / IQ2_XS / IQ2_S / IQ2_M / IQ1_S / IQ1_M mixes."""
    iq2_sm = ftype in ("IQ2_S", "IQ2_M")
    if cat == "attn_v":
        st.i_attention_wv += 1
        if facts.n_gqa >= 4 or facts.n_expert >= 4:
            return T.Q4_K
        return T.IQ3_S if iq2_sm else T.Q2_K
    if cat == "attn_k" and facts.n_expert == 8:
        return T.Q4_K
    if cat == "ffn_down":
        first = st.i_ffn_down < facts.n_layer // 8  # the counter, also for experts (llama.cpp)
        st.i_ffn_down += 1
        return (T.IQ3_S if iq2_sm else T.Q2_K) if first else new
    if cat == "attn_output":
        if facts.n_expert == 8:
            return T.Q5_K
        if ftype in ("IQ1_S", "IQ1_M"):
            return T.IQ2_XXS
        return T.IQ3_S if iq2_sm else new
    return new


def attn_v_type(ftype: str, new: T, facts: ModelFacts, st: _State, has_imatrix: bool = False) -> T:
    i, n, gqa4 = st.i_attention_wv, st.n_attention_wv, facts.n_gqa >= 4
    if ftype == "Q2_K":
        new = T.Q4_K if gqa4 else T.Q3_K
    elif ftype == "IQ3_XXS":
        new = T.Q4_K if gqa4 else T.IQ3_XXS if has_imatrix else T.IQ3_S
    elif (ftype in ("IQ3_XS", "IQ3_S") and gqa4) or ftype == "IQ3_M":
        new = T.Q4_K
    elif ftype == "Q3_K_M":
        new = T.Q5_K if i < 2 else T.Q4_K
    elif ftype == "Q3_K_L" or (ftype in ("IQ4_NL", "IQ4_XS") and gqa4):
        new = T.Q5_K
    elif ftype in ("Q4_K_M", "Q5_K_M") and use_more_bits(i, n):
        new = T.Q6_K
    elif ftype == "Q4_K_S" and i < 4:
        new = T.Q5_K
    if facts.is_70b and new in (T.Q3_K, T.Q4_K):
        new = T.Q5_K
    if facts.n_expert == 8:
        new = T.Q8_0
    return new


def ffn_down_type(ftype: str, new: T, facts: ModelFacts, i: int, has_imatrix: bool) -> T:
    n, falcon = facts.n_layer, facts.arch == "falcon"
    if ftype == "Q2_K":
        return T.Q3_K
    if ftype == "IQ3_XXS" and not has_imatrix:
        return T.Q4_K if i < n // 8 else T.Q3_K
    if ftype == "Q3_K_M":
        return T.Q5_K if i < n // 16 else T.Q4_K if (not falcon or use_more_bits(i, n)) else T.Q3_K
    if ftype == "IQ3_M" and (i < n // 8 or (facts.n_expert == 8 and use_more_bits(i, n))):
        return T.Q4_K
    if ftype == "Q3_K_L":
        return T.Q4_K if falcon else T.Q5_K
    if ftype == "Q4_K_M":
        if falcon:
            return T.Q6_K if i < n // 16 else T.Q5_K if use_more_bits(i, n) else T.Q4_K
        return T.Q6_K if use_more_bits(i, n) else new
    if ftype in ("IQ4_NL", "IQ4_XS") and i < n // 8 and not has_imatrix:
        return T.Q5_K
    if ftype == "Q5_K_M":
        return T.Q6_K if use_more_bits(i, n) else new
    if ftype == "Q4_K_S":
        return T.Q5_K if not falcon and i < n // 8 else new
    if ftype in ("Q4_0", "Q5_0") and has_imatrix and i < n // 8:
        return T.Q4_1 if ftype == "Q4_0" else T.Q5_1
    return new


# attn_output of an 8-expert model: Q5_K for these mixes
EXPERT8_ATTN_OUTPUT_Q5_K = ("Q2_K", "IQ3_XS", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M",
                            "IQ3_S", "IQ3_M", "IQ4_XS")


def attn_output_type(ftype: str, new: T, facts: ModelFacts) -> T:
    if facts.arch == "falcon":
        return T.Q4_K if ftype == "Q3_K_L" else new
    if facts.n_expert == 8:
        return T.Q5_K if ftype in EXPERT8_ATTN_OUTPUT_Q5_K else new
    return {"Q2_K": T.Q3_K, "IQ3_XXS": T.IQ3_S, "Q3_K_M": T.Q4_K, "Q3_K_L": T.Q5_K, "IQ3_M": T.Q4_K}.get(ftype, new)


def needs_imatrix(types: dict[str, T]) -> list[str]:
    """The tensors llama.cpp will not quantize without an imatrix (tensor_requires_imatrix)."""
    return [n for n, t in types.items() if t in IMATRIX_TYPES and category(n) not in ("output", "token_embd")]


def missing_kernels(types: dict[str, T], supported) -> list[str]:
    """Names of the ggml types in `types` that are not in `supported` (quantkit.gguf.quants.SUPPORTED)."""
    return sorted({t.name for t in types.values() if t not in supported})


def type_counts(types: dict[str, T]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in types.values():
        counts[t.name] = counts.get(t.name, 0) + 1
    return dict(sorted(counts.items()))


# tensor_allows_quantization's names the converter writes at its output type (not F32): llama-quantize keeps
# them as its input file has them (Gemma 4's per_layer_model_proj)
KEPT_AS_CONVERTED = ("per_layer_model_proj",)
# ModelBase.prepare_tensors: the weights the converter writes F32 whatever their shape (norms, routers and the
# shared-expert gate, conv kernels, positional embeddings; those that can occur here)
CONVERTER_F32 = ("_norm.weight", "ffn_gate_inp", "ssm_conv1d", "shortconv.conv", "position_embd", "token_types",
                 "time_mix_", "altup")


def kept_as_converted(name: str, shape: tuple[int, ...]) -> bool:
    """A 2-D weight llama-quantize never quantizes and the converter writes at its output type: the names above,
    and a single-row weight (ggml_n_dims 1) outside the converter's F32 ones."""
    if len(shape) < 2 or not name.endswith("weight"):
        return False
    single_row = n_dims(shape) < 2 and not any(s in name for s in CONVERTER_F32)
    return single_row or any(s in name for s in KEPT_AS_CONVERTED)
