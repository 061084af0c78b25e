"""quantkit.serve.process: ports, health wait, failed starts, and the process group ending on every path."""

import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from quantkit.errors import InputError, UnsupportedError
from quantkit.serve import process

STUB = Path(__file__).with_name("stub_server.py")
pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")


def alive(pid: int) -> bool:
    """A live process (a zombie is not)."""
    stat = process.proc_stat(str(pid))
    return stat is not None and stat[0] != "Z"


def stub(port: int, *flags: str) -> list[str]:
    return [sys.executable, str(STUB), str(port), *flags]


def launch(tmp_path, *flags, timeout=30.0):
    port = process.free_port()
    return process.running(stub(port, *flags), dict(os.environ), port, "/health", tmp_path / "server.log", timeout,
                           "stub")


def test_free_port_is_free_and_local():
    port = process.free_port()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))  # nothing holds it


def test_waits_for_health_and_ends_the_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    with launch(tmp_path, "--delay", "1", "--child", str(pidfile)) as server:
        assert server.url.startswith("http://127.0.0.1:")
        child = int(pidfile.read_text())
        assert alive(server.pid) and alive(child)
        assert process.proc_stat(str(child))[1] == server.pid  # the grandchild is in the server's group
    assert not alive(server.pid) and not alive(child)
    assert not process.group_alive(server.pid)


def test_group_ends_after_an_exception(tmp_path):
    pidfile = tmp_path / "child.pid"
    with pytest.raises(RuntimeError, match="boom"), launch(tmp_path, "--child", str(pidfile)) as server:
        raise RuntimeError("boom")
    assert not process.group_alive(server.pid) and not alive(int(pidfile.read_text()))


def test_group_ends_after_keyboard_interrupt(tmp_path):
    pidfile = tmp_path / "child.pid"
    with pytest.raises(KeyboardInterrupt), launch(tmp_path, "--child", str(pidfile)) as server:
        raise KeyboardInterrupt
    assert not process.group_alive(server.pid) and not alive(int(pidfile.read_text()))


def test_a_server_ignoring_sigterm_is_killed(tmp_path, monkeypatch):
    monkeypatch.setattr(process, "STOP_GRACE_S", 0.5)
    started = time.monotonic()
    with launch(tmp_path, "--ignore-term") as server:
        pass
    assert not process.group_alive(server.pid)
    assert time.monotonic() - started < 20


def test_failed_start_raises_the_logs_cause(tmp_path):
    with pytest.raises(UnsupportedError, match="stub cannot load this format") as info, launch(tmp_path, "--fail"):
        pass
    assert "exited before it was ready" in info.value.message


def test_timeout_raises_with_a_hint(tmp_path):
    with pytest.raises(InputError, match="not ready after 2 s") as info, launch(tmp_path, "--never", timeout=2):
        pass
    assert "--start-timeout" in info.value.hint
    assert "loading the model" in info.value.message  # the last log line


def test_failure_reason_prefers_the_root_cause():
    lines = ["(APIServer) WARNING ... failed with error current limit exceeds maximum limit",
             "(Worker) ERROR ... ValueError: Failed to find a kernel that can implement the NVFP4 linear layer.",
             "RuntimeError: Engine core initialization failed. See root cause above."]
    assert process.failure_reason(lines) == (
        "ValueError: Failed to find a kernel that can implement the NVFP4 linear layer.")
    assert process.failure_reason(["pydantic_core.ValidationError: 1 validation error for ModelConfig",
                                   "  Value error, Unknown quantization method: bitsandbytes."]).endswith(
        "Unknown quantization method: bitsandbytes.")
    assert process.failure_reason(["llama_model_load: error loading model: unknown type", "main: exiting due to x"]) \
        == "llama_model_load: error loading model: unknown type"
    assert process.failure_reason(["", "last words", ""]) == "last words"


SIGTERM_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from quantkit.cli.common import signals_as_exceptions
    from quantkit.serve import process
    port = process.free_port()
    command = [sys.executable, {stub!r}, str(port), "--child", {pidfile!r}]
    try:
        with signals_as_exceptions():
            with process.running(command, dict(os.environ), port, "/health", Path({log!r}), 30, "stub") as server:
                print(server.pid, flush=True)
                time.sleep(60)
    except KeyboardInterrupt as exc:
        print("ended by", type(exc).__name__, flush=True)
""")


def test_sigterm_to_quantkit_ends_the_group(tmp_path):
    pidfile = tmp_path / "child.pid"
    script = SIGTERM_SCRIPT.format(stub=str(STUB), pidfile=str(pidfile), log=str(tmp_path / "server.log"))
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        server_pid = int(proc.stdout.readline())
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert "ended by Terminated" in out
    assert not process.group_alive(server_pid) and not alive(int(pidfile.read_text()))
