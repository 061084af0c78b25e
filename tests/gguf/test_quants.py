"""quantkit.gguf.quants: round trips, golden blocks from llama.cpp, live comparison."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import quant_shape_to_byte_shape

from quantkit.errors import InputError, UnsupportedError
from quantkit.gguf import quants

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "data" / "gguf_golden" / "golden.npz"
QUANT_TYPES = [QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1, QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K]
ALL_TYPES = [QT.F32, QT.F16, QT.BF16, *QUANT_TYPES]

# relative RMS error bound on gaussian data (observed values are ~25-40% lower)
MAX_REL_RMSE = {
    QT.F32: 0.0, QT.F16: 1e-3, QT.BF16: 5e-3, QT.Q8_0: 0.01, QT.Q6_K: 0.03, QT.Q5_0: 0.06,
    QT.Q5_1: 0.06, QT.Q5_K: 0.05, QT.Q4_0: 0.12, QT.Q4_1: 0.11, QT.Q4_K: 0.10, QT.Q3_K: 0.22,
    QT.Q2_K: 0.45,
}


@pytest.fixture(scope="module")
def gaussian():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 1024)).astype(np.float32)
    imatrix = rng.gamma(1.0, 1.0, 1024).astype(np.float32)
    return x, imatrix


@pytest.mark.parametrize("use_imatrix", [False, True], ids=["ref", "imatrix"])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_round_trip_error(qtype, use_imatrix, gaussian):
    x, imatrix = gaussian
    q = quants.quantize(x, qtype, imatrix if use_imatrix else None)
    assert q.dtype == np.uint8
    assert q.shape == quant_shape_to_byte_shape(x.shape, qtype)
    back = quants.dequantize(q, qtype)
    rel = np.sqrt(np.mean((back - x) ** 2) / np.mean(x ** 2))
    assert rel <= MAX_REL_RMSE[qtype]


def test_leading_dims_and_threads(gaussian):
    x, imatrix = gaussian
    x3 = x.reshape(2, 4, 1024)
    single = quants.quantize(x3, QT.Q4_K, imatrix)
    assert single.shape == (2, 4, 4 * 144)
    old = quants.CHUNK_ELEMS
    quants.CHUNK_ELEMS = 1024  # one row per work item
    try:
        threaded = quants.quantize(x3, QT.Q4_K, imatrix, threads=2)
    finally:
        quants.CHUNK_ELEMS = old
    np.testing.assert_array_equal(single, threaded)


def test_unsupported_type_names_supported_ones():
    with pytest.raises(UnsupportedError, match="Q4_K"):
        quants.quantize(np.zeros((1, 256), np.float32), QT.Q8_1)


def test_row_not_multiple_of_block():
    with pytest.raises(UnsupportedError, match="multiple of 256"):
        quants.quantize(np.zeros((2, 320), np.float32), QT.Q4_K)
    assert quants.quantize(np.zeros((2, 320), np.float32), QT.Q8_0).shape == (2, 340)


def test_bad_imatrix_shape():
    with pytest.raises(InputError):
        quants.quantize(np.zeros((1, 256), np.float32), QT.Q4_K, np.ones(128, np.float32))


def test_nearest_int_matches_magic_trick():
    f = np.array([0.5, 1.5, 2.5, -0.5, -1.5, 3.4999998, -7.5, 4194303.0], dtype=np.float32)
    np.testing.assert_array_equal(quants.nearest_int(f), [0, 2, 2, 0, -2, 3, -8, 4194303])


def test_numba_nearest_int_equals_numpy():
    from quantkit.gguf import kquants_numba

    f = np.array([0.5, -2.5, 1e30, -1e30, np.inf, -np.inf, np.nan, 1e-40, 8388607.5, -4194304.5], np.float32)
    assert [kquants_numba.nint(v) for v in f] == quants.nearest_int(f).tolist()


@pytest.mark.parametrize("use_imatrix", [False, True], ids=["ref", "imatrix"])
def test_backends_agree_on_edge_blocks(use_imatrix, monkeypatch):
    """Compiled whole-row kernels vs the numpy kernels on zero, constant, tiny and huge blocks."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((6, 512)).astype(np.float32)
    x[0] = 0
    x[1, :256] = 0.25
    x[2] *= 1e-20
    x[3] *= 1e10  # larger overflows float32 in x*x*x*l (numba then matches llama.cpp, numpy not)
    x[4, ::7] = 0
    x[5, :128] = -x[5, 128:256]
    qw = rng.gamma(0.5, 1.0, 512).astype(np.float32) if use_imatrix else None
    for qtype in quants._FUSED:
        with np.errstate(all="ignore"):  # d overflows fp16 on the 1e10 row (inf, as in C)
            fused = quants.quantize(x, qtype, qw)
            monkeypatch.setattr(quants, "BACKEND", "numpy")
            expected = quants.quantize(x, qtype, qw)
        monkeypatch.setattr(quants, "BACKEND", "numba")
        np.testing.assert_array_equal(fused, expected, err_msg=qtype.name)


# ------------------------------------------------------------------ golden blocks

@pytest.fixture(scope="module")
def golden():
    return np.load(GOLDEN)


@pytest.mark.parametrize("use_imatrix", [False, True], ids=["ref", "imatrix"])
@pytest.mark.parametrize("qtype", [*QUANT_TYPES, QT.F16, QT.BF16], ids=lambda t: t.name)
def test_golden_blocks_bit_exact(qtype, use_imatrix, golden, backend):
    x, imatrix = golden["x"], golden["imatrix"]
    expected = golden[qtype.name + ("_imatrix" if use_imatrix else "")]
    got = quants.quantize(x, qtype, imatrix if use_imatrix else None)
    bad_rows = np.nonzero((got != expected).any(axis=1))[0]
    assert bad_rows.size == 0, f"{qtype.name}: rows {bad_rows.tolist()} differ from llama.cpp"


# -------------------------------------------------- live comparison with llama.cpp

@pytest.mark.parametrize("use_imatrix", [False, True], ids=["ref", "imatrix"])
@pytest.mark.parametrize("qtype", QUANT_TYPES, ids=lambda t: t.name)
def test_live_bit_exact_with_llamacpp(qtype, use_imatrix, ggml):
    harness, lib = ggml
    rng = np.random.default_rng(int(qtype) * 2 + use_imatrix)
    x = (rng.standard_t(4, (16, 1024)) * rng.uniform(0.005, 0.1, (16, 1))).astype(np.float32)
    imatrix = rng.gamma(0.5, 1.0, 1024).astype(np.float32) if use_imatrix else None
    expected = harness.ggml_quantize(lib, x, qtype, imatrix)
    np.testing.assert_array_equal(quants.quantize(x, qtype, imatrix), expected)


def test_live_fused_kernels_on_extreme_blocks(ggml):
    """The compiled kernels also match llama.cpp where float32 overflows (|x| ~ 1e20)."""
    harness, lib = ggml
    rng = np.random.default_rng(7)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    x[0] = 0
    x[1] *= 1e-20
    x[2] *= 1e20
    x[3, :256] = -3.0
    for qtype in quants._FUSED:
        for qw in (None, rng.gamma(0.5, 1.0, 512).astype(np.float32)):
            with np.errstate(all="ignore"):
                got = quants.quantize(x, qtype, qw)
            np.testing.assert_array_equal(got, harness.ggml_quantize(lib, x, qtype, qw), err_msg=qtype.name)
