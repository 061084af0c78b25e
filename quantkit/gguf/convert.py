"""HF checkpoint (local safetensors) -> GGUF, streamed one tensor at a time.

What convert_hf_to_gguf.py + llama-quantize do in two passes, in one: names through gguf-py's
TensorNameMap, Q/K rows permuted for the llama architecture (LlamaModel.permute), metadata as
TextModel.set_gguf_parameters writes it, the tokenizer (quantkit.gguf.vocab), and every tensor
quantized to the type quantkit.gguf.mixture chooses (llama-quantize's rules).

Streaming: all tensor infos are added first (shapes and types are known from the safetensors
header), then header, metadata and tensor infos are written, then each tensor is read from the
safetensors file with plain reads (SafetensorsRows: no mmap, no torch) in row slabs for large
tensors, quantized and appended. Peak memory is about one quantized tensor plus one slab of
float32 rows on top of the interpreter, numpy, numba and gguf-py.

Numerics: every source weight is converted to float32 exactly (bf16/f16 -> f32 is exact) and
quantized from those values. llama-quantize quantizes from whatever its input GGUF holds: an F16
GGUF of a bf16 checkpoint has already rounded the weights to f16, a BF16 or F32 GGUF has not.
So quantkit's output equals `convert_hf_to_gguf.py --outtype bf16|f32` + `llama-quantize`
for bf16/f32 checkpoints, and equals `--outtype f16` + `llama-quantize` for f16 checkpoints.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from quantkit.errors import InputError, UnsupportedError
from quantkit.gguf import mixture
from quantkit.gguf.mixture import T


@dataclass(frozen=True)
class ArchSpec:
    gguf_arch: str  # gguf.MODEL_ARCH member name
    permute_qk: bool  # llama.cpp LLAMA_ROPE_TYPE_NORM: undo HF's rotate_half layout
    vocab_size_key: bool = False  # LlamaModel.set_gguf_parameters adds vocab_size and rope dims
    gemma: int = 0  # GemmaModel (1) / Gemma2Model (2): own metadata, norm weights + 1, lm_head dropped


# HF `architectures[0]` -> how llama.cpp converts it (convert_hf_to_gguf.py's registrations)
ARCHITECTURES: dict[str, ArchSpec] = {
    "LlamaForCausalLM": ArchSpec("LLAMA", True, True),
    "MistralForCausalLM": ArchSpec("LLAMA", True, True),
    "Qwen2ForCausalLM": ArchSpec("QWEN2", False),
    "Qwen3ForCausalLM": ArchSpec("QWEN3", False),
    "GemmaForCausalLM": ArchSpec("GEMMA", False, gemma=1),
    "Gemma2ForCausalLM": ArchSpec("GEMMA2", False, gemma=2),
}
# HF names that are not weights (convert_hf_to_gguf.py skips them too)
SKIPPED = re.compile(r"(rotary_emb\.inv_freq|\.attention\.masked_bias|\.attention\.bias)$")
SLAB_ELEMENTS = 1 << 22  # rows read per slab: about 16 MiB of float32


@dataclass
class TensorPlan:
    name: str  # GGUF name
    hf_name: str
    shape: tuple[int, ...]  # numpy order
    qtype: T
    permute_heads: int | None = None  # rows permuted in groups of this many heads
    norm_shift: bool = False  # Gemma: stored weight = HF weight + 1 (HF's RMSNorm scales by 1 + w)


@dataclass
class ConvertResult:
    path: Path
    gguf_type: str
    type_counts: dict[str, int]
    tensors: int
    bytes: int
    vocab: dict = field(default_factory=dict)
    imatrix_tensors: int = 0


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def arch_spec(config: dict) -> ArchSpec:
    archs = config.get("architectures") or []
    arch = archs[0] if archs else config.get("model_type", "?")
    if arch not in ARCHITECTURES:
        raise UnsupportedError(
            f"GGUF conversion does not support architecture '{arch}'",
            hint="supported: " + ", ".join(supported_architectures()),
        )
    return ARCHITECTURES[arch]


def gguf_arch_name(spec: ArchSpec) -> str:
    import gguf

    return gguf.MODEL_ARCH_NAMES[getattr(gguf.MODEL_ARCH, spec.gguf_arch)]


def model_facts(config: dict) -> mixture.ModelFacts:
    spec = arch_spec(config)
    n_head = config["num_attention_heads"]
    return mixture.ModelFacts(
        arch=gguf_arch_name(spec), n_layer=config["num_hidden_layers"], n_head=n_head,
        n_head_kv=config.get("num_key_value_heads") or n_head,
        n_expert=config.get("num_local_experts") or config.get("num_experts") or 0,
    )


# ------------------------------------------------------------------ names


def name_map(config: dict):
    import gguf

    spec = arch_spec(config)
    return gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, spec.gguf_arch), config["num_hidden_layers"])


def gguf_name(tmap, hf_name: str) -> str:
    name = tmap.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise UnsupportedError(f"cannot map tensor '{hf_name}' to a GGUF name")
    return name


def permute_heads(config: dict, hf_name: str) -> int | None:
    """Head count whose row groups LlamaModel.permute interleaves (q: n_head, k: n_head_kv)."""
    if not arch_spec(config).permute_qk:
        return None
    if re.search(r"q_proj\.(weight|bias)$", hf_name):
        return config["num_attention_heads"]
    if re.search(r"k_proj\.(weight|bias)$", hf_name):
        return config.get("num_key_value_heads") or config["num_attention_heads"]
    return None


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """LlamaModel.permute: HF rotate_half row order -> interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Inverse of `permute`."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def skipped(config: dict, hf_name: str) -> bool:
    """Tensors convert_hf_to_gguf.py does not write (Gemma: lm_head, the output is the tied embedding)."""
    return bool(SKIPPED.search(hf_name)) or (arch_spec(config).gemma > 0 and hf_name == "lm_head.weight")


