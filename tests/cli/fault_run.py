"""The quantkit CLI with a fault injected: `python -m tests.cli.fault_run N SIGNAL quantize ARGS...` sends
SIGNAL (KILL, TERM) to itself right after the Nth tensor of a GGUF conversion is recorded as written
(quantkit.gguf.resume.save), so a test interrupts a run at an exact point. Nothing in quantkit changes:
the hook wraps the function the conversion calls."""

from __future__ import annotations

import os
import signal
import sys


def fault_after(count: int, signum: int) -> None:
    from quantkit.gguf import resume

    save, seen = resume.save, []

    def save_then_fault(path, progress) -> None:
        save(path, progress)
        seen.append(path)
        if len(seen) == count:
            os.kill(os.getpid(), signum)

    resume.save = save_then_fault


def main() -> None:
    count, name, *args = sys.argv[1:]
    fault_after(int(count), getattr(signal, f"SIG{name}"))
    sys.argv = ["quantkit", *args]
    from quantkit.cli.app import main as cli

    cli()


if __name__ == "__main__":
    main()
