"""`--method auto --for ENGINE[:DEVICE]`: the smallest artifact that passes the gate and serves there.

The ladder: the artifacts each method declares for it (MethodSpec.auto) that a kernel of the engine serves (each
format's runtimes table, as `quantkit plan` reads it), sized from the checkpoint's headers (quantkit.run.serving)
and ordered by what the user gets: smallest weights first; candidates within EQUAL_SIZE of each other count as one
size, and among those the faster kernel (Runtime.rank) comes first, then the smaller, then at one size the one
cheaper to measure (no calibration), then the methods' order. Before any work a candidate is skipped, with its
reason, when no kernel of the engine serves it on the device, when its weights and KV cache do not fit the device,
when it is over --max-size, when the method refuses the model, or when the device serves it as another candidate
(NVFP4 W4A4 runs weights-only outside Blackwell: the W4A16 candidate is that artifact).

The search: the answer is the first candidate in that order that passes one gate for all (AUTO_GATE, the recipe's
gate fields over it; a method's own default gate is stricter for 8-bit than for 4-bit, which would make
"passes" mean different things). The candidates of one chain (one method, more bits up the chain: GGUF's types,
MLX's bits) are assumed to measure no worse as they grow: a failed one rules out the smaller ones of its chain, a
passed one makes the larger ones unneeded (Rung.settled_by; a verdict taken back reopens what it settled). Within a
chain of three or more open candidates (two, once the chain has a reading) the next one measured is the one its
chain's readings predict to pass first (mean KL divergence falls about 4x per bit, as the variance of rounding
noise does; the slope is refitted from two readings), the middle one before any reading, so a GGUF ladder of 14
types takes a few measurements, not 14. When none passes, the guide (`fallback`) raises the candidate that came
closest, within --max-size or what the device leaves beside the KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from quantkit.errors import InputError, QuantkitError
from quantkit.methods import get_method, registered, runtimes_for
from quantkit.run import serving
from quantkit.units import human_bytes, parse_size

AUTO = "auto"  # the method name that asks for the ladder
AUTO_GATE = {"max_ppl_increase": 0.10, "max_kld": 0.10, "min_top1": 0.80}  # the bar of quantkit's 4-bit defaults
EQUAL_SIZE = 0.05  # weights within 5% of each other: one size, the faster kernel first
KLD_PER_BIT = -2.0  # log2(mean KLD) per bit of the quantized weights before two readings refit it
OPEN = "pending"


@dataclass(frozen=True)
class Candidate:
    """One rung: a method and one of its AutoRungs (the label, options and chain the method declares)."""

    method: str
    label: str
    options: tuple[tuple[str, Any], ...] = ()
    chain: str = ""

    def option_dict(self) -> dict[str, Any]:
        return dict(self.options)


@dataclass(frozen=True)
class Engine:
    """An engine --for names: the prefix of its kernels' names in the runtimes tables, and the device it means
    alone."""

    name: str
    prefix: str
    device: str


ENGINES = {e.name: e for e in (Engine("vllm", "vLLM", "H100"), Engine("llama.cpp", "llama.cpp", "cpu"),
                               Engine("mlx", "mlx-lm", "M3-Max-64G"), Engine("transformers", "transformers", "cpu"))}


def candidates() -> list[Candidate]:
    """Every method's AutoRungs (MethodSpec.auto), methods in registry order; which engine serves each is read
    from its format's runtimes when the ladder is built."""
    return [Candidate(name, rung.label, rung.options, rung.chain)
            for name in registered() for rung in get_method(name).auto]


