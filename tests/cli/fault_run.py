"""The quantkit CLI with a fault injected: `python -m tests.cli.fault_run UNIT N SIGNAL quantize ARGS...` sends
SIGNAL (KILL, TERM) to itself right after the Nth UNIT is recorded as finished: `tensor`, a tensor of a GGUF
conversion (quantkit.gguf.resume.save); `shard`, a shard of fp8's model-free path
(quantkit.engines.llmcompressor.model_free.record_shard); `layer`, a decoder layer of
llm-compressor's sequential pipeline (quantkit.engines.llmcompressor.layer_resume.save_layer). A test interrupts a run at an exact point; nothing
in quantkit changes: the hook wraps the function the run calls. Under torchrun, with FAULT_RANK=R only rank R
faults (the others run on, until torchrun stops them)."""

from __future__ import annotations

import os
import signal
import sys


def recorder(unit: str):
    """(module, attribute) of the function that records one finished unit."""
    if unit == "tensor":
        from quantkit.gguf import resume

        return resume, "save"
    if unit == "layer":
        from quantkit.engines.llmcompressor import layer_resume

        return layer_resume, "save_layer"
    from quantkit.engines.llmcompressor import model_free

    return model_free, "record_shard"


def fault_after(unit: str, count: int, signum: int) -> None:
    if os.environ.get("FAULT_RANK", os.environ.get("RANK", "0")) != os.environ.get("RANK", "0"):
        return
    module, name = recorder(unit)
    record, seen = getattr(module, name), []

    def record_then_fault(*args) -> None:
        record(*args)
        seen.append(args)
        if len(seen) == count:
            os.kill(os.getpid(), signum)

    setattr(module, name, record_then_fault)


def main() -> None:
    unit, count, name, *args = sys.argv[1:]
    fault_after(unit, int(count), getattr(signal, f"SIG{name}"))
    sys.argv = ["quantkit", *args]
    from quantkit.cli.app import main as cli

    cli()


if __name__ == "__main__":
    main()
