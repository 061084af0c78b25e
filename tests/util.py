"""Helpers shared by tests."""

import contextlib
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# Small calibration for speed. The micro model is barely trained, so its next-token
# distributions are flat and top-1 flips on near-ties even when KLD is ~5e-4: loosen only
# top-1 (a later --min-top1 on the same command line wins).
FAST_CALIB = ("--num-samples", "4", "--seq-len", "64", "--eval-windows", "4", "--min-top1", "0.8")


def leftovers(parent, name: str) -> list[str]:
    """Anything at or beside OUT that a failed run could have left (OUT itself or staging dirs)."""
    return sorted(p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}."))


@contextlib.contextmanager
def sleeping_child():
    """The pid of a live process (a sleeping child), killed and reaped on exit."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


@contextlib.contextmanager
def script_module(name: str):
    """A script of scripts/ imported by path, in sys.modules while in use (dataclasses look their module up)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)


def subprocess_env(**extra: str) -> dict:
    """Environment for `python -m quantkit` subprocesses: this checkout's quantkit first."""
    pythonpath = os.pathsep.join(p for p in (str(REPO), extra.pop("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": pythonpath, **extra}




def kept(info, seq_len: int = 512, windows: int = 16) -> int:
    """The baseline's float16 log-probs a bounded run keeps in memory (below evaluate.SPILL_THRESHOLD)."""
    from quantkit.eval.evaluate import SPILL_THRESHOLD

    stored = 2 * windows * seq_len * info.config["vocab_size"]
    return stored if stored <= SPILL_THRESHOLD else 0
