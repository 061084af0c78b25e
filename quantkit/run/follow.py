"""The other torchrun ranks in step with rank 0, target by target: rank 0 leads (it measures the gate, decides the
guide's steps and publishes), every other rank follows the steps rank 0 announces, each one a data-parallel step
the ranks take together (quantkit.engines.llmcompressor.distributed).

After quantizing a target (data-parallel, with the auto-precision plan every rank takes from rank 0's sensitivity
table), rank 0 announces, in order:
  ("measure", artifact)             the gate reads a staged artifact: every rank scores its share of the held-out
                                    windows, the positions gathered
  ("ladder", artifact, details)     the fallback's sensitivity (MethodSpec.fallback.ladder), measured data-parallel
  ("requantize", plan, details)     the artifact written again with rank 0's plan, calibrated data-parallel
  ("done",)                         the target is finished on the other ranks
A fallback's search (quantkit.run.fallback) runs on rank 0 alone: the other ranks only take the steps it announces.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from quantkit.engines.llmcompressor.distributed import Ranks, share_object
from quantkit.errors import InternalError
from quantkit.methods import FallbackSteps, MethodSpec, QuantizeJob, QuantizeResult


def announce(ranks: Ranks, *step) -> None:
    """Rank 0 tells the other ranks its next step (nothing in one process)."""
    if ranks.distributed:
        share_object(step, ranks)


def leading(method: MethodSpec, ranks: Ranks) -> MethodSpec:
    """The method whose fallback ladder and re-quantizations rank 0 announces before it takes them."""
    if not ranks.distributed or method.fallback is None:
        return method
    steps = method.fallback

    def ladder(job: QuantizeJob, result: QuantizeResult):
        announce(ranks, "ladder", str(result.artifact), result.details)
        return steps.ladder(job, result)

    def requantize(job: QuantizeJob, plan: dict[str, str], details: dict) -> QuantizeResult:
        announce(ranks, "requantize", plan, details)
        return steps.requantize(job, plan, details)

    return dataclasses.replace(method, fallback=FallbackSteps(ladder, requantize))


def follow(job: QuantizeJob, method: MethodSpec, score: Callable[[Path], None]) -> None:
    """A rank other than 0: the steps rank 0 announces for this target, until it is done; `score(artifact)` scores
    this rank's share of the held-out windows with a staged artifact."""
    while True:
        kind, *values = share_object(None, job.ranks)
        if kind == "done":
            return
        if kind == "measure":
            score(Path(values[0]))
        elif kind == "ladder":
            method.fallback.ladder(job, QuantizeResult(Path(values[0]), values[1]))
        elif kind == "requantize":
            method.fallback.requantize(job, *values)
        else:
            raise InternalError(f"rank {job.ranks.rank}: rank 0 announced an unknown step {kind!r}",
                                hint="report this as a bug")
