"""Faults during a run: termination signals, leftovers of crashed runs, a second run into a busy OUT."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from quantkit.io import export
from tests.test_export import dead_pid, fake_leftover
from tests.util import FAST_CALIB, leftovers, sleeping_child, subprocess_env


def quantize_process(micro_model, out, *extra: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "quantkit", "quantize", str(micro_model), "--method", "fp8", "-o", str(out),
           *FAST_CALIB, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env())


def wait_for_staging(out, proc, timeout: float = 120.0):
    """Block until the run has made its staging directory (its owner file appears)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        owned = [s for s in export.stagings(out.resolve()) if export.owner_file(s).exists()]
        if owned:
            return owned[0]
        if proc.poll() is not None:
            pytest.fail(f"the run ended before staging (rc {proc.returncode}): {proc.stderr.read()}")
        time.sleep(0.05)
    pytest.fail("no staging directory appeared")


@pytest.mark.parametrize("signum, code, name", [(signal.SIGTERM, 143, "SIGTERM"),
                                                 pytest.param(signal.SIGHUP, 129, "SIGHUP", marks=pytest.mark.slow)])
def test_termination_signal_during_a_run(micro_model, tmp_path, signum, code, name):
    out = tmp_path / "out"
    proc = quantize_process(micro_model, out)
    try:
        wait_for_staging(out, proc)
        proc.send_signal(signum)
        _stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == code, stderr
    assert [line for line in stderr.splitlines() if "nothing was written" in line] == [
        f"terminated ({name}); nothing was written"]
    assert "Traceback" not in stderr
    assert leftovers(tmp_path, "out") == []


def test_handlers_are_restored_after_a_command(cli, tmp_path):
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    cli("recipes", "validate", tmp_path / "missing.yaml")
    assert {s: signal.getsignal(s) for s in before} == before


def test_second_run_into_a_busy_output_exits_2_at_once(cli, micro_model, tmp_path):
    with sleeping_child() as pid:
        live = fake_leftover(tmp_path, "out", pid)
        started = time.monotonic()
        result = cli("quantize", micro_model, "--method", "fp8", "-o", tmp_path / "out", "--overwrite", *FAST_CALIB)
        assert result.exit_code == 2, result.output
        assert f"pid {pid}" in result.stderr and "is writing" in result.stderr
        assert time.monotonic() - started < 20
        assert live.is_dir() and export.owner_file(live).is_file()  # the live run's files untouched


@pytest.mark.slow  # the same refusal fast against a live owner: test_second_run_into_a_busy_output_exits_2_at_once
def test_two_real_runs_into_one_output(micro_model, tmp_path):
    out = tmp_path / "out"
    first = quantize_process(micro_model, out)
    try:
        wait_for_staging(out, first)
        second = subprocess.run([sys.executable, "-m", "quantkit", "quantize", str(micro_model), "--method", "fp8",
                                 "-o", str(out), *FAST_CALIB], capture_output=True, text=True, env=subprocess_env(),
                                timeout=120)
        assert second.returncode == 2, second.stderr
        assert f"pid {first.pid}" in second.stderr
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    finally:
        first.kill()
    assert leftovers(tmp_path, "out") == []


def test_next_run_removes_a_crashed_runs_staging(cli, micro_model, tmp_path, monkeypatch):
    from quantkit.errors import InputError
    from tests.cli.test_error_paths import replace_quantize

    stale = fake_leftover(tmp_path, "out", dead_pid())

    def fail(job):
        raise InputError("stop here")

    replace_quantize(monkeypatch, fail)
    result = cli("quantize", micro_model, "--method", "fp8", "-o", tmp_path / "out", *FAST_CALIB)
    assert result.exit_code == 2, result.output
    assert f"removed {stale.name}, left by pid" in result.stderr
    assert leftovers(tmp_path, "out") == []
