"""GGUF through the whole pipeline: quantize via the CLI, gate on the written file, eval it again."""

import json

from tests.util import FAST_CALIB


def test_quantize_gguf_then_eval(cli, micro_model, tmp_path):
    out = tmp_path / "gguf"
    result = cli("quantize", micro_model, "--method", "gguf", "--gguf-type", "Q8_0", "-o", out, *FAST_CALIB)
    assert result.exit_code == 0, result.output
    files = {p.name for p in out.iterdir()}
    assert {"micro-Q8_0.gguf", "Modelfile", "README.md", "quantkit.json"} <= files
    report = json.loads((out / "quantkit.json").read_text())
    target = report["targets"][0]
    assert target["details"]["gguf"]["tensor_types"]["Q8_0"] > 0
    assert target["metrics"]["kld_mean"] < 0.01 and target["gate"]["passed"]
    assert "lm_head" not in target["kept"]

    result = cli("eval", out, "--num-windows", "3", "--seq-len", "64", "--json", "-")
    assert result.exit_code == 0, result.output
    row = json.loads(result.stdout)
    assert row["kind"] == "gguf" and row["metrics"]["kld_mean"] < 0.01

    result = cli("eval", out / "micro-Q8_0.gguf", "--against", micro_model, "--num-windows", "3", "--seq-len", "64",
                 "--json", "-")
    assert result.exit_code == 0 and json.loads(result.stdout)["kind"] == "gguf"


def test_gguf_gate_failure_writes_nothing(cli, micro_model, tmp_path):
    result = cli("quantize", micro_model, "--method", "gguf", "--gguf-type", "Q2_K", "-o", tmp_path / "out",
                 *FAST_CALIB, "--max-kld", "0.000001")
    assert result.exit_code == 3
    assert not (tmp_path / "out").exists()


def test_gguf_rejects_ignore_patterns(cli, micro_model, tmp_path):
    result = cli("quantize", micro_model, "--method", "gguf", "--ignore", "lm_head", "-o", tmp_path / "out")
    assert result.exit_code == 2 and "does not take ignore patterns" in result.stderr


def test_gguf_unknown_type(cli, micro_model, tmp_path):
    result = cli("quantize", micro_model, "--method", "gguf", "--gguf-type", "Q4_K_XL", "-o", tmp_path / "out")
    assert result.exit_code == 2 and "gguf_type" in result.stderr


def test_conversion_without_imatrix_or_gate_loads_no_model(cli, micro_model, tmp_path, monkeypatch):
    """Nothing in that run needs a torch model: no model is loaded, no tokenizer, no windows
    (the converter reads the checkpoint tensor by tensor; transformers only reads its config)."""
    from quantkit.engines import transformers as model
    from quantkit.run import pipeline

    def refuse(*args, **kwargs):
        raise AssertionError("loaded a model or tokenizer")

    monkeypatch.setattr(model, "load_model", refuse)
    monkeypatch.setattr(pipeline, "make_windows", refuse)
    monkeypatch.setattr(model, "load_tokenizer", refuse)
    out = tmp_path / "q8"
    result = cli("quantize", micro_model, "--method", "gguf", "--gguf-type", "Q8_0", "--imatrix", "none",
                 "--eval-windows", "0", "-o", out)
    assert result.exit_code == 0, result.output
    assert (out / "micro-Q8_0.gguf").is_file() and (out / "quantkit.json").is_file()


def test_iq4_xs_through_the_cli(cli, micro_model, tmp_path):
    """An i-quant mix end to end, its imatrix from the calibration windows (the micro model's flat
    next-token distributions make top-1 agreement noise, so the gate is off)."""
    out = tmp_path / "iq4"
    result = cli("quantize", micro_model, "--method", "gguf", "--gguf-type", "IQ4_XS", "-o", out, *FAST_CALIB,
                 "--no-gate")
    assert result.exit_code == 0, result.output
    details = json.loads((out / "quantkit.json").read_text())["targets"][0]["details"]["gguf"]
    assert details["tensor_types"]["IQ4_XS"] > 0 and details["imatrix"].startswith("computed")
    assert details["imatrix_tensors"] > 0


def test_mix_needing_an_imatrix_is_refused_before_work(cli, micro_model, tmp_path, monkeypatch):
    """llama.cpp refuses IQ2_XXS tensors without an imatrix: exit 2 naming --imatrix, nothing written
    (every kernel is pretended present, so the imatrix rule is what refuses)."""
    from gguf import GGMLQuantizationType as QT

    from quantkit.gguf import quants

    monkeypatch.setattr(quants, "SUPPORTED", tuple(QT))
    result = cli("quantize", micro_model, "--method", "gguf", "--gguf-type", "IQ2_XXS", "--imatrix", "none",
                 "-o", tmp_path / "out")
    assert result.exit_code == 2 and "--imatrix" in result.stderr, result.output
    assert not (tmp_path / "out").exists()


def test_mix_without_kernels_is_refused(cli, micro_model, tmp_path, monkeypatch):
    from gguf import GGMLQuantizationType as QT

    from quantkit.gguf import quants

    monkeypatch.setattr(quants, "SUPPORTED", tuple(t for t in quants.SUPPORTED if t != QT.IQ4_XS))
    result = cli("quantize", micro_model, "--method", "gguf", "--gguf-type", "IQ4_XS", "-o", tmp_path / "out")
    assert result.exit_code == 2 and "IQ4_XS" in result.stderr and "kernel" in result.stderr, result.output
    assert not (tmp_path / "out").exists()
