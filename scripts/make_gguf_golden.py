#!/usr/bin/env python
"""Produce the golden GGUF quantization blocks in tests/data/gguf_golden/ from llama.cpp.

Needs the build from scripts/build_llamacpp.sh: it calls ``ggml_quantize_chunk`` (the
function llama-quantize uses) in third_party/llama.cpp/bin/libggml-base.so through ctypes,
so the bytes are exactly what llama-quantize writes for the same rows and imatrix.

One .npz per set of types (``SETS``: golden.npz for the k-quants and legacy types,
golden_iq4.npz for IQ4_NL/IQ4_XS, golden_iq_grid.npz for IQ3_XXS ... IQ1_M): inputs ``x``
(rows, n_per_row) float32, ``imatrix`` (n_per_row,), and per type the expected bytes ``<TYPE>``
(without imatrix; none for the types llama.cpp quantizes only with one) and ``<TYPE>_imatrix``
(with it), plus the llama.cpp version string. Run once per set; re-run after changing the
llama.cpp version:

    python scripts/make_gguf_golden.py [--out tests/data/gguf_golden] [--set golden_iq4]

The helpers ``load_ggml`` / ``ggml_quantize`` are also used by tests/gguf/test_quants.py
and scripts/bench_kquants.py.
"""

from __future__ import annotations

import argparse
import ctypes
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES

ROOT = Path(__file__).resolve().parent.parent
LLAMACPP = ROOT / "third_party" / "llama.cpp"
TYPES = (QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1,
         QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K, QT.F16, QT.BF16)
GRID_IQ_TYPES = (QT.IQ3_XXS, QT.IQ3_S, QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ1_S, QT.IQ1_M)
SETS = {"golden": TYPES, "golden_iq4": (QT.IQ4_NL, QT.IQ4_XS), "golden_iq_grid": GRID_IQ_TYPES}  # file -> types
IMATRIX_ONLY = (QT.IQ2_XXS, QT.IQ2_XS, QT.IQ1_S)  # llama.cpp refuses these without an imatrix: no plain entry


def load_ggml(root: Path = LLAMACPP):
    """ctypes handle on libggml-base.so of the llama.cpp build, or None when not built."""
    candidates = [root / "bin" / "libggml-base.so", root / "build" / "bin" / "libggml-base.so"]
    lib_path = next((p for p in candidates if p.exists()), None)
    if lib_path is None:
        return None
    lib = ctypes.CDLL(str(lib_path))
    fn = lib.ggml_quantize_chunk
    fn.restype = ctypes.c_size_t
    fn.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    return lib


def llamacpp_version(root: Path = LLAMACPP) -> str:
    for name in ("VERSION", "SOURCE"):
        if (root / name).exists():
            return (root / name).read_text().strip()
    return "unknown"


def ggml_quantize(lib, x: np.ndarray, qtype: QT, imatrix: np.ndarray | None = None) -> np.ndarray:
    """ggml_quantize_chunk(type, x, dst, 0, rows, n_per_row, imatrix) -> (rows, row_bytes) uint8."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    rows, n = x.shape
    block, size = GGML_QUANT_SIZES[qtype]
    out = np.zeros((rows, n // block * size), dtype=np.uint8)
    qw = None if imatrix is None else np.ascontiguousarray(imatrix, dtype=np.float32)
    qw_ptr = None if qw is None else qw.ctypes.data
    written = lib.ggml_quantize_chunk(int(qtype), x.ctypes.data, out.ctypes.data, 0, rows, n, qw_ptr)
    assert written == out.nbytes, (written, out.nbytes)
    return out


def edge_rows(n: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Rows of n values (n a multiple of 256) exercising the corner cases, block by block."""
    g = rng.standard_normal
    rows = [
        np.zeros(n),                                    # all-zero
        np.full(n, 0.3125),                             # constant positive
        np.full(n, -2.5),                               # constant negative
        -np.abs(g(n)),                                  # negative only
        np.abs(g(n)),                                   # positive only
        g(n) * 1e-6,                                    # tiny
        g(n) * 1e-9,                                    # below fp16 resolution of d
        g(n) * 300.0,                                   # large
        np.where(np.arange(n) % 97 == 5, 50.0, g(n) * 0.01),  # one huge outlier per block
        np.where(np.arange(n) % 32 < 16, 0.0, g(n)),    # half-zero sub-blocks
        np.round(g(n) * 4) / 4,                         # many exact ties
        rng.standard_t(3, n) * 0.02,                    # heavy tails, weight-like
    ]
    return [r.astype(np.float32) for r in rows]


def make_inputs(n: int, n_random: int, seed: int):
    rng = np.random.default_rng(seed)
    rows = edge_rows(n, rng)
    rows += [(rng.standard_normal(n) * rng.uniform(0.005, 0.2)).astype(np.float32) for _ in range(n_random)]
    x = np.stack(rows)
    imatrix = (rng.gamma(0.7, 1.0, n) + 1e-3).astype(np.float32)
    imatrix[:8] = 0.0  # llama.cpp imatrices can contain zero columns
    return x, imatrix


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / "gguf_golden")
    ap.add_argument("--n", type=int, default=512, help="values per row (multiple of 256)")
    ap.add_argument("--random-rows", type=int, default=12)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--set", choices=sorted(SETS), default="golden", help="which types (file name)")
    args = ap.parse_args()
    lib = load_ggml()
    if lib is None:
        raise SystemExit("llama.cpp build not found: run scripts/build_llamacpp.sh")
    args.out.mkdir(parents=True, exist_ok=True)
    x, imatrix = make_inputs(args.n, args.random_rows, args.seed)
    arrays = {"x": x, "imatrix": imatrix, "version": np.array(llamacpp_version())}
    types = SETS[args.set]
    for qtype in types:
        if qtype not in IMATRIX_ONLY:
            arrays[qtype.name] = ggml_quantize(lib, x, qtype)
        arrays[qtype.name + "_imatrix"] = ggml_quantize(lib, x, qtype, imatrix)
    path = args.out / f"{args.set}.npz"
    np.savez_compressed(path, **arrays)
    print(f"{path}: {x.shape[0]} rows x {x.shape[1]} values, "
          f"{len(types)} types with and without imatrix, {path.stat().st_size} bytes")

if __name__ == "__main__":
    main()
