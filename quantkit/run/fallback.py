"""The gate-driven fallback: a failed gate turned into a passing artifact by raising the precision of the units
the method's ladder predicts most damaging (quantkit.mixed.budget), within Fallback.max_size.

The search (the default): the raises are ordered once (the most predicted damage removed per added byte
first) and the number applied is searched for by measuring: the first step goes where the damage model,
scaled to the plain artifact's measured KL divergence, predicts a pass (bounded by the room); then the
bracket between the most raises that failed and the fewest that passed is narrowed by the re-scaled
prediction until it is within a tenth of the passing count (at most MAX_STEPS measurements). The artifact
kept is the fewest raises that passed. When even the whole room fails, the measured trend says how much
room a pass would need. With `tensors_per_step: N`, fixed steps of N raises instead, until a pass or no
room is left. Every step is printed with its metrics and goes into details.fallback. The order of the raises is
the ladder's: for fp8, smoothquant and nf4 the damage model's where its proxy ranks the probes well, else
measured (quantkit.mixed.ordering; details.fallback.ordering says which and why).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from quantkit.io import export
from quantkit.mixed import budget

MAX_STEPS = 8  # measured artifacts of one search, its first step included

Measure = Callable[[Path], None]  # reads an artifact back and measures it into the target's report entry


@dataclass
class Fallen:
    """Where a fallback ended: the plan written, the method's result for it, why it stopped."""

    plan: dict[str, str]
    result: object  # quantkit.methods.QuantizeResult
    note: str


def step_record(number: int, raised: dict, size: int, entry, count: int | None = None) -> dict:
    """One step for details.fallback.steps: what it raised, its bytes, the gate's metrics and verdict."""
    return {"step": number, **({} if count is None else {"raises": count}), "raised": raised, "bytes": size,
            "metrics": entry.metrics.as_dict(), "passed": entry.gate.passed,
            **({"tasks": entry.tasks} if entry.tasks else {})}


def tracked(function: Callable, entry, step: str) -> Callable:
    """`function`, each call's peak RSS kept in entry.peak_rss_by_step[step] (the highest of its calls) and in
    entry.peak_rss_bytes."""
    from quantkit.io.memory import PeakTracker

    def call(*args, **kwargs):
        with PeakTracker() as t:
            out = function(*args, **kwargs)
        entry.peak_rss_by_step[step] = max(entry.peak_rss_by_step.get(step, 0), t.peak_rss)
        entry.peak_rss_bytes = max(entry.peak_rss_bytes, t.peak_rss)
        return out

    return call


def peaks_recorded(resolved, measure: Measure, entry):
    """The target with its method's fallback steps (the sensitivity ladder, each requantization) and the
    measurements of its artifacts tracked (tracked): the report's per-step peaks hold the fallback's too."""
    steps = resolved.method.fallback
    steps = replace(steps, ladder=tracked(steps.ladder, entry, "fallback: sensitivity"),
                    requantize=tracked(steps.requantize, entry, "fallback: requantize"))
    return replace(resolved, method=replace(resolved.method, fallback=steps)), tracked(measure, entry, "fallback: eval")


def says(step: dict, first: int) -> str:
    """One line: the step's size cost, its metrics and the gate's verdict."""
    m = step["metrics"]
    return (f"{step['bytes'] - first:+,} bytes ({100 * (step['bytes'] / first - 1):+.1f}%): KLD {m['kld_mean']:.4g}, "
            f"top-1 {100 * m['top1']:.1f}%, Δppl {100 * m['ppl_increase']:+.2f}%: "
            f"{'passed' if step['passed'] else 'failed'}")


def run_fallback(job, resolved, result, entry, measure: Measure) -> None:
    """The fallback of one target whose gate failed (module docstring); entry's metrics, gate and details
    become the kept artifact's, details.fallback every step, the final plan and the size cost."""
    options, started = resolved.options.fallback, time.time()
    first = export.artifact_bytes(result.artifact)
    limit = options.size_limit(first)
    steps = [step_record(0, {}, first, entry)]
    job.progress(f"gate failed ({', '.join(entry.gate.failed)}): measuring which layers to raise first")
    resolved, measure = peaks_recorded(resolved, measure, entry)
    ladder = resolved.method.fallback.ladder(job, result)
    details = {**result.details, **ladder.details}
    ordering = ladder.details.get("sensitivity", {}).get("ordering")
    if ordering:
        job.progress(f"fallback: raises in the {ordering['used']} order ({ordering['reason']})")
    run = search_steps if options.tensors_per_step == 0 else fixed_steps
    fallen = run(job, resolved, ladder, details, entry, measure, steps, limit, result)
    job.progress(f"fallback: {fallen.note}")
    final = export.artifact_bytes(fallen.result.artifact)
    entry.details = {**fallen.result.details, "fallback": {
        "passed": entry.gate.passed, "stopped": fallen.note, "steps": steps, "first_bytes": first,
        "limit_bytes": limit, "final_bytes": final, "size_cost_bytes": final - first,
        "types": dict(sorted(fallen.plan.items())), "seconds": round(time.time() - started, 3),
        **({"ordering": ordering} if ordering else {})}}
    entry.timings["fallback_s"] = entry.details["fallback"]["seconds"]


# ------------------------------------------------------------------ fixed steps


