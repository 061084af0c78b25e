"""Grid i-quants (IQ3_XXS ... IQ1_M): tables, bytes equal to llama.cpp's, round trips."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import quant_shape_to_byte_shape

from quantkit.errors import InputError
from quantkit.gguf import iquant_tables, iquants_grid, quants
from tests.gguf.helpers import load_script

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "data" / "gguf_golden" / "golden_iq_grid.npz"
GGML_SRC = ROOT / "third_party" / "llama.cpp" / "src" / "ggml" / "src"
TYPES = [QT.IQ3_XXS, QT.IQ3_S, QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ1_S, QT.IQ1_M]
PLAIN_OK = [t for t in TYPES if t not in quants.REQUIRES_IMATRIX]
CASES = [(t, True) for t in TYPES] + [(t, False) for t in PLAIN_OK]


def _ids(cases):
    return [f"{t.name}-{'imatrix' if w else 'plain'}" for t, w in cases]


CASE_IDS = _ids(CASES)

# ggml_quantize_init builds these grids' neighbour maps with qsort: 5-40 s per type, paid by the
# first llama.cpp call in the process, so their live comparisons run with the slow tests
SLOW_GGML_INIT = (QT.IQ2_XXS, QT.IQ2_XS, QT.IQ2_S, QT.IQ1_S, QT.IQ1_M)
FAST_CASES = [c for c in CASES if c[0] not in SLOW_GGML_INIT]

# relative RMS error bound, normal and heavy-tailed rows with an imatrix (observed 10-20% lower)
MAX_REL_RMSE = {QT.IQ3_S: 0.19, QT.IQ3_XXS: 0.33, QT.IQ2_S: 0.36, QT.IQ2_XS: 0.5, QT.IQ2_XXS: 0.53,
                QT.IQ1_M: 0.64, QT.IQ1_S: 0.68}


@pytest.fixture(scope="module")
def harness(ggml):
    return ggml[0]


@pytest.fixture(scope="module")
def lib(ggml):
    return ggml[1]


def _data(rows: int, n: int, seed: int):
    """Normal rows, heavy-tailed weight-like rows (the first with zero runs of 16 and 32 values:
    all-zero sub-blocks) and an imatrix with zero columns."""
    rng = np.random.default_rng(seed)
    x = np.concatenate([rng.standard_normal((rows, n)) * 0.05, rng.standard_t(3, (rows, n)) * 0.02])
    x[rows, 64:96] = 0.0
    x[rows, 272:288] = 0.0
    imatrix = rng.gamma(0.7, 1.0, n) + 1e-3
    imatrix[rng.random(n) < 0.03] = 0.0
    return x.astype(np.float32), imatrix.astype(np.float32)


# ------------------------------------------------------------------ tables

def test_tables_match_llamacpp_source():
    """iquant_tables equals the kgrid_* tables of ggml-quants.c, and decodes to ggml-common.h's grids."""
    if not (GGML_SRC / "ggml-quants.c").exists():
        pytest.skip("llama.cpp source not present (third_party/llama.cpp/src)")
    gen = load_script("make_iquant_tables")
    kgrids = gen.read_kgrids(GGML_SRC / "ggml-quants.c")
    for c_name, (py_name, _) in gen.TABLES.items():
        assert tuple(kgrids[c_name]) == getattr(iquant_tables, py_name), py_name
    common = (GGML_SRC / "ggml-common.h").read_text()
    for qtype, name, width in ((QT.IQ2_XXS, "iq2xxs_grid", 8), (QT.IQ2_XS, "iq2xs_grid", 8),
                               (QT.IQ2_S, "iq2s_grid", 8), (QT.IQ1_S, "iq1s_grid", 8),
                               (QT.IQ3_XXS, "iq3xxs_grid", 4), (QT.IQ3_S, "iq3s_grid", 4)):
        body = re.search(rf"GGML_TABLE_BEGIN\(uint\d+_t, {name}, \w+\)(.*?)GGML_TABLE_END", common, re.DOTALL).group(1)
        values = np.array([int(v, 16) for v in re.findall(r"0x[0-9a-f]+", body)], dtype=np.uint64)
        dequant = values.view(np.uint8).reshape(-1, 8)[:, :width] if width == 8 else \
            values.astype(np.uint32).view(np.uint8).reshape(-1, 4)
        levels = (iquants_grid.grid_points(iquants_grid.GRIDS[qtype]).astype(np.int32) - 1) // 2
        assert dequant.shape == levels.shape, name
        # one dequantized byte per level, increasing with the level (iq1s: -1, 0, 1 as int8)
        lut = {}
        for lv, dq in zip(levels.ravel(), dequant.ravel()):
            assert lut.setdefault(int(lv), int(dq)) == int(dq), (name, lv)
        seq = [np.int8(np.uint8(lut[k])) if qtype == QT.IQ1_S else lut[k] for k in sorted(lut)]
        assert seq == sorted(seq), name


