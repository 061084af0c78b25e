"""quantkit.gguf.iquants / iquants_numba (IQ4_NL, IQ4_XS): golden blocks and live comparison with llama.cpp;
the files of every i-quant mix against llama-quantize, and llama-perplexity loading them (slow)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as QT
from gguf.quants import quant_shape_to_byte_shape

from quantkit.errors import UnsupportedError
from quantkit.gguf import iquants, quants

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = ROOT / "tests" / "data" / "gguf_golden" / "golden_iq4.npz"
IQ4 = [QT.IQ4_NL, QT.IQ4_XS]


def heavy_tailed(rng, rows: int, n: int) -> np.ndarray:
    """Weight-like rows: Student-t(3) values at per-row scales, a few large outliers."""
    x = rng.standard_t(3, (rows, n)) * rng.uniform(0.005, 0.1, (rows, 1))
    x[:, ::61] *= 20
    return x.astype(np.float32)


def test_best_index_is_the_nearest_table_value_upper_on_ties():
    kv = iquants.KVALUES_IQ4NL.astype(np.float32)
    x = np.array([-200, -127, -115.5, -115.6, 0, 1, 7, 7.0001, 113, 500, np.nan], np.float32)
    np.testing.assert_array_equal(iquants.best_index(x), [0, 0, 1, 0, 8, 8, 9, 9, 15, 15, 15])
    assert kv[iquants.best_index(np.float32(-10.2))] == -10


@pytest.mark.parametrize("use_imatrix", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("qtype", IQ4, ids=lambda t: t.name)
def test_round_trip_error(qtype, use_imatrix, backend):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 512)).astype(np.float32)
    imatrix = rng.gamma(1.0, 1.0, 512).astype(np.float32) if use_imatrix else None
    q = quants.quantize(x, qtype, imatrix)
    assert q.shape == quant_shape_to_byte_shape(x.shape, qtype)
    back = quants.dequantize(q, qtype)
    assert np.sqrt(np.mean((back - x) ** 2) / np.mean(x ** 2)) < 0.11  # observed ~0.09 (Q4_K: ~0.08)


def test_iq4_xs_needs_rows_of_256_iq4_nl_of_32():
    with pytest.raises(UnsupportedError, match="multiple of 256"):
        quants.quantize(np.zeros((2, 576), np.float32), QT.IQ4_XS)
    assert quants.quantize(np.zeros((2, 576), np.float32), QT.IQ4_NL).shape == (2, 18 * 18)


@pytest.mark.parametrize("use_imatrix", [False, True], ids=["plain", "imatrix"])
def test_backends_agree_on_edge_blocks(use_imatrix, monkeypatch):
    """Compiled kernels vs the numpy reference on zero, constant, tiny, huge and half-zero blocks."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((7, 512)).astype(np.float32)
    x[0] = 0
    x[1, :256] = 0.25
    x[2] *= 1e-20
    x[3] *= 1e20  # sums overflow to inf, scales become NaN: IQ4_XS then stores d = -0.0
    x[4, ::7] = 0
    x[5, :128] = -x[5, 128:256]
    x[6, 32:64] = 0
    qw = rng.gamma(0.5, 1.0, 512).astype(np.float32) if use_imatrix else None
    for qtype in IQ4:
        with np.errstate(all="ignore"):
            compiled = quants.quantize(x, qtype, qw)
            monkeypatch.setattr(quants, "BACKEND", "numpy")
            expected = quants.quantize(x, qtype, qw)
        monkeypatch.setattr(quants, "BACKEND", "numba")
        np.testing.assert_array_equal(compiled, expected, err_msg=qtype.name)


