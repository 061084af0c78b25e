"""Atomic output: everything is written into a staging directory beside OUT, then renamed.

Nothing partial is ever left at OUT: on failure or Ctrl-C the staging directory is removed.
Each staging directory `.OUT.staging-XXXX` has an owner file beside it (`….owner.json`: pid,
host, start time). Those files are the lock on OUT: a run refuses an OUT that a live run is
writing, and removes staging directories whose owner is gone (a crash or kill -9). The check
and the creation happen under an flock on OUT's parent directory, so two runs cannot both win.
Also copies the files a user needs beside the weights (tokenizer, processor, generation
config, chat template). The model card and quantkit.json are rendered by quantkit.run.report.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from quantkit.errors import InputError, OutputBusyError, OutputExistsError

OWNER_SUFFIX = ".owner.json"
WORK_DIR = ".work"  # a run's scratch directory inside its staging directory (baseline, offloaded tables)

SIDE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "generation_config.json", "preprocessor_config.json", "processor_config.json",
    "video_preprocessor_config.json",
)


def check_output(out: Path, overwrite: bool) -> None:
    """Fail fast: parent writable, no live run writing OUT, OUT absent (unless overwrite)."""
    parent = out.resolve().parent
    if not parent.is_dir():
        raise InputError(f"output parent directory does not exist: {parent}", hint="create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"output parent directory is not writable: {parent}",
                         hint="choose an output under a directory you can write, or fix its permissions")
    check_not_busy(out)
    if out.exists() and not overwrite:
        raise OutputExistsError(f"output already exists: {out}", hint="pass --overwrite to replace it")
    if out.exists() and not out.is_dir():
        raise InputError(f"output path exists and is not a directory: {out}",
                         hint="choose another -o, or remove that file")


@dataclass(frozen=True)
class Owner:
    """Who is writing a staging directory."""

    pid: int
    host: str
    started: float  # time.time() when the staging directory was made

    @classmethod
    def me(cls) -> Owner:
        return cls(os.getpid(), socket.gethostname(), time.time())


def make_staging(out: Path, progress: Callable[[str], None] = lambda message: None) -> Path:
    """A fresh hidden directory beside OUT (same filesystem, so the final rename is atomic),
    with its owner file. Under the parent's lock: refuse when a live run writes OUT (exit 2),
    remove what dead runs left (said through `progress`)."""
    out = out.resolve()
    with locked(out.parent):
        for removed in claim(out):
            progress(f"removed {removed.staging.name}, left by pid {removed.owner.pid} "
                     f"(started {_when(removed.owner.started)}, no longer running)")
        staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.staging-", dir=out.parent))
        try:
            write_owner(staging, Owner.me())
        except BaseException:  # never leave a staging dir without its owner file
            discard(staging)
            raise
    os.chmod(staging, 0o777 & ~current_umask())  # mkdtemp makes 0700; the result should look like any new dir
    return staging


def adopt_staging(out: Path, resumable: Callable[[Path], bool], check: Callable[[Path], None],
                  progress: Callable[[str], None] = lambda message: None) -> Path | None:
    """For --resume: under the parent's lock, take over the newest staging directory a dead run left
    beside OUT that `resumable` accepts (its owner file rewritten to this process) after `check`
    passes (it raises to refuse; then nothing is removed); the other dead runs' directories are
    removed. None when no leftover is resumable (then make_staging makes a fresh one)."""
    out = out.resolve()
    with locked(out.parent):
        found = [Leftover(s, o) for s in stagings(out) if (o := read_owner(s)) is not None]
        check_none_alive(out, [f.owner for f in found])
        kept = [f for f in found if resumable(f.staging)]
        chosen = max(kept, key=lambda f: f.owner.started) if kept else None
        if chosen is None:
            return None
        check(chosen.staging)
        write_owner(chosen.staging, Owner.me())
        for leftover in found:
            if leftover is not chosen:
                discard(leftover.staging)
                progress(f"removed {leftover.staging.name}, left by pid {leftover.owner.pid} (not the one resumed)")
    return chosen.staging


def resumable_leftovers(out: Path, resumable: Callable[[Path], bool]) -> list[Path]:
    """The staging directories of dead runs beside OUT that `resumable` accepts (read-only: the preflight)."""
    out = out.resolve()
    return [s for s in stagings(out) if (o := read_owner(s)) is not None and not owner_alive(o) and resumable(s)]


def current_umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def share_modes(staging: Path) -> None:
    """Give every file and directory of the result the modes of any new file under the user's umask:
    some writers create private files (safetensors writes its files 0600), and a model directory
    is usually served by another user (a vLLM or Ollama container)."""
    umask = current_umask()
    for path in staging.rglob("*"):
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~umask)


@dataclass(frozen=True)
class Leftover:
    staging: Path
    owner: Owner


def claim(out: Path) -> list[Leftover]:
    """Refuse OUT when a live run owns one of its staging dirs; remove the dead runs' ones.
    Call with the parent locked. Staging dirs without a readable owner file are left alone."""
    found = [Leftover(s, o) for s in stagings(out) if (o := read_owner(s)) is not None]
    check_none_alive(out, [f.owner for f in found])
    for leftover in found:  # all dead
        discard(leftover.staging)
    return found


def check_not_busy(out: Path) -> None:
    """The early, read-only form of claim(): fail at once when a live run is writing OUT."""
    out = out.resolve()
    check_none_alive(out, [o for s in stagings(out) if (o := read_owner(s)) is not None])


def check_none_alive(out: Path, owners: list[Owner]) -> None:
    live = [o for o in owners if owner_alive(o)]
    if live:
        other = live[0]
        raise OutputBusyError(
            f"another quantkit run (pid {other.pid} on {other.host}, started {_when(other.started)}) "
            f"is writing {out}", hint="wait for it to finish, or choose another output")


def stagings(out: Path) -> list[Path]:
    return sorted(p for p in out.parent.glob(f".{out.name}.staging-*") if p.is_dir())


def owner_file(staging: Path) -> Path:
    return staging.with_name(staging.name + OWNER_SUFFIX)


def write_owner(staging: Path, owner: Owner) -> None:
    owner_file(staging).write_text(json.dumps(asdict(owner)) + "\n")


def read_owner(staging: Path) -> Owner | None:
    try:
        data = json.loads(owner_file(staging).read_text())
        return Owner(int(data["pid"]), str(data["host"]), float(data["started"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def owner_alive(owner: Owner) -> bool:
    """True unless the owner is surely gone: same host, and its pid is not running or now
    belongs to a process started after the staging directory (pid reuse)."""
    if owner.host != socket.gethostname():
        return True  # another machine's run (shared filesystem): never ours to judge
    try:
        os.kill(owner.pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    started = process_start_time(owner.pid)
    return started is None or started <= owner.started + 1.0


def process_start_time(pid: int) -> float | None:
    """Wall-clock start time of a process from /proc (Linux); None where unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        boot = next(line for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime "))
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime, counted after "(comm)"
        return int(boot.split()[1]) + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


@contextmanager
def locked(directory: Path):
    """An exclusive flock on a directory: serializes the check-and-create of staging dirs."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _when(timestamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


def discard(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)
    owner_file(staging).unlink(missing_ok=True)


def publish(staging: Path, out: Path, overwrite: bool) -> None:
    """Move the finished staging directory to OUT; an old OUT is replaced only with overwrite.
    The owner file goes last, so the staging dir is never unowned while it exists."""
    out = out.resolve()
    share_modes(staging)
    move_into_place(staging, out, overwrite)
    owner_file(staging).unlink(missing_ok=True)


def move_into_place(src: Path, out: Path, overwrite: bool) -> None:
    """Rename the finished directory SRC to OUT (same filesystem); an old OUT is replaced only
    with overwrite, and stays as it was if the rename fails."""
    if out.exists():
        if not overwrite:
            raise OutputExistsError(f"output appeared while running: {out}", hint="pass --overwrite")
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.rename(out, old / "out")
        try:
            os.rename(src, out)
        except BaseException:
            os.rename(old / "out", out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(src, out)


def artifact_bytes(path: Path) -> int:
    """Bytes of an artifact: a file's size, or every file under a directory but the run's work
    directory (WORK_DIR: a one-target run's artifact is the staging directory that holds it)."""
    path = Path(path)
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and WORK_DIR not in f.relative_to(path).parts)


def remove_output(out: Path) -> None:
    """Remove an output directory: renamed aside first, so OUT is either whole or absent."""
    old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
    os.rename(out, old / "out")
    shutil.rmtree(old, ignore_errors=True)


def copy_side_files(model_dir: Path, dest: Path) -> list[str]:
    """Tokenizer/processor/generation files the artifact needs; never overwrite what the method wrote."""
    copied = []
    for name in SIDE_FILES:
        src = model_dir / name
        if src.is_file() and not (dest / name).exists():
            shutil.copy2(src, dest / name)
            copied.append(name)
    return copied


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")


def replace_json(path: Path, data: dict) -> None:
    """Write a JSON file in place of an existing one atomically: a temporary file, written in full and
    fsynced, renamed over it (a crash leaves the old file or the new one, never a torn one)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as fh:
        fh.write(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