class AutoOptions(BaseModel):
    """A recipe target's options with `method: auto`."""

    model_config = ConfigDict(extra="forbid")
    context: int = Field(4096, ge=1, description="tokens per sequence of KV cache the device must hold beside the "
                         "weights")
    batch: int = Field(1, ge=1, description="sequences served at once")
    max_size: str | None = Field(None, description="the artifact's largest size on disk, e.g. 4GB")

    @field_validator("max_size")
    @classmethod
    def _a_size(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                parse_size(value)
            except InputError as exc:
                raise ValueError(f"{exc.message}; --method auto takes a size (e.g. 4GB), not +N%") from None
        return value

    def max_bytes(self) -> int | None:
        return parse_size(self.max_size) if self.max_size else None


@dataclass(frozen=True)
class Destination:
    """Where the artifact is to be served: an engine of ENGINES on a device of quantkit.run.serving."""

    text: str
    engine: str
    device: serving.Device


def known_text() -> str:
    devices = ", ".join([*serving.DEVICES, "cpu", "cpu-64G"])
    return f"engines: {', '.join(ENGINES)}; devices: {devices}"


def parse_for(text: str, ram: int) -> Destination:
    """'vllm:L4' -> the engine and the device; an engine alone means its usual device (Engine.device)."""
    engine, _, name = text.strip().partition(":")
    if engine not in ENGINES:
        raise InputError(f"--for {text}: unknown engine '{engine}'", hint=f"write ENGINE[:DEVICE]; {known_text()}")
    try:
        device = serving.device(name or ENGINES[engine].device, ram)
    except InputError:
        raise InputError(f"--for {text}: unknown device '{name}'", hint=known_text()) from None
    return Destination(text, engine, device)


def kv_engine_for(destination: Destination) -> str | None:
    """The engine --kv-cache measures for at this destination (quantkit.eval.kv.TARGETS): vLLM on a CPU is its CPU
    backend (fp8 types only, stored as that backend stores them); None: the artifact's own engine."""
    return "vllm-cpu" if destination.engine == "vllm" and destination.device.kind == "cpu" else None


@dataclass
class Rung:
    """A candidate in the ladder: its estimated size and bits per quantized weight, the kernel that serves it on
    the device, and what became of it: pending, passed, failed, skipped (never built) or unneeded."""

    candidate: Candidate
    weights: int = 0
    bits: float = 0.0
    runtime: str | None = None
    rank: int = 0
    calibrates: bool = False
    preferred: bool = True  # the kernel serving it on the device is its scheme's first (it runs as built)
    status: str = OPEN
    why: str = ""
    kld: float | None = None
    artifact_bytes: int | None = None
    seconds: float | None = None
    guided: bool = False  # the guide's raised artifact of a failed candidate
    settled_by: "Rung | None" = None  # the chain reading that skipped it or made it unneeded

    @property
    def label(self) -> str:
        return self.candidate.label + (" + guide" if self.guided else "")

    def as_dict(self) -> dict:
        return {"candidate": self.label, "method": self.candidate.method, "options": self.candidate.option_dict(),
                "estimated_bytes": self.weights, "bits_per_weight": round(self.bits, 3), "runtime": self.runtime,
                "status": self.status, "why": self.why, "kld_mean": self.kld, "artifact_bytes": self.artifact_bytes,
                "seconds": self.seconds}


@dataclass
class Ladder:
    """The candidates in the order the answer is read, with the destination and the budget."""

    destination: Destination
    options: AutoOptions
    rungs: list[Rung]
    room: int  # the largest weights the device holds beside the KV cache (with the plan's overhead)
    max_kld: float | None = None  # the gate's mean-KLD bar, which the search's predictions aim at
    chosen: Rung | None = None
    guide: list[str] = field(default_factory=list)  # what the guide did, or why it did not run

    def budget(self) -> int:
        """The largest artifact the guide may write."""
        limit = self.options.max_bytes()
        return min(limit, self.room) if limit else self.room

    def as_dict(self) -> dict:
        return {"for": self.destination.text, "engine": self.destination.engine,
                "device": self.destination.device.name, "context": self.options.context, "batch": self.options.batch,
                "max_size_bytes": self.options.max_bytes(), "room_bytes": self.room,
                "chosen": self.chosen.label if self.chosen else None, "guide": self.guide,
                "ladder": [r.as_dict() for r in self.rungs]}


def build_ladder(info, destination: Destination, options: AutoOptions, max_kld: float | None) -> Ladder:
    """Every candidate of the engine sized and placed on the device, the ones that cannot serve or fit skipped
    with their reason, in answer order (pure: headers and config only)."""
    per_token = serving.kv_bytes_per_token(info.config)
    tokens = options.context * options.batch
    placed = [place(info, c, destination, per_token, tokens, options) for c in candidates()]
    rungs = [r for r in placed if r is not None]
    skip_shadowed(rungs, destination)
    usable = destination.device.usable_bytes
    room = max(0, int((usable - per_token * tokens * (1 + serving.OVERHEAD)) / (1 + serving.OVERHEAD)))
    return Ladder(destination, options, ordered(rungs), room, max_kld)


def place(info, candidate: Candidate, destination: Destination, per_token: int, tokens: int,
          options: AutoOptions) -> Rung | None:
    """One candidate sized (quantkit.run.serving.weight_parts) and placed on the device, or skipped with why;
    None when no kernel of the engine serves its format anywhere (not a candidate of this engine)."""
    method = get_method(candidate.method)
    prefix = ENGINES[destination.engine].prefix
    given = method.options.model_validate(candidate.option_dict())
    if not any(r.name.startswith(prefix) for r in runtimes_for(method, given)):
        return None
    try:
        resolved, _choices = method.resolve(info, given)
        quantized, count, other, experts = serving.weight_parts(info, method, resolved)
    except QuantkitError as exc:
        return Rung(candidate, status="skipped", why=f"refused for this model: {exc.message}")
    every = runtimes_for(method, resolved)
    runtimes = tuple(r for r in every if r.name.startswith(prefix))
    placed = serving.fit(int(quantized + other), per_token, tokens, runtimes, destination.device, experts)
    runtime = next((r for r in runtimes if r.name == placed.runtime), None)
    rung = Rung(candidate, int(quantized + other), quantized * 8 / count if count else 16.0, placed.runtime,
                runtime.rank if runtime else 0, method.needs_calibration(resolved),
                bool(every) and every[0].name == placed.runtime)
    rung.status, rung.why = skip_reason(placed, rung, destination, options)
    return rung


def skip_reason(placed: serving.Fit, rung: Rung, destination: Destination, options: AutoOptions) -> tuple[str, str]:
    device = destination.device
    if placed.verdict == "no runtime":
        lacks = f" (its CPU kernel needs {', '.join(placed.lacks)}, which this CPU lacks)" if placed.lacks else ""
        refused = f" ({placed.refused})" if placed.refused else ""
        return "skipped", f"no {destination.engine} kernel serves it on {device.name}{lacks}{refused}"
    if placed.verdict == "too small":
        return "skipped", (f"needs {human_bytes(placed.needs)} with {options.context} tokens x {options.batch} of KV "
                           f"cache; {device.name} offers {human_bytes(placed.usable)}")
    limit = options.max_bytes()
    if limit and rung.weights > limit:
        return "skipped", f"about {human_bytes(rung.weights)}, over --max-size {options.max_size}"
    return OPEN, ""


def skip_shadowed(rungs: list[Rung], destination: Destination) -> None:
    """A candidate the device serves with a kernel that is not its scheme's first, where another candidate of the
    method has that kernel as its first, is that other artifact as served (NVFP4 W4A4 as weights-only)."""
    for rung in rungs:
        if rung.status != OPEN or rung.preferred:
            continue
        twin = next((r for r in rungs if r is not rung and r.status == OPEN and r.preferred
                     and r.candidate.method == rung.candidate.method and r.runtime == rung.runtime), None)
        if twin is not None:
            rung.status = "skipped"
            rung.why = f"{destination.device.name} serves it as {twin.label} ({rung.runtime}): measured as that one"


def ordered(rungs: list[Rung]) -> list[Rung]:
    """The open candidates by size, those within EQUAL_SIZE of a group's smallest as one size (the faster kernel
    first, then the smaller, then at one size the one cheaper to measure: no calibration; then the declared order),
    then the skipped ones in declared order."""
    declared = {id(r): i for i, r in enumerate(rungs)}
    groups: list[list[Rung]] = []
    for rung in sorted((r for r in rungs if r.status == OPEN), key=lambda r: (r.weights, declared[id(r)])):
        if groups and rung.weights <= groups[-1][0].weights * (1 + EQUAL_SIZE):
            groups[-1].append(rung)
        else:
            groups.append([rung])
    by_use = [r for g in groups for r in sorted(g, key=lambda r: (r.rank, r.weights, r.calibrates, declared[id(r)]))]
    return by_use + [r for r in rungs if r.status != OPEN]


def check_buildable(ladder: Ladder) -> None:
    """Before any work: some candidate is open; otherwise exit 2 with the smallest one's size and why it is out."""
    if any(r.status == OPEN for r in ladder.rungs):
        return
    sized = [r for r in ladder.rungs if r.weights]
    where = f"{ladder.destination.engine} on {ladder.destination.device.name}"
    if not sized:
        raise InputError(f"--method auto --for {ladder.destination.text}: no format of {where} takes this model "
                         f"({ladder.rungs[0].label}: {ladder.rungs[0].why})", hint="try another --for")
    smallest = min(sized, key=lambda r: r.weights)
    if all(r.runtime is None for r in sized):
        engine = ladder.destination.engine
        raise InputError(f"--method auto --for {ladder.destination.text}: {engine} serves none of its formats on "
                         f"{ladder.destination.device.name} ({smallest.why})",
                         hint=f"another device, e.g. --for {engine}:{ENGINES[engine].device}")
    raise InputError(f"--method auto --for {ladder.destination.text}: no format of {where} fits; the smallest, "
                     f"{smallest.label} (about {human_bytes(smallest.weights)}): {smallest.why}",
                     hint="a larger --max-size, a shorter --context or smaller --batch, or another device")


# ------------------------------------------------------------------ the search


def chain_of(ladder: Ladder, rung: Rung) -> list[Rung]:
    """The rungs of the candidate's chain, by bits (itself alone outside a chain)."""
    if not rung.candidate.chain:
        return [rung]
    same = [r for r in ladder.rungs if r.candidate.chain == rung.candidate.chain and not r.guided]
    return sorted(same, key=lambda r: r.bits)


def next_probe(ladder: Ladder) -> Rung | None:
    """The candidate to measure next, None when the answer is known (the first open-or-passed rung passed, or
    none is left)."""
    answer = next((r for r in ladder.rungs if r.status in (OPEN, "passed")), None)
    if answer is None or answer.status == "passed":
        return None
    chain = chain_of(ladder, answer)
    open_ = [r for r in chain if r.status == OPEN]
    measured = [r for r in chain if r.kld is not None and r.status in ("passed", "failed")]
    if len(open_) < 2 or (len(open_) == 2 and not measured):  # two unread: the smaller, which may end the search
        return answer
    return predicted(open_, measured, ladder.max_kld)


def predicted(open_: list[Rung], measured: list[Rung], max_kld: float | None) -> Rung:
    """Of a chain's open rungs (by bits), the one its readings predict to pass with the fewest bits; the middle
    one without a reading or a KLD bar."""
    middle = open_[len(open_) // 2]
    if max_kld is None or not measured:
        return middle
    needed = needed_bits(measured, max_kld)
    if any(r.status == "failed" and r.bits >= needed for r in measured):
        return middle  # a reading under the KLD bar failed another check: the KLD model does not tell, bisect
    return next((r for r in open_ if r.bits >= needed), open_[-1])


def needed_bits(measured: list[Rung], max_kld: float) -> float:
    """The bits per weight at which log2(mean KLD), linear in bits through the reading nearest the bar (slope
    refitted from the two nearest readings where they fall as bits grow, else KLD_PER_BIT), meets the bar."""
    def level(r: Rung) -> float:
        return math.log2(max(r.kld or 0.0, 1e-12))

    target = math.log2(max(max_kld, 1e-12))
    near = sorted(measured, key=lambda r: abs(level(r) - target))
    slope = KLD_PER_BIT
    if len(near) > 1 and abs(near[1].bits - near[0].bits) > 1e-6:
        fitted = (level(near[1]) - level(near[0])) / (near[1].bits - near[0].bits)
        slope = fitted if fitted < -0.25 else KLD_PER_BIT
    return near[0].bits + (target - level(near[0])) / slope


def record(ladder: Ladder, rung: Rung, passed: bool, kld: float | None, why: str = "", settles: bool = True) -> None:
    """A measured candidate's verdict, and what it settles in its chain (settles=False: a verdict that is not
    the precision's, such as the engine refusing the artifact, settles nothing else, and what the rung's earlier
    pass settled is open again)."""
    if not settles:
        reopen(ladder, rung)
    rung.status, rung.kld = ("passed" if passed else "failed"), kld
    rung.why = why or (f"passed the gate{kld_text(kld)}" if passed else rung.why)
    if not settles:
        return
    for other in chain_of(ladder, rung):
        if other is rung or other.status != OPEN:
            continue
        if not passed and other.bits < rung.bits:
            other.status, other.settled_by = "skipped", rung
            other.why = f"{rung.label}, with more bits, failed the gate{kld_text(kld)}: assumed to fail too"
        elif passed and other.bits > rung.bits:
            other.status, other.why, other.settled_by = "unneeded", f"{rung.label}, with fewer bits, passed", rung


def reopen(ladder: Ladder, rung: Rung, why: str = "") -> None:
    """A verdict taken back: the rung open again (why: what became of its reading), and the rungs its reading
    settled open as well. A passed rung whose artifact was removed (a smaller one passed) can so be measured again
    should the smaller one fail the serving check, and the rungs a chosen one made unneeded are back in the search
    when the engine fails it."""
    rung.status, rung.why = OPEN, why
    for other in ladder.rungs:
        if other.settled_by is rung:
            other.status, other.why, other.settled_by = OPEN, "", None


def kld_text(kld: float | None) -> str:
    return f" (KLD {kld:.3g})" if kld is not None else ""


def answer(ladder: Ladder) -> Rung | None:
    """The first rung in order that passed (the answer once next_probe has nothing left to measure)."""
    return next((r for r in ladder.rungs if r.status == "passed"), None)


def finish(ladder: Ladder) -> Rung | None:
    """The answer chosen; every open rung after it unneeded."""
    ladder.chosen = answer(ladder)
    for rung in ladder.rungs:
        if rung.status == OPEN:
            rung.status = "unneeded"
            rung.why = f"{ladder.chosen.label}, smaller or as small, passed" if ladder.chosen else "not reached"
    return ladder.chosen


def guide_candidate(ladder: Ladder) -> Rung | None:
    """After every candidate failed: the failed one with the lowest KLD whose method has a fallback, which the
    guide raises (None, with the reason in ladder.guide, when there is none or no room)."""
    failed = [r for r in ladder.rungs if r.status == "failed" and not r.guided and r.kld is not None
              and get_method(r.candidate.method).fallback is not None]
    if not failed:
        ladder.guide.append("no failed candidate has a guide (fallback) to raise it")
        return None
    closest = min(failed, key=lambda r: r.kld)
    if (closest.artifact_bytes or closest.weights) >= ladder.budget():
        ladder.guide.append(f"{closest.label} came closest, but it leaves no room under {human_bytes(ladder.budget())}")
        return None
    return closest


def guided(ladder: Ladder, rung: Rung) -> Rung:
    """The guide's rung for a failed candidate: its options with a fallback bounded by the budget."""
    options = (*rung.candidate.options, ("fallback", {"max_size": f"{ladder.budget()}B"}))
    raised = Rung(Candidate(rung.candidate.method, rung.candidate.label, options), rung.weights, rung.bits,
                  rung.runtime, rung.rank, rung.calibrates, rung.preferred, guided=True)
    ladder.guide.append(f"raised {rung.label} (KLD {rung.kld:.3g}, the closest) within {human_bytes(ladder.budget())}")
    ladder.rungs.append(raised)
    return raised
