"""GGUF quantization kernels, bit-exact with llama.cpp's ``ggml_quantize_chunk``.

gguf-py can write GGUF files and dequantize every type, but it cannot quantize the
k-quants. This module ports the reference quantizers of ``ggml/src/ggml-quants.c`` to
numpy, vectorized across blocks:

* without an imatrix: ``quantize_row_qX_ref`` (what ``quantize_qX`` calls when
  ``quant_weights == NULL``);
* with an imatrix: the weighted ``quantize_row_qX_impl`` paths (Q8_0 ignores it).

Matched llama.cpp: the copy vendored by llama-cpp-python 0.3.36 (llama.cpp commit
0c1e57098bba43ac29e6e3b677cdceebdd22334f); tests/data/gguf_golden holds blocks produced by
that build (see scripts/build_llamacpp.sh and scripts/make_gguf_golden.py).

Floating point rules followed to stay bit-exact:

* every value is float32 and every sum is sequential, left to right (``np.cumsum``
  accumulates in order; ``np.sum`` is pairwise and would round differently);
* ``nearest_int`` is the 1.5*2^23 magic-number trick of ggml, reproduced bit by bit;
* d/dmin are rounded to fp16 (round to nearest even, as ``GGML_FP32_TO_FP16``) and the
  *rounded* values are used when the quants are recomputed;
* C stores into ``uint8_t``/``int8_t`` wrap around; that is emulated where it can happen;
* no fused multiply-add: ggml-quants.c lives in ggml-base, which on x86-64 is compiled for
  the baseline ISA (no FMA, no F16C), so the default llama.cpp build (the one
  llama-cpp-python users get) never contracts ``a*b+c`` there. On aarch64 GCC contracts by
  default, so an ARM build of llama.cpp may differ from this module in rare last-bit cases;
  scripts/build_llamacpp.sh builds with ``-ffp-contract=off`` to keep the reference exact
  everywhere;
* make_qkx2/3_quants update ``min`` in place during the search, so later trial scales are
  measured from the best min found so far (easy to miss, changes ~80% of blocks).

Grid i-quants: IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S and IQ1_M run the compiled ports
of ``quantize_row_iq*_impl`` in ``iquants_grid_numba`` (grids and neighbour maps in
``iquants_grid``), bit-exact too; IQ2_XXS, IQ2_XS and IQ1_S need an imatrix, as in llama.cpp
(``REQUIRES_IMATRIX``; InputError without one).

Modules: this one is the public API (``quantize``, ``dequantize``, the type table, row
chunking and threads) and picks a kernel; ``kquants_numpy`` holds the numpy ports (searches,
bit packing, one kernel per type) and ``kquants_numba`` the compiled ones; the i-quants have one
numpy module and one numba module per family (``iquants`` / ``iquants_numba``: IQ4_NL, IQ4_XS),
each exposing ``KERNELS`` {type: kernel(rows, imatrix)}, merged into ``_IQ_NUMPY`` / ``_IQ_NUMBA``.

Speed: with numba installed (``BACKEND = "numba"``, compiled code cached on disk after the
first call) Q8_0, the k-quants Q2_K..Q6_K and the i-quants run as whole compiled kernels (search,
re-quantization and bit packing; ``_FUSED`` below), and the legacy Q4_0/Q4_1/Q5_0/Q5_1 run the
numpy kernels with the compiled scale searches. Without numba everything is vectorized numpy (``"numpy"``, ~3-10x
slower). All paths are bit-exact. ``quantize(..., threads=N)`` splits row chunks over N
threads (numba kernels and large numpy ops release the GIL).
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as _gguf_dequantize
from gguf.quants import quantize as _gguf_quantize

from quantkit.errors import InputError, UnsupportedError
from quantkit.gguf import iquants, iquants_grid_numba, iquants_numba, kquants_numba, kquants_numpy
from quantkit.gguf.kquants_numpy import fp16_bits, fp16_round, nearest_int, seq_sum  # noqa: F401 (API)

F32 = np.float32
QK_K = 256
CHUNK_ELEMS = 1 << 19  # elements per work item: bounds temporary memory

# i-quants: one entry per kernel module, kernel(x (rows, n_per_row) float32, qw or None) -> (blocks, bytes)
_IQ_NUMBA = {
    **iquants_numba.KERNELS,  # IQ4_NL, IQ4_XS
}
_IQ_NUMPY = {
    **iquants.KERNELS,  # IQ4_NL, IQ4_XS
}

# grid-based i-quants (iquants_grid_numba): kernel(x (rows, n_per_row), qw) -> (blocks, block_bytes);
# numba-compiled only (as plain Python they would take hours per tensor)
_GRID_IQUANTS = {
    QT.IQ3_XXS: iquants_grid_numba.iq3_xxs, QT.IQ3_S: iquants_grid_numba.iq3_s,
    QT.IQ2_XXS: iquants_grid_numba.iq2_xxs, QT.IQ2_XS: iquants_grid_numba.iq2_xs,
    QT.IQ2_S: iquants_grid_numba.iq2_s, QT.IQ1_S: iquants_grid_numba.iq1_s, QT.IQ1_M: iquants_grid_numba.iq1_m,
}
# llama.cpp refuses to quantize these without an imatrix (ggml_quantize_requires_imatrix)
REQUIRES_IMATRIX = (QT.IQ2_XXS, QT.IQ2_XS, QT.IQ1_S)

SUPPORTED = (
    QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1,
    QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K,
    *_IQ_NUMPY, *_GRID_IQUANTS,
)

_numba = kquants_numba.numba  # None when numba is not installed
# "numba": compiled kernels (FUSED types) and searches; "numpy": the vectorized fallback
BACKEND = "numba" if _numba is not None else "numpy"

# numpy kernels: kernel(x, qw, search) -> (blocks, block_bytes); 256-blocks get x as (-1, 256)
_NUMPY_KERNELS = {
    QT.Q8_0: kquants_numpy.q8_0, QT.Q4_0: kquants_numpy.q4_0, QT.Q4_1: kquants_numpy.q4_1,
    QT.Q5_0: kquants_numpy.q5_0, QT.Q5_1: kquants_numpy.q5_1, QT.Q2_K: kquants_numpy.q2_k,
    QT.Q3_K: kquants_numpy.q3_k, QT.Q4_K: kquants_numpy.q4_k, QT.Q5_K: kquants_numpy.q5_k,
    QT.Q6_K: kquants_numpy.q6_k,
}
_BLOCK_TYPES = (QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K)
# whole compiled kernels: kernel(x (rows, n_per_row), qw) -> (blocks, block_bytes)
_FUSED = {QT.Q8_0: kquants_numba.q8_0, QT.Q2_K: kquants_numba.q2_k, QT.Q3_K: kquants_numba.q3_k,
          QT.Q4_K: kquants_numba.q4_k, QT.Q5_K: kquants_numba.q5_k,
          QT.Q6_K: kquants_numba.q6_k}


def _check(data: np.ndarray, qtype, imatrix):
    if qtype not in SUPPORTED:
        names = ", ".join(t.name for t in SUPPORTED)
        raise UnsupportedError(f"GGUF type {QT(qtype).name} is not supported; supported: {names}",
                               hint="choose one of the supported types with --gguf-type")
    block_size, _ = GGML_QUANT_SIZES[qtype]
    n = data.shape[-1]
    if n % block_size != 0:
        raise UnsupportedError(
            f"{QT(qtype).name} needs rows that are a multiple of {block_size} values, got {n}",
            hint="use --auto-precision, which gives each tensor a type its rows allow, or a 32-value type such as Q8_0")
    if imatrix is not None and np.shape(imatrix) != (n,):
        raise InputError(f"imatrix has shape {np.shape(imatrix)}, expected ({n},)",
                         hint="the imatrix was computed for another model: use --imatrix auto")
    if qtype in _GRID_IQUANTS and _numba is None:
        raise UnsupportedError(f"{QT(qtype).name} needs numba (pip install numba)", hint="pip install numba")
    if imatrix is None and qtype in REQUIRES_IMATRIX:
        raise InputError(f"{QT(qtype).name} needs an imatrix (as in llama.cpp); pass one",
                         hint="use --imatrix auto (from the calibration text) or --imatrix FILE")


def _quantize_rows(x: np.ndarray, qtype, qw) -> np.ndarray:
    """Quantize a (rows, n_per_row) float32 chunk to (rows, row_bytes) uint8."""
    rows = x.shape[0]
    if qtype in _GRID_IQUANTS:
        return _GRID_IQUANTS[qtype](x, qw).reshape(rows, -1)
    if qtype in _IQ_NUMPY:
        return (_IQ_NUMBA if BACKEND == "numba" else _IQ_NUMPY)[qtype](x, qw).reshape(rows, -1)
    if BACKEND == "numba":
        if qtype in _FUSED:
            return _FUSED[qtype](x, qw).reshape(rows, -1)
        search = kquants_numba.SEARCH
    else:
        search = kquants_numpy.SEARCH
    kernel = _NUMPY_KERNELS[qtype]
    if qtype in _BLOCK_TYPES:
        x = x.reshape(-1, QK_K)
    return kernel(x, qw, search).reshape(rows, -1)


def _chunks(rows: int, n: int):
    step = max(1, CHUNK_ELEMS // n)
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


def quantize(data: np.ndarray, qtype: QT, imatrix: np.ndarray | None = None,
             *, threads: int = 1) -> np.ndarray:
    """Quantize float data along its last axis exactly like llama.cpp's ggml_quantize_chunk.

    data: float array (..., n_per_row). imatrix: None or (n_per_row,) per-column importance
    (selects the weighted quantize_row_*_impl paths; ignored by Q8_0/F16/BF16/F32; required by
    REQUIRES_IMATRIX: IQ2_XXS, IQ2_XS, IQ1_S).
    threads: row chunks are spread over this many threads (numpy releases the GIL).
    Returns uint8 of shape gguf.quant_shape_to_byte_shape(data.shape, qtype).
    """
    qtype = QT(qtype)
    data = np.asarray(data)
    _check(data, qtype, imatrix)
    x = np.ascontiguousarray(data, dtype=F32)
    if qtype in (QT.F32, QT.F16):
        dtype = F32 if qtype == QT.F32 else np.float16
        return x.astype(dtype).view(np.uint8)
    if qtype == QT.BF16:
        return _gguf_quantize(x, qtype).view(np.uint8)
    qw = None if imatrix is None else np.ascontiguousarray(imatrix, dtype=F32)
    x2 = x.reshape(-1, x.shape[-1])
    _, type_size = GGML_QUANT_SIZES[qtype]
    block_size = GGML_QUANT_SIZES[qtype][0]
    out = np.empty((x2.shape[0], x2.shape[1] // block_size * type_size), dtype=np.uint8)

    def work(span):
        out[span[0]:span[1]] = _quantize_rows(x2[span[0]:span[1]], qtype, qw)

    spans = _chunks(x2.shape[0], x2.shape[1])
    if threads > 1 and len(spans) > 1:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(work, spans))
    else:
        for span in spans:
            work(span)
    return out.reshape(*data.shape[:-1], out.shape[-1])


def dequantize(data: np.ndarray, qtype: QT) -> np.ndarray:
    """Bytes from quantize() back to float32 (delegates to gguf-py)."""
    return _gguf_dequantize(data, QT(qtype))
