"""A server process on 127.0.0.1 whose whole process group ends on every exit path.

The server starts in a session of its own (start_new_session), so Ctrl-C in the terminal reaches
quantkit only, and stopping it signals its whole process group: vLLM's engine core and workers,
mlx-lm's and llama.cpp's threads. `running` stops the group in a `finally`, so a normal exit, an
exception, KeyboardInterrupt and quantkit.errors.Terminated (SIGTERM, SIGHUP) all end it: SIGTERM,
up to STOP_GRACE_S seconds to exit, then SIGKILL. Its output goes to a log file; a server that exits
before it is ready raises UnsupportedError (exit 2) with the log's most telling line.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import InputError, UnsupportedError
from quantkit.serve.http import is_healthy

STOP_GRACE_S = 5.0
POLL_S = 0.25
HOST = "127.0.0.1"
# Log lines that state a cause: a Python exception, else a line saying "error" or "failed" (llama.cpp).
EXCEPTION = re.compile(r"\b\w+(?:Error|Exception): .+")
PROBLEM = re.compile(r"\b(error|failed)\b", re.IGNORECASE)
WARNING = re.compile(r"\bwarn(ing)?\b", re.IGNORECASE)
# Lines that only say that something failed earlier.
WRAPPERS = ("see root cause above", "see stack trace", "engine core initialization failed", "exiting due to",
            "traceback")

@dataclass(frozen=True)
class Server:
    """A running server: where to reach it, its process id (also its process group) and its log."""

    url: str
    pid: int
    log: Path


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the kernel's pick for port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start the command in a new session (its own process group), output to `log`."""
    with open(log, "wb") as out:
        return subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                env=env, cwd=log.parent, start_new_session=True)


def proc_stat(pid: str) -> tuple[str, int] | None:
    """(state, process group) of a process from /proc/PID/stat, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
    return fields[0], int(fields[2])


def group_alive(pgid: int) -> bool:
    """Whether a live process (not a zombie: an orphan's zombie waits for an init that may never reap
    it) is left in the group: /proc where there is one, else signal 0 to the group."""
    if Path("/proc/self/stat").exists():
        stats = (proc_stat(pid) for pid in os.listdir("/proc") if pid.isdigit())
        return any(s is not None and s[1] == pgid and s[0] != "Z" for s in stats)
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def signal_group(pgid: int, signum: int) -> None:
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        pass


def wait_group(proc: subprocess.Popen, seconds: float) -> bool:
    """Wait up to `seconds` for the leader to exit (reaped) and the rest of its group to go; True if gone."""
    deadline = time.monotonic() + seconds
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return False
    while group_alive(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not group_alive(proc.pid)


def stop(proc: subprocess.Popen, grace: float = STOP_GRACE_S) -> None:
    """SIGTERM to the process group, up to `grace` seconds, then SIGKILL to whatever is left. The
    SIGKILL runs in a `finally`, so a second Ctrl-C during the grace period still ends the group."""
    try:
        signal_group(proc.pid, signal.SIGTERM)
        wait_group(proc, grace)
    finally:
        signal_group(proc.pid, signal.SIGKILL)
        proc.wait()


def log_tail(log: Path, size: int = 64 * 1024) -> list[str]:
    """The last lines of the log (its last `size` bytes)."""
    try:
        with open(log, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - size))
            return fh.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return []


def telling(line: str) -> bool:
    """Not a warning, and not a line that only points at an earlier cause."""
    return not WARNING.search(line) and not any(w in line.lower() for w in WRAPPERS)


def with_continuation(lines: list[str], index: int, cause: str) -> str:
    """The cause and its next line when that one is indented (pydantic's "1 validation error for X"
    states the error on the line below)."""
    following = lines[index + 1] if index + 1 < len(lines) else ""
    if following[:1].isspace() and following.strip() and not following.strip().startswith("File "):
        return f"{cause} {following.strip()}"
    return cause


def failure_reason(lines: list[str]) -> str:
    """The log line that states why the server failed: the first Python exception (vLLM logs the root
    cause first), else the first line saying "error" or "failed", else the last non-blank line."""
    exceptions = [(i, m.group(0).strip()) for i, line in enumerate(lines)
                  if telling(line) and (m := EXCEPTION.search(line))]
    if exceptions:
        return with_continuation(lines, *exceptions[0])
    problems = [line.strip() for line in lines if telling(line) and PROBLEM.search(line)]
    if problems:
        return problems[0]
    text = [line.strip() for line in lines if line.strip()]
    return text[-1] if text else "no output"


def wait_ready(proc: subprocess.Popen, url: str, health: str, timeout: float, log: Path, name: str,
               progress: Callable[[str], None]) -> None:
    """Poll GET url+health until it answers 200; raise when the process exits first or time runs out."""
    deadline, started, said = time.monotonic() + timeout, time.monotonic(), 0
    while not is_healthy(url + health):
        if proc.poll() is not None:
            raise UnsupportedError(f"{name} exited before it was ready (exit code {proc.returncode}): "
                                   f"{failure_reason(log_tail(log))}", hint=f"the server's log: {log}")
        if time.monotonic() > deadline:
            raise InputError(f"{name} was not ready after {timeout:.0f} s; last log line: "
                             f"{failure_reason(log_tail(log))}", hint="raise --start-timeout")
        waited = int(time.monotonic() - started)
        if waited >= said + 30:
            said = waited
            progress(f"waiting for {name} ({waited} s)")
        time.sleep(POLL_S)


@contextmanager
def running(command: list[str], env: dict[str, str], port: int, health: str, log: Path, timeout: float,
            name: str = "the server", progress: Callable[[str], None] = lambda message: None) -> Iterator[Server]:
    """Start the server, wait until GET `health` answers 200, yield it, and stop its process group on
    every exit path (module docstring)."""
    proc = start(command, env, log)
    try:
        url = f"http://{HOST}:{port}"
        wait_ready(proc, url, health, timeout, log, name, progress)
        yield Server(url, proc.pid, log)
    finally:
        stop(proc, STOP_GRACE_S)