def fixed_steps(job, resolved, ladder, details, entry, measure: Measure, steps: list, limit: int,
                result) -> Fallen:
    """Steps of `tensors_per_step` raises (the units predicted most damaging first) until the gate passes or no
    raise fits; a step whose artifact came out over the limit (the size model missed what the format adds)
    is undone: the last plan within it is written again."""
    method, options = resolved.method, resolved.options.fallback
    plan, first = dict(ladder.plan), steps[0]["bytes"]
    count = budget.step_count(options.tensors_per_step, len(ladder.units_for(plan)))
    while not entry.gate.passed:
        new, raised = budget.raise_plan(ladder, plan, count, limit - steps[-1]["bytes"])
        if not raised:
            return Fallen(plan, result, f"no raise fits in --max-size {options.max_size} ({limit:,} bytes)")
        candidate = method.fallback.requantize(job, new, details)
        size = export.artifact_bytes(candidate.artifact)
        if size > limit:
            return Fallen(plan, method.fallback.requantize(job, plan, details),
                          f"step {len(steps)} came to {size:,} bytes, over --max-size ({limit:,}): undone")
        measure(candidate.artifact)
        plan, result = new, candidate
        steps.append(step_record(len(steps), {n: f"{a}->{b}" for n, (a, b) in raised.items()}, size, entry))
        job.progress(f"fallback step {len(steps) - 1}: {len(raised)} layer(s) raised, {says(steps[-1], first)}")
    return Fallen(plan, result, f"gate passed after {len(steps) - 1} step(s), {steps[-1]['bytes'] - first:+,} bytes")


# ------------------------------------------------------------------ the search


@dataclass
class Measured:
    """A measured step: its artifact's result and what it left in the report entry (restored when it is kept)."""

    result: object
    metrics: object
    gate: object
    tasks: list | None
    record: dict


def search_steps(job, resolved, ladder, details, entry, measure: Measure, steps: list, limit: int,
                 result) -> Fallen:
    """The search over the number of raises (module docstring)."""
    method, first = resolved.method, steps[0]["bytes"]
    sequence = budget.raise_sequence(ladder)
    target = resolved.gate.max_kld if "kld_mean" in entry.gate.failed else None
    total = sum(budget.damage_at(r, ladder.plan[r.name]) for r in ladder.rows)
    space = budget.SearchSpace.of(sequence, total, limit - first, target)
    tried = [budget.Tried(0, False, entry.metrics.kld_mean)]
    kept = {0: Measured(result, entry.metrics, entry.gate, entry.tasks, steps[0])}
    written = 0  # the raises of the artifact in the output directory now
    while (count := budget.next_count(space, tried, MAX_STEPS - len(tried))) is not None:
        plan = budget.plan_after(ladder, sequence, count)
        candidate, written = method.fallback.requantize(job, plan, details), count
        size = export.artifact_bytes(candidate.artifact)
        if size > limit:  # the size model missed what the format adds: the room ends below this count
            space = replace(space, room=space.added[count] - 1)
            job.progress(f"fallback: {count} raises came to {size:,} bytes, over --max-size ({limit:,})")
            continue
        measure(candidate.artifact)
        record = step_record(len(steps), raised_names(sequence[:count]), size, entry, count)
        steps.append(record)
        tried.append(budget.Tried(count, entry.gate.passed, entry.metrics.kld_mean))
        kept[count] = Measured(candidate, entry.metrics, entry.gate, entry.tasks, record)
        job.progress(f"fallback step {len(steps) - 1}: {count} of {len(sequence)} raises ({len(record['raised'])} "
                     f"layers changed), {says(record, first)}")
    return settle(job, method, ladder, sequence, details, entry, kept, tried, written, space, limit)


def raised_names(raises: list[budget.Raise]) -> dict[str, str]:
    """{layer: "old->new"} of the plan after these raises (each layer at its last raise)."""
    changed: dict[str, tuple[str, str]] = {}
    for step in raises:
        for name in step.members:
            changed[name] = (changed.get(name, (step.old,))[0], step.new)
    return {name: f"{old}->{new}" for name, (old, new) in changed.items()}


def settle(job, method, ladder, sequence, details, entry, kept: dict, tried: list, written: int, space,
           limit: int) -> Fallen:
    """The artifact the search keeps: the fewest raises that passed, else the most measured (written again
    when another one is in the output directory), its measurements back in the report entry."""
    passing = [t.count for t in tried if t.passed]
    count = min(passing) if passing else max(t.count for t in tried)
    plan = budget.plan_after(ladder, sequence, count)
    chosen = kept[count]
    result = chosen.result if count == written else method.fallback.requantize(job, plan, details)
    entry.metrics, entry.gate, entry.tasks = chosen.metrics, chosen.gate, chosen.tasks
    first, size = kept[0].record["bytes"], chosen.record["bytes"]
    if passing:
        return Fallen(plan, result, f"gate passed with {count} of {len(sequence)} raises after {len(tried) - 1} "
                                    f"measured step(s), {size - first:+,} bytes ({100 * (size / first - 1):+.1f}%)")
    return Fallen(plan, result, room_note(space, tried, first, limit, job.options.fallback.max_size))


def room_note(space, tried: list, first: int, limit: int, max_size: str) -> str:
    """Why no pass was found, and how much room the measured trend needs."""
    at = max(tried, key=lambda t: t.count)
    head = f"no passing artifact within --max-size {max_size} ({limit:,} bytes; {at.count} raises measured)"
    if space.target is None:
        return f"{head}; the gate fails on a metric the damage model does not predict: raise --max-size"
    needed = budget.room_needed(space, at)
    if needed is None:
        return f"{head}; by the measured trend even every raise would stay above the gate's KLD {space.target:g}"
    return f"{head}; the measured trend needs about {needed:,} more bytes: --max-size +{100 * needed / first:.0f}%"