@pytest.mark.parametrize("use_imatrix", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("qtype", IQ4, ids=lambda t: t.name)
def test_golden_blocks_bit_exact(qtype, use_imatrix, backend):
    golden = np.load(GOLDEN)
    x, imatrix = golden["x"], golden["imatrix"]
    expected = golden[qtype.name + ("_imatrix" if use_imatrix else "")]
    got = quants.quantize(x, qtype, imatrix if use_imatrix else None)
    bad_rows = np.nonzero((got != expected).any(axis=1))[0]
    assert bad_rows.size == 0, f"{qtype.name}: rows {bad_rows.tolist()} differ from llama.cpp"


# -------------------------------------------------- live comparison with llama.cpp

@pytest.mark.parametrize("data", ["gaussian", "heavy"])
@pytest.mark.parametrize("use_imatrix", [False, True], ids=["plain", "imatrix"])
@pytest.mark.parametrize("qtype", IQ4, ids=lambda t: t.name)
def test_live_bit_exact_with_llamacpp(qtype, use_imatrix, data, ggml, backend):
    harness, lib = ggml
    rng = np.random.default_rng(int(qtype) * 4 + 2 * use_imatrix + (data == "heavy"))
    n = 1536 if qtype == QT.IQ4_XS else 576  # IQ4_NL: rows of any multiple of 32
    x = heavy_tailed(rng, 12, n) if data == "heavy" else rng.standard_normal((12, n)).astype(np.float32)
    imatrix = rng.gamma(0.5, 1.0, n).astype(np.float32) if use_imatrix else None
    if imatrix is not None:
        imatrix[:5] = 0  # llama.cpp imatrices can hold zero columns
    np.testing.assert_array_equal(quants.quantize(x, qtype, imatrix), harness.ggml_quantize(lib, x, qtype, imatrix))


def test_live_extreme_blocks(ggml, backend):
    """Bit-exact also where float32 overflows (|x| ~ 1e20) or underflows (|x| ~ 1e-30)."""
    harness, lib = ggml
    rng = np.random.default_rng(11)
    x = rng.standard_normal((5, 512)).astype(np.float32)
    x[0] = 0
    x[1] *= 1e-30
    x[2] *= 1e20
    x[3, :256] = -3.0
    x[4] = rng.standard_cauchy(512)
    for qtype in IQ4:
        for qw in (None, rng.gamma(0.5, 1.0, 512).astype(np.float32)):
            with np.errstate(all="ignore"):
                got = quants.quantize(x, qtype, qw)
            np.testing.assert_array_equal(got, harness.ggml_quantize(lib, x, qtype, qw), err_msg=qtype.name)


# -------------------------------------------------- whole files against llama-quantize (optional)

@pytest.fixture(scope="module", params=["micro", "smol576"])
def iq_model(request, tmp_path_factory) -> dict:
    """{model: f16 checkpoint, f16: quantkit's F16 GGUF, imatrix: llama-imatrix's file on it} for the toy
    presets micro (hidden 256) and smol576 (SmolLM-135M's widths: IQ4_XS falls back to IQ4_NL)."""
    import subprocess

    from quantkit.toy import make_toy_model
    from tests.gguf.helpers import convert_to, need_llama, save_f16_copy
    from tests.gguf.test_families_llamacpp import text_file

    need_llama("llama-quantize")
    root = tmp_path_factory.mktemp(f"iq-{request.param}")
    model = save_f16_copy(make_toy_model(root / "bf16", request.param, steps=20), root / "f16")
    f16 = root / "f16.gguf"
    convert_to(model, f16, "F16")
    imatrix = root / "imatrix.gguf"
    run = subprocess.run([str(need_llama("llama-imatrix")), "-m", str(f16), "-f", str(text_file(root / "t.txt")),
                          "-c", "128", "-b", "128", "--chunks", "4", "-t", "2", "-o", str(imatrix)],
                         capture_output=True, text=True, timeout=300, check=False)
    assert run.returncode == 0 and imatrix.is_file(), run.stderr[-2000:]
    return {"model": model, "f16": f16, "imatrix": imatrix}


IQ_MIXES = ["IQ4_NL", "IQ4_XS", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M",
            "IQ1_S", "IQ1_M"]


@pytest.mark.slow
@pytest.mark.parametrize("gguf_type", IQ_MIXES)
def test_iquant_files_bit_exact_with_llama_quantize(iq_model, gguf_type, tmp_path):
    """Every tensor's type and bytes equal llama-quantize's, with llama-imatrix's imatrix and without;
    where llama-quantize refuses a mix without an imatrix, quantkit refuses it too (InputError)."""
    import subprocess

    from quantkit.errors import InputError
    from quantkit.gguf import imatrix as im
    from tests.gguf.helpers import convert_to, run_quantize
    from tests.gguf.test_families_llamacpp import assert_same_tensors

    weights = im.read(iq_model["imatrix"]).weights()
    for imatrix in (iq_model["imatrix"], None):
        theirs, ours = tmp_path / "theirs.gguf", tmp_path / "ours.gguf"
        try:
            run_quantize(iq_model["f16"], theirs, gguf_type, imatrix=imatrix)
        except subprocess.CalledProcessError:
            assert imatrix is None, f"llama-quantize failed on {gguf_type} with an imatrix"
            with pytest.raises(InputError, match="imatrix"):
                convert_to(iq_model["model"], ours, gguf_type)
            continue
        result = convert_to(iq_model["model"], ours, gguf_type, imatrix=weights if imatrix else None)
        assert (result.imatrix_tensors > 0) == (imatrix is not None)
        assert_same_tensors(theirs, ours, f"{gguf_type} imatrix={imatrix is not None}")


def last_perplexity(cmd: list[str]) -> tuple[int, str, float | None]:
    """llama-perplexity's exit code, output and its last running PPL (`[n]value,` after each chunk; the
    final estimate line, printed by its log thread at exit, is often lost on a loaded machine)."""
    import re
    import subprocess

    run = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300, check=False)
    values = re.findall(r"\[\d+\]([0-9.]+|nan|inf),", run.stdout)
    return run.returncode, run.stdout, float(values[-1]) if values else None


@pytest.mark.slow
@pytest.mark.parametrize("gguf_type", IQ_MIXES)
def test_llama_perplexity_loads_every_iquant_mix(iq_model, gguf_type, tmp_path):
    """llama.cpp loads quantkit's file of each i-quant mix (made with the imatrix) and computes a finite
    perplexity with it (its CPU kernels for every type the mix holds)."""
    from quantkit.gguf import imatrix as im
    from tests.gguf.helpers import convert_to, need_llama
    from tests.gguf.test_families_llamacpp import text_file

    perplexity = need_llama("llama-perplexity")
    path = tmp_path / f"{gguf_type}.gguf"
    convert_to(iq_model["model"], path, gguf_type, imatrix=im.read(iq_model["imatrix"]).weights())
    code, output, ppl = last_perplexity([str(perplexity), "-m", str(path), "-f", str(text_file(tmp_path / "t.txt")),
                                         "-c", "128", "-b", "128", "--chunks", "2", "-t", "2"])
    assert code == 0, output[-3000:]
    assert ppl is not None and np.isfinite(ppl) and ppl > 1.0, (gguf_type, output[-2000:])