def norm_shift(config: dict, hf_name: str) -> bool:
    """GemmaModel / Gemma2Model.modify_tensors: `if name.endswith("norm.weight"): data_torch + 1`."""
    return arch_spec(config).gemma > 0 and hf_name.endswith("norm.weight")


def plan_tensors(config: dict, hf_tensors: dict[str, tuple[str, list[int]]], gguf_type: str,
                 has_imatrix: bool = False) -> list[TensorPlan]:
    """One TensorPlan per written tensor, in llama-quantize's tensor order."""
    tmap = name_map(config)
    names = {gguf_name(tmap, n): n for n in hf_tensors if not skipped(config, n)}
    shapes = {g: tuple(hf_tensors[h][1]) for g, h in names.items()}
    types = mixture.choose_types(shapes, gguf_type, model_facts(config), has_imatrix)
    return [TensorPlan(g, names[g], shapes[g], types[g], permute_heads(config, names[g]),
                       norm_shift(config, names[g]))
            for g in mixture.llama_order(names)]


# ------------------------------------------------------------------ metadata


def rope_parameters(config: dict) -> dict:
    params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    if "rope_theta" in config and "rope_theta" not in params:
        params["rope_theta"] = config["rope_theta"]
    return params


def add_metadata(writer, config: dict, name: str, ftype) -> None:
    """TextModel.set_gguf_parameters (+ LlamaModel's extras) for the supported decoders."""
    import gguf

    spec = arch_spec(config)
    n_head = config["num_attention_heads"]
    writer.add_name(name)
    writer.add_type(gguf.GGUFType.MODEL)
    if spec.gemma:
        add_gemma_metadata(writer, config, spec.gemma, ftype)
        return
    writer.add_block_count(config["num_hidden_layers"])
    if (n_ctx := config.get("max_position_embeddings")) is not None:
        writer.add_context_length(n_ctx)
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(config.get("num_key_value_heads") or n_head)
    add_rope(writer, rope_parameters(config))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    if (head_dim := config.get("head_dim")) is not None:
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
    writer.add_file_type(int(ftype))
    if spec.vocab_size_key:
        writer.add_vocab_size(config["vocab_size"])
        writer.add_rope_dimension_count(config.get("head_dim") or config["hidden_size"] // n_head)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def add_gemma_metadata(writer, config: dict, version: int, ftype) -> None:
    """GemmaModel / Gemma2Model.set_gguf_parameters (they do not call TextModel's: no RoPE keys)."""
    import gguf

    n_head = config["num_attention_heads"]
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(config["num_key_value_heads"] if "num_key_value_heads" in config else n_head)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_file_type(int(ftype))
    if version == 2:
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
        writer.add_sliding_window(config["sliding_window"])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


def add_gemma_vocab_extras(writer, model_dir: Path, version: int) -> None:
    """GemmaModel.set_vocab's CodeGemma special tokens (Gemma 1 only) and add_space_prefix = false."""
    import gguf

    if version == 1:
        special = gguf.SpecialVocab(model_dir, load_merges=False,
                                    special_token_types=["prefix", "suffix", "middle", "fsep", "eot"])
        for kind, tid in (("prefix", 67), ("suffix", 69), ("middle", 68), ("fsep", 70), ("eot", 107)):
            special._set_special_token(kind, tid)
        special.chat_template = None  # written once already, by add_vocab
        special.add_to_gguf(writer, quiet=True)
    writer.add_add_space_prefix(False)


def add_rope(writer, rope: dict) -> None:
    import gguf

    kind, factor = rope.get("rope_type") or rope.get("type"), rope.get("factor")
    if kind == "linear" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(factor)
    elif kind == "yarn" and factor is not None:
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(factor)
        writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    elif kind not in (None, "default"):
        raise UnsupportedError(f"RoPE scaling type '{kind}' is not supported by quantkit's GGUF converter",
                               hint="supported: default, linear, yarn")
    if (theta := rope.get("rope_theta")) is not None:
        writer.add_rope_freq_base(theta)


# ------------------------------------------------------------------ tensor data


def quantize_rows(data: np.ndarray, qtype: T, imatrix: np.ndarray | None = None, threads: int = 1) -> np.ndarray:
    """float32 rows -> GGUF bytes (uint8 rows) or f32/f16 arrays, through quantkit's kernels."""
    import gguf

    if qtype == T.F32:
        return np.ascontiguousarray(data, dtype=np.float32)
    if qtype == T.F16:
        return data.astype(np.float16)
    try:
        from quantkit.gguf.quants import quantize
    except ImportError:  # kernels not installed: gguf-py covers BF16, Q8_0 and the legacy types
        if imatrix is not None and qtype not in (T.BF16, T.Q8_0):
            raise UnsupportedError(f"{qtype.name} with an imatrix needs quantkit.gguf.quants") from None
        return gguf.quants.quantize(data, qtype)
    return quantize(np.ascontiguousarray(data, dtype=np.float32), qtype, imatrix, threads=threads)


def tensor_nbytes(shape: tuple[int, ...], qtype: T) -> int:
    import gguf

    return int(np.prod(gguf.quant_shape_to_byte_shape(shape, qtype))) if qtype not in (T.F32, T.F16) \
        else int(np.prod(shape)) * (4 if qtype == T.F32 else 2)


def numpy_dtype(qtype: T):
    return {T.F32: np.float32, T.F16: np.float16}.get(qtype, np.float32)


class SafetensorsRows:
    """Rows of the tensors of one .safetensors file, read with plain file reads into numpy.

    No torch and no mmap: the converter's memory is its working set (one slab), not the pages of
    the checkpoint it has visited (a memory map keeps every page it touched resident, which for
    a 250 MB checkpoint was a third of the peak RSS), and `import torch` (~200 MiB) is skipped.
    F32 / F16 / BF16 are decoded here (bf16 -> f32 is a 16-bit shift, exact); other dtypes go
    through safetensors' torch reader.
    """

    DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}

    def __init__(self, path: Path):
        import json
        import struct

        self.path = Path(path)
        with open(self.path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            self.header = json.loads(f.read(n))
        self.header.pop("__metadata__", None)
        self.base = 8 + n
        self._file = None
        self._torch = None

    def keys(self):
        return self.header.keys()

    def read(self, name: str, start: int, stop: int) -> np.ndarray:
        """float32 rows start:stop of a tensor (the whole tensor when it is 1-D)."""
        entry = self.header[name]
        shape, raw = list(entry["shape"]), self.DTYPES.get(entry["dtype"])
        if raw is None:
            return self._read_torch(name, shape, start, stop)
        if len(shape) <= 1:  # read whole, as one row
            start, stop, row_shape = 0, 1, tuple(shape)
        else:
            row_shape = tuple(shape[1:])
        row = int(np.prod(row_shape, dtype=np.int64))
        buf = np.empty((stop - start) * row, dtype=raw)
        if self._file is None:
            self._file = open(self.path, "rb")
        self._file.seek(self.base + entry["data_offsets"][0] + start * row * buf.itemsize)
        if self._file.readinto(memoryview(buf).cast("B")) != buf.nbytes:
            raise InputError(f"{self.path.name}: tensor '{name}' is truncated")
        if raw is np.uint16:  # bf16: the high half of a float32
            out = buf.astype(np.uint32)
            out <<= 16
            data = out.view(np.float32)
        else:
            data = buf.astype(np.float32, copy=False)
        return data.reshape(row_shape if len(shape) <= 1 else (stop - start, *row_shape))

    def _read_torch(self, name, shape, start, stop):
        import torch
        from safetensors import safe_open

        if self._torch is None:
            self._torch = safe_open(str(self.path), framework="pt")
        sl = self._torch.get_slice(name)
        part = sl[start:stop] if len(shape) > 1 else sl[:]
        return part.to(torch.float32).numpy()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._torch = None


def read_rows(handle: SafetensorsRows, plan: TensorPlan, start: int, stop: int) -> np.ndarray:
    return handle.read(plan.hf_name, start, stop)


def shift_norm(data: np.ndarray, source_dtype: str) -> np.ndarray:
    """w + 1 as convert_hf_to_gguf.py computes it: in float32 for F32/BF16 sources (it casts bf16
    to float32 before modify_tensors), in float16 for F16 sources (torch half add, then exact f32)."""
    if source_dtype == "F16":
        return (data.astype(np.float16) + np.float16(1)).astype(np.float32)
    return data + np.float32(1)


def tensor_data(handle, plan: TensorPlan, imatrix: np.ndarray | None, threads: int = 1) -> np.ndarray:
    """Read, permute and quantize one tensor, slab by slab."""
    rows = plan.shape[0] if len(plan.shape) > 1 else 1
    if len(plan.shape) == 1 or plan.permute_heads or plan.norm_shift:
        data = read_rows(handle, plan, 0, rows)
        if plan.permute_heads:
            data = permute(data, plan.permute_heads)
        if plan.norm_shift:
            data = shift_norm(data, handle.header[plan.hf_name]["dtype"])
        return quantize_rows(data, plan.qtype, imatrix, threads)
    step = max(1, SLAB_ELEMENTS // max(1, plan.shape[-1]))
    parts = [quantize_rows(read_rows(handle, plan, r, min(rows, r + step)), plan.qtype, imatrix, threads)
             for r in range(0, rows, step)]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def imatrix_for(plan: TensorPlan, imatrix: dict | None) -> np.ndarray | None:
    """The tensor's importance vector, when it is quantized (llama-quantize's size check)."""
    if not imatrix or plan.qtype in (T.F32, T.F16, T.BF16) or plan.name not in imatrix:
        return None
    values = np.asarray(imatrix[plan.name], dtype=np.float32)
    if values.size != plan.shape[-1]:
        if plan.name == "token_embd.weight":
            return None
        raise InputError(f"imatrix size {values.size} differs from the row size {plan.shape[-1]} of {plan.name}")
    return values


# ------------------------------------------------------------------ driver


def open_handles(files: list[Path]) -> dict[str, SafetensorsRows]:
    handles = {}
    for f in files:
        h = SafetensorsRows(Path(f))
        for key in h.keys():
            handles[key] = h
    return handles


def convert(model_dir: Path, out_path: Path, gguf_type: str = "F16", imatrix: dict | None = None,
            name: str | None = None, progress: Callable[[str], None] = lambda m: None,
            threads: int = 1) -> ConvertResult:
    """Write `out_path` (.gguf) from the checkpoint in model_dir; returns what was written."""
    import gguf

    from quantkit.gguf.vocab import add_vocab
    from quantkit.model import check_model_dir

    info = check_model_dir(Path(model_dir))
    key, ftype, _ = mixture.file_type(gguf_type)
    plans = plan_tensors(info.config, info.tensors, key, has_imatrix=bool(imatrix))
    spec = arch_spec(info.config)
    writer = gguf.GGUFWriter(str(out_path), gguf_arch_name(spec))
    add_metadata(writer, info.config, name or Path(model_dir).name, ftype)
    vocab = add_vocab(writer, info.path, info.config.get("vocab_size"), prefer_sentencepiece=spec.gemma > 0)
    if spec.gemma:
        add_gemma_vocab_extras(writer, Path(info.path), spec.gemma)
    for p in plans:
        writer.add_tensor_info(p.name, p.shape, np.dtype(numpy_dtype(p.qtype)), tensor_nbytes(p.shape, p.qtype),
                               raw_dtype=None if p.qtype in (T.F32, T.F16) else p.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    handles = open_handles(info.weight_files)
    used = 0
    for i, p in enumerate(plans):
        progress(f"[{i + 1}/{len(plans)}] {p.name} -> {p.qtype.name}")
        weights = imatrix_for(p, imatrix)
        used += weights is not None
        writer.write_tensor_data(tensor_data(handles[p.hf_name], p, weights, threads))
    writer.close()
    for h in set(handles.values()):
        h.close()
    counts = mixture.type_counts({p.name: p.qtype for p in plans})
    return ConvertResult(Path(out_path), key, counts, len(plans), Path(out_path).stat().st_size,
                         vocab.__dict__, used)
