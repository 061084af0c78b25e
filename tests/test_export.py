"""Staging directories: owner files, stale-leftover cleanup after a crash, the lock on OUT."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quantkit.errors import OutputBusyError
from quantkit.io import export
from tests.util import leftovers, sleeping_child, subprocess_env


def fake_leftover(parent: Path, name: str, pid: int, started: float | None = None, host: str | None = None) -> Path:
    """A staging dir as a run with `pid` would have left it (kill -9: nothing cleaned up)."""
    staging = parent / f".{name}.staging-fake{pid}"
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"partial")
    owner = {"pid": pid, "host": host or socket.gethostname(), "started": time.time() if started is None else started}
    export.owner_file(staging).write_text(json.dumps(owner))
    return staging


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_staging_has_an_owner_file_and_publish_removes_it(tmp_path):
    out = tmp_path / "out"
    staging = export.make_staging(out)
    owner = export.read_owner(staging)
    assert owner.pid == os.getpid() and owner.host == socket.gethostname()
    assert abs(owner.started - time.time()) < 60
    (staging / "a.txt").write_text("x")
    export.publish(staging, out, overwrite=False)
    assert leftovers(tmp_path, "out") == ["out"]
    assert sorted(p.name for p in out.iterdir()) == ["a.txt"]


def test_published_files_get_the_modes_of_new_files_under_the_umask(tmp_path):
    """safetensors writes 0600 files; the published model must be readable as any new file is."""
    import torch
    from safetensors.torch import save_file

    out = tmp_path / "out"
    staging = export.make_staging(out)
    (staging / "sub").mkdir(mode=0o700)
    save_file({"w": torch.zeros(2)}, staging / "sub" / "model.safetensors")
    (staging / "private.txt").write_text("x")
    os.chmod(staging / "private.txt", 0o600)
    old = os.umask(0o022)
    try:
        export.publish(staging, out, overwrite=False)
    finally:
        os.umask(old)
    assert {p.relative_to(out).as_posix(): oct(p.stat().st_mode & 0o777) for p in out.rglob("*")} == {
        "sub": "0o755", "sub/model.safetensors": "0o644", "private.txt": "0o644"}


def test_discard_removes_staging_and_owner(tmp_path):
    staging = export.make_staging(tmp_path / "out")
    export.discard(staging)
    assert leftovers(tmp_path, "out") == []


def test_stale_leftover_of_a_dead_run_is_removed_and_reported(tmp_path):
    stale = fake_leftover(tmp_path, "out", dead_pid())
    messages = []
    staging = export.make_staging(tmp_path / "out", messages.append)
    assert not stale.exists() and not export.owner_file(stale).exists()
    assert len(messages) == 1 and stale.name in messages[0] and "no longer running" in messages[0]
    assert leftovers(tmp_path, "out") == sorted([staging.name, export.owner_file(staging).name])


def test_reused_pid_counts_as_dead(tmp_path):
    """The pid is alive again but its process started after the staging dir: a different process."""
    stale = fake_leftover(tmp_path, "out", os.getpid(), started=time.time() - 10 * 365 * 86400)
    if export.process_start_time(os.getpid()) is None:
        pytest.skip("no /proc: process start times unknown")
    export.discard(export.make_staging(tmp_path / "out"))
    assert not stale.exists()


def test_live_run_is_never_touched_and_blocks(tmp_path):
    with sleeping_child() as pid:
        live = fake_leftover(tmp_path, "out", pid)
        with pytest.raises(OutputBusyError, match=f"pid {pid}"):
            export.make_staging(tmp_path / "out")
        with pytest.raises(OutputBusyError, match=f"pid {pid}"):
            export.check_output(tmp_path / "out", overwrite=True)
        assert (live / "model.safetensors").read_bytes() == b"partial"
    assert leftovers(tmp_path, "out") == sorted([live.name, export.owner_file(live).name])


def test_other_hosts_and_unowned_staging_dirs_are_left_alone(tmp_path):
    remote = fake_leftover(tmp_path, "out", dead_pid(), host="another-host.invalid")
    unowned = tmp_path / ".out.staging-unowned"
    unowned.mkdir()
    with pytest.raises(OutputBusyError, match="another-host.invalid"):
        export.make_staging(tmp_path / "out")
    export.owner_file(remote).unlink()
    export.discard(export.make_staging(tmp_path / "out"))
    assert remote.is_dir() and unowned.is_dir()


CLAIM = """
import sys
from pathlib import Path
from quantkit.io import export
from quantkit.errors import OutputBusyError
try:
    export.make_staging(Path(sys.argv[1]))
    print("won", flush=True)
except OutputBusyError as exc:
    print("busy", exc.message, flush=True)
sys.stdin.read()  # stay alive (a live owner) until the test closes stdin
"""


def test_concurrent_claims_only_one_wins(tmp_path):
    """Several processes racing for one OUT: the check-and-create is atomic, exactly one wins."""
    env = subprocess_env()
    procs = [subprocess.Popen([sys.executable, "-c", CLAIM, str(tmp_path / "out")], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True, env=env) for _ in range(6)]
    try:
        lines = [p.stdout.readline().strip() for p in procs]
    finally:
        for p in procs:
            p.communicate(input="", timeout=30)
    assert sum(line == "won" for line in lines) == 1, lines
    assert all(line.startswith("busy another quantkit run (pid ") for line in lines if line != "won"), lines


def test_artifact_bytes_leave_the_runs_work_directory_out(tmp_path):
    """A one-target run's artifact is its staging directory, which also holds the run's work directory
    (the baseline, the offloaded tables): the fallback's size budget must not count it."""
    from quantkit.io.export import WORK_DIR, artifact_bytes

    (tmp_path / "model.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / WORK_DIR / "offload").mkdir(parents=True)
    (tmp_path / WORK_DIR / "offload" / "lm_head.safetensors").write_bytes(b"y" * 5000)
    (tmp_path / WORK_DIR / "baseline.f16").write_bytes(b"z" * 700)
    assert artifact_bytes(tmp_path) == 102
    assert artifact_bytes(tmp_path / "model.safetensors") == 100