@pytest.mark.parametrize("qtype", [QT.IQ3_XXS, QT.IQ3_S], ids=lambda t: t.name)
def test_neighbour_lists_are_the_nearest_points(qtype):
    """Each off-grid key lists exactly the grid points at its nwant smallest distances,
    ordered by (distance, index), as C's qsort of (d2, index) pairs leaves them."""
    spec = iquants_grid.GRIDS[qtype]
    grid, kmap, neigh = iquants_grid.grid_tables(qtype)
    assert (kmap >= 0).sum() == len(grid)
    for key in range(0, spec.nkeys, 37):
        if kmap[key] >= 0:
            assert iquants_grid.grid_points(spec)[kmap[key]].tolist() == grid[kmap[key]].tolist()
            continue
        pos = -kmap[key] - 1
        listed = neigh[pos + 1:pos + 1 + neigh[pos]].astype(int)
        point = np.array([2 * ((key >> (spec.bits * i)) & ((1 << spec.bits) - 1)) + 1 for i in range(spec.dim)])
        d2 = ((grid.astype(int) - point) ** 2).sum(axis=1)
        keep = np.unique(d2)[:spec.nwant]
        expected = sorted(np.nonzero(np.isin(d2, keep))[0], key=lambda j: (d2[j], j))
        assert listed.tolist() == expected


# ------------------------------------------------------------------ bytes

@pytest.mark.parametrize(("qtype", "use_imatrix"), CASES, ids=CASE_IDS)
def test_golden_blocks(qtype, use_imatrix):
    """Blocks stored from llama.cpp's ggml_quantize_chunk (edge-case rows; no build needed)."""
    golden = np.load(GOLDEN)
    key = qtype.name + ("_imatrix" if use_imatrix else "")
    got = quants.quantize(golden["x"], qtype, golden["imatrix"] if use_imatrix else None)
    np.testing.assert_array_equal(got, golden[key])


@pytest.mark.parametrize(("qtype", "use_imatrix"), FAST_CASES, ids=_ids(FAST_CASES))
def test_bit_exact_with_llamacpp(qtype, use_imatrix, harness, lib):
    x, imatrix = _data(3, 768, seed=int(qtype))
    qw = imatrix if use_imatrix else None
    np.testing.assert_array_equal(quants.quantize(x, qtype, qw), harness.ggml_quantize(lib, x, qtype, qw))


@pytest.mark.slow
@pytest.mark.parametrize(("qtype", "use_imatrix"), CASES, ids=CASE_IDS)
def test_bit_exact_with_llamacpp_many_rows(qtype, use_imatrix, harness, lib):
    rng = np.random.default_rng(7)
    rows = harness.edge_rows(1024, rng)
    x, imatrix = _data(24, 1024, seed=100 + int(qtype))
    x = np.concatenate([np.stack(rows), x, np.round(x * 40) / 40]).astype(np.float32)
    qw = imatrix if use_imatrix else None
    np.testing.assert_array_equal(quants.quantize(x, qtype, qw, threads=2),
                                  harness.ggml_quantize(lib, x, qtype, qw))


# ------------------------------------------------------------------ round trips and contract

def _ggml_dequantize(lib, q: np.ndarray, qtype: QT, n: int) -> np.ndarray:
    fn = getattr(lib, f"dequantize_row_{qtype.name.lower()}")
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    q = np.ascontiguousarray(q)
    out = np.empty((q.shape[0], n), np.float32)
    fn(q.ctypes.data, out.ctypes.data, out.size)
    return out


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_gguf_py_dequantizes_like_ggml(qtype, lib):
    x, imatrix = _data(2, 512, seed=3)
    q = quants.quantize(x, qtype, imatrix)
    ours = quants.dequantize(q, qtype)
    np.testing.assert_array_equal(ours, _ggml_dequantize(lib, q, qtype, x.shape[1]))
    # row 2 has an all-zero sub-block: llama.cpp's IQ3_S then writes the later sub-blocks' grid
    # indices and signs one slot early (its dequantizer reads garbage there), so no error bound
    fine = np.delete(np.arange(len(x)), 2)
    rel = np.sqrt(np.mean((ours[fine] - x[fine]) ** 2) / np.mean(x[fine] ** 2))
    assert rel <= MAX_REL_RMSE[qtype]


def test_shapes_and_threads():
    x, imatrix = _data(4, 512, seed=5)
    x3 = x.reshape(2, 4, 512)
    single = quants.quantize(x3, QT.IQ2_XS, imatrix)
    assert single.shape == quant_shape_to_byte_shape(x3.shape, QT.IQ2_XS)
    old = quants.CHUNK_ELEMS
    quants.CHUNK_ELEMS = 512  # one row per work item
    try:
        threaded = quants.quantize(x3, QT.IQ2_XS, imatrix, threads=2)
    finally:
        quants.CHUNK_ELEMS = old
    np.testing.assert_array_equal(single, threaded)


@pytest.mark.parametrize("qtype", quants.REQUIRES_IMATRIX, ids=lambda t: t.name)
def test_imatrix_required(qtype):
    with pytest.raises(InputError, match="needs an imatrix"):
        quants.quantize(np.ones((1, 256), np.float32), qtype)
