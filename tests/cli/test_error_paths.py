"""Every way a run can end badly leaves nothing at or beside OUT: no OUT, no staging dir, no owner file."""

from __future__ import annotations

import os
import signal

import pytest

from quantkit import errors
from tests.util import FAST_CALIB, leftovers


def replace_quantize(monkeypatch, quantize) -> None:
    """fp8's quantize entry point replaced (the method table holds the function itself)."""
    import dataclasses

    from quantkit.methods import fp8

    monkeypatch.setattr(fp8, "METHOD", dataclasses.replace(fp8.METHOD, quantize=quantize))


def _raise(exc):
    def fail(*args, **kwargs):
        raise exc
    return fail


def _signal(signum):
    def fail(*args, **kwargs):
        os.kill(os.getpid(), signum)  # the handler raises Terminated at the next bytecode
        raise AssertionError("the signal did not interrupt the run")
    return fail


def _partial_then(action):
    """A method that writes part of its artifact into staging, then fails."""
    def quantize(job):
        (job.out_dir / "model-00001-of-00002.safetensors").write_bytes(b"\0" * 1024)
        action(job)
    return quantize


ERROR_CLASSES = [errors.InputError("bad"), errors.RecipeError("bad"), errors.ModelError("bad"),
                 errors.CalibrationError("bad"), errors.UnsupportedError("bad"), errors.OutputExistsError("bad"),
                 errors.MissingExtraError("x", "nf4", "y"), errors.OutputBusyError("bad"),
                 errors.InternalError("bad")]  # a gate failure: test_real_gate_failure_leaves_nothing

CASES = [
    *(pytest.param("quantize", _partial_then(_raise(e)), e.exit_code, "error:", id=type(e).__name__)
      for e in ERROR_CLASSES),
    pytest.param("quantize", _partial_then(_raise(ZeroDivisionError())), 1, "internal error", id="unexpected"),
    pytest.param("quantize", _partial_then(_raise(KeyboardInterrupt())), 130, "interrupted", id="ctrl-c"),
    pytest.param("quantize", _partial_then(_raise(MemoryError())), 2, "out of memory", id="out-of-memory"),
    pytest.param("quantize", _partial_then(_signal(signal.SIGTERM)), 143, "terminated (SIGTERM)", id="sigterm"),
    pytest.param("quantize", _partial_then(_signal(signal.SIGHUP)), 129, "terminated (SIGHUP)", id="sighup"),
    pytest.param("publish", _raise(OSError("disk full")), 1, "disk full", id="publish-oserror"),
    pytest.param("publish", _signal(signal.SIGTERM), 143, "terminated", id="publish-sigterm"),
    pytest.param("baseline", _raise(KeyboardInterrupt()), 130, "interrupted", id="baseline-ctrl-c"),
]


@pytest.mark.parametrize("where, action, code, needle", CASES)
def test_nothing_left_at_or_beside_out(cli, micro_model, tmp_path, monkeypatch, where, action, code, needle):
    from quantkit.eval import evaluate
    from quantkit.io import export

    if where == "quantize":
        replace_quantize(monkeypatch, action)
    else:
        monkeypatch.setattr(*{"publish": (export, "move_into_place"), "baseline": (evaluate, "compute_baseline")}[where],
                            action)
    result = cli("quantize", micro_model, "--method", "fp8", "-o", tmp_path / "out", *FAST_CALIB)
    assert result.exit_code == code, result.output
    assert needle in result.stderr and "Traceback" not in result.stderr
    assert leftovers(tmp_path, "out") == []


def test_real_gate_failure_leaves_nothing(cli, micro_model, tmp_path):
    result = cli("quantize", micro_model, "--method", "fp8", "-o", tmp_path / "out", *FAST_CALIB, "--max-kld", "0")
    assert result.exit_code == 3, result.output
    assert leftovers(tmp_path, "out") == []


def test_bad_input_before_staging_leaves_nothing(cli, micro_model, tmp_path):
    result = cli("quantize", micro_model, "--method", "fp8", "--seq-len", "1", "-o", tmp_path / "out")
    assert result.exit_code == 2, result.output
    assert leftovers(tmp_path, "out") == []


def test_overwrite_failure_keeps_the_old_output(cli, micro_model, tmp_path, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("previous artifact")
    replace_quantize(monkeypatch, _partial_then(_signal(signal.SIGTERM)))
    result = cli("quantize", micro_model, "--method", "fp8", "-o", out, "--overwrite", *FAST_CALIB)
    assert result.exit_code == 143, result.output
    assert leftovers(tmp_path, "out") == ["out"] and (out / "keep.txt").read_text() == "previous artifact"
