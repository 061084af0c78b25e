"""Where an artifact quantkit writes can be served: its weights, the KV cache at a context length and
batch, and the overhead, against named devices, with the runtime and kernel that serve the format
there (each method's format and scheme: quantkit.formats.Format.runtimes). Devices and their figures are the
table below, each with its source; nothing is fetched."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from quantkit.errors import InputError, QuantkitError
from quantkit.formats import Runtime
from quantkit.formats.transformers import RUNTIMES as SOURCE_RUNTIMES
from quantkit.methods import METHODS, MethodSpec, get_method, runtimes_for

OVERHEAD = 0.10  # activations, buffers and allocator slack on top of weights + KV (as quantkit inspect's estimate)
KV_SHARE = 0.40  # below this share of the usable memory left for the KV cache, batching has little room
KV_BYTES = {"fp16": 2, "fp8": 1}  # per cached value; llama.cpp's nearest to fp8 is --cache-type-k/v q8_0
GB = 10**9
EXPERTS_REFUSED = "no kernel there for its quantized experts"


@dataclass(frozen=True)
class Device:
    name: str
    memory: int  # bytes
    kind: str  # "cuda", "apple", "cpu"
    capability: float = 0.0  # CUDA compute capability
    usable: float = 0.90
    source: str = ""
    flags: frozenset[str] | None = None  # a CPU's features (/proc/cpuinfo flags) where known: this machine's

    @property
    def usable_bytes(self) -> int:
        return int(self.memory * self.usable)


NVIDIA = "NVIDIA datasheet (memory) and CUDA GPUs list (compute capability); usable 0.90: vLLM's default gpu_memory_utilization"
APPLE = "Apple specifications (unified memory); usable about 3/4: Metal's recommendedMaxWorkingSetSize"


def cuda(name: str, gigabytes: float, capability: float) -> Device:
    return Device(name, int(gigabytes * GB), "cuda", capability, 0.90, NVIDIA)


def apple(name: str, gigabytes: float) -> Device:
    return Device(name, int(gigabytes * GB), "apple", 0.0, 0.75, APPLE)


DEVICES = {d.name: d for d in (
    cuda("B200", 180, 10.0), cuda("H200", 141, 9.0), cuda("H100", 80, 9.0), cuda("A100-80G", 80, 8.0),
    cuda("A100-40G", 40, 8.0), cuda("L40S", 48, 8.9), cuda("A10G", 24, 8.6), cuda("L4", 24, 8.9),
    cuda("RTX4090", 24, 8.9), cuda("RTX5090", 32, 12.0), cuda("RTX3090", 24, 8.6), cuda("T4", 16, 7.5), cuda("V100-32G", 32, 7.0),
    apple("M2-Ultra-192G", 192), apple("M4-Max-128G", 128), apple("M3-Max-64G", 64), apple("M3-Pro-36G", 36),
    apple("M2-16G", 16),
)}
DEFAULT_DEVICES = ("H100", "A100-80G", "L40S", "RTX4090", "M3-Max-64G", "cpu")
CPU_SIZE = re.compile(r"cpu-(\d+(?:\.\d+)?)G", re.IGNORECASE)


def device(name: str, ram: int = 0) -> Device:
    """A device of the table by name (case-insensitive); `cpu` is this machine (`ram` bytes), `cpu-64G` a
    CPU with that much memory."""
    if name.lower() == "cpu":
        from quantkit.serve.support import cpu_flags

        return Device("cpu", ram, "cpu", 0.0, 0.90, "this machine's MemTotal; usable 0.90 (the OS and other processes)",
                      cpu_flags())
    size = CPU_SIZE.fullmatch(name)
    if size:
        return Device(name, int(float(size.group(1)) * GB), "cpu", 0.0, 0.90, "as named; usable 0.90")
    known = {key.lower(): d for key, d in DEVICES.items()}
    if name.lower() not in known:
        raise InputError(f"unknown device '{name}'",
                         hint="choose from " + ", ".join([*DEVICES, "cpu", "cpu-64G"]))
    return known[name.lower()]


def kv_bytes_per_token(config: dict, kv_cache: str = "fp16") -> int:
    """K and V of one token over every layer at `kv_cache` precision (quantkit.run.plan.kv_cache_bytes)."""
    from quantkit.run.plan import kv_cache_bytes

    return kv_cache_bytes(config, context=1, batch=1, bytes_per_value=KV_BYTES[kv_cache])


def runtime_for(method: MethodSpec, target: Device) -> Runtime | None:
    """The first of the runtimes of the method's default options that runs on the device; None when none does."""
    return first_runtime(default_runtimes(method), target)


def first_runtime(runtimes: tuple[Runtime, ...], target: Device) -> Runtime | None:
    return next((r for r in runtimes if r.serves(target.kind, target.capability, target.flags)), None)


def lacking(runtimes: tuple[Runtime, ...], target: Device) -> tuple[str, ...]:
    """The CPU features the device lacks for the first runtime of its kind (none where one serves)."""
    missing = [r.lacks(target.flags) for r in runtimes if target.kind in r.kinds and target.kind == "cpu"]
    return missing[0] if missing and all(missing) else ()


@dataclass(frozen=True)
class Fit:
    """One artifact on one device: the runtime that serves it there, what it needs (weights and the
    KV cache, each with the overhead), what the device offers, and the KV tokens the weights leave room for."""

    device: str
    runtime: str | None
    weights: int
    kv: int
    usable: int
    kv_tokens: int
    lacks: tuple[str, ...] = ()  # the CPU features the format's CPU runtime needs and this CPU lacks
    refused: str = ""  # why no runtime serves this model's artifact where one serves the format (EXPERTS_REFUSED)

    @property
    def needs(self) -> int:
        return self.weights + self.kv

    @property
    def kv_room(self) -> float:
        """Share of the usable memory the weights leave for the KV cache."""
        return max(0.0, 1 - self.weights / self.usable) if self.usable else 0.0

    @property
    def verdict(self) -> str:
        """'no runtime', 'too small', 'tight' (the weights leave under KV_SHARE of the memory to the
        KV cache: little room for longer contexts or batching), or 'fits'."""
        if self.runtime is None:
            return "no runtime"
        if self.needs > self.usable:
            return "too small"
        return "tight" if self.kv_room < KV_SHARE else "fits"

    def as_dict(self) -> dict:
        return {"device": self.device, "runtime": self.runtime, "verdict": self.verdict, "needs_bytes": self.needs,
                "usable_bytes": self.usable, "kv_room": round(self.kv_room, 3), "kv_tokens": self.kv_tokens,
                "lacks_cpu_features": list(self.lacks), "refused": self.refused}


def fit(weights: int, kv_per_token: int, tokens: int, runtimes: tuple[Runtime, ...], target: Device,
        experts: bool = False) -> Fit:
    """How an artifact of `weights` bytes with a KV cache of `tokens` tokens fits a device; `experts`: the artifact
    quantizes routed experts, which some kernels cannot serve (Runtime.quantized_experts)."""
    runtime = first_runtime(served_runtimes(runtimes, experts), target)
    refused = EXPERTS_REFUSED if runtime is None and first_runtime(runtimes, target) is not None else ""
    held = math.ceil(weights * (1 + OVERHEAD))
    per_token = kv_per_token * (1 + OVERHEAD)
    kv_tokens = max(0, int((target.usable_bytes - held) / per_token)) if per_token else 0
    return Fit(target.name, runtime.name if runtime else None, held, math.ceil(per_token * tokens),
               target.usable_bytes, kv_tokens, () if runtime else lacking(runtimes, target), refused)


def served_runtimes(runtimes: tuple[Runtime, ...], experts: bool) -> tuple[Runtime, ...]:
    """The runtimes that serve an artifact: without those that serve no quantized routed experts
    (Runtime.quantized_experts: vLLM's CPU kernels) where it quantizes some (`experts`)."""
    return tuple(r for r in runtimes if r.quantized_experts) if experts else runtimes


def quantizes_experts(entries) -> bool:
    """Whether a plan (quantkit.run.plan.build_plan) quantizes routed experts."""
    from quantkit.arch.moe import is_expert_weight

    return any(not e.kept and is_expert_weight(e.name + ".weight") for e in entries)


def source_bytes(info) -> int:
    """The checkpoint's tensors at 16 bits (float32 ones halved: what serving in bfloat16 holds)."""
    from quantkit.io.safetensors import DTYPE_BYTES

    return sum(math.prod(shape) * min(DTYPE_BYTES.get(dtype, 2), 2) for dtype, shape in info.tensors.values())


def weight_bytes(info, method: MethodSpec, options) -> int:
    """The artifact's weights as the method's precision plan gives them: each quantized weight at its
    precision's bits (the method's Sizes.precision_bits, else stored_bits), everything else at 16 bits."""
    quantized, _count, other, _experts = weight_parts(info, method, options)
    return int(quantized + other)


def weight_parts(info, method: MethodSpec, options) -> tuple[float, int, int, bool]:
    """(bytes of the weights the method quantizes, how many values they hold, bytes of everything else at 16
    bits, whether it quantizes routed experts), as weight_bytes sizes them: experts stored fused are counted by
    the plan's expert projections they hold (quantkit.run.plan.build_plan)."""
    from quantkit.methods import ignore_patterns
    from quantkit.run.plan import build_plan

    entries = build_plan(info, method, options, ignore_patterns(info, [], method.layers.keeps_lm_head(options)))
    quantized = [e for e in entries if not e.kept]
    sizes = method.sizes
    total, count = 0.0, 0
    for entry in quantized:
        bits = sizes.precision_bits(options, entry.precision) if sizes.precision_bits else sizes.stored_bits(options)
        total += entry.params * bits / 8
        count += entry.params
    other = sum(math.prod(shape) for _dtype, shape in info.tensors.values()) * 2 - count * 2
    return total, count, other, quantizes_experts(quantized)


def memory_rows(info, context: int) -> dict[str, dict]:
    """`quantkit inspect`'s memory estimate: the 16-bit checkpoint and each method's artifact at its default
    options, weights sized as `quantkit plan` sizes them (weight_bytes), each with an fp16 KV cache of
    `context` tokens and OVERHEAD; a method this model cannot take is left out."""
    sizes = {"source": (f"16-bit ({info.dtype})", source_bytes(info))}
    for name in METHODS:
        method = get_method(name)
        try:
            options, _choices = method.resolve(info, method.options())
            sizes[name] = (method.label, weight_bytes(info, method, options))
        except QuantkitError:
            continue
    kv = kv_bytes_per_token(info.config) * context
    return {name: {"format": fmt, "weights_bytes": weights, "with_overhead_bytes": math.ceil((weights + kv) * (1 + OVERHEAD))}
            for name, (fmt, weights) in sizes.items()}


@dataclass(frozen=True)
class FormatPlan:
    """One format quantkit writes (a method with its default options) and how it fits each device."""

    method: str
    format: str
    weights: int
    fits: list[Fit]
    serve: str

    def as_dict(self) -> dict:
        return {"method": self.method, "format": self.format, "weights_bytes": self.weights,
                "serve": self.serve, "devices": [f.as_dict() for f in self.fits]}


def serving_plan(info, devices: list[Device], context: int, batch: int, kv_cache: str,
                 methods: list[str] | None = None, kv_per_token: int | None = None) -> dict:
    """The plan for a model: the 16-bit checkpoint, then each method's artifact at its default options.
    `kv_per_token`: the KV bytes per token of an engine's KV type (quantkit.eval.kv), instead of `kv_cache`'s."""
    per_token = kv_per_token if kv_per_token is not None else kv_bytes_per_token(info.config, kv_cache)
    tokens = context * batch
    source = source_bytes(info)
    rows = [FormatPlan("source", f"16-bit ({info.dtype})", source,
                       [fit(source, per_token, tokens, SOURCE_RUNTIMES, d) for d in devices], "")]
    for name in methods or list(METHODS):
        method = get_method(name)
        options, _choices = method.resolve(info, method.options())
        quantized, _count, other, experts = weight_parts(info, method, options)
        weights = int(quantized + other)
        runtimes = runtimes_for(method, options)
        rows.append(FormatPlan(name, method.label, weights,
                               [fit(weights, per_token, tokens, runtimes, d, experts) for d in devices],
                               method.format.serve_command("OUT")))
    return {"model": str(info.path), "context": context, "batch": batch, "kv_cache": kv_cache,
            "kv_bytes_per_token": per_token, "overhead": OVERHEAD, "kv_share": KV_SHARE,
            "devices": [{"name": d.name, "memory_bytes": d.memory, "kind": d.kind, "capability": d.capability,
                         "usable": d.usable, "source": d.source} for d in devices],
            "formats": [{**row.as_dict(), **measured_in_engines(row.method)} for row in rows],
            "sources": sorted({r.source for n in (methods or list(METHODS)) for r in default_runtimes(get_method(n))}
                              | {r.source for r in SOURCE_RUNTIMES} | {d.source for d in devices})}


def default_runtimes(method: MethodSpec) -> tuple[Runtime, ...]:
    """The runtimes of the method's artifact at its default options."""
    return runtimes_for(method, method.options())


def measured_in_engines(method: str) -> dict:
    """What serve-check measured of the method's artifacts in each engine and device (quantkit.serve.measured):
    one line, and the records; nothing for the 16-bit source."""
    from quantkit.serve.measured import for_method, summary

    if method == "source":
        return {}
    return {"measured_summary": summary(method), "measured": [r.as_dict() for r in for_method(method)]}


CARD_DEVICES = ("H100", "A100-80G", "L40S", "L4", "RTX4090", "M3-Max-64G")
CARD_CONTEXT = 4096


def artifact_plan(info, method: MethodSpec, artifact, options=None, kv_flags: list[str] | None = None) -> dict:
    """A written artifact's line of the plan for its model card: its bytes on disk with an fp16 KV cache of
    CARD_CONTEXT tokens on the CARD_DEVICES (served by the runtimes of its `options`' scheme), and the
    command that serves it from its directory."""
    from pathlib import Path

    from quantkit.io.export import artifact_bytes

    artifact = Path(artifact)
    weights = artifact_bytes(artifact)
    per_token = kv_bytes_per_token(info.config)
    runtimes = runtimes_for(method, options) if options is not None else default_runtimes(method)
    fits = [fit(weights, per_token, CARD_CONTEXT, runtimes, DEVICES[name]) for name in CARD_DEVICES]
    return {"weights_bytes": weights, "context": CARD_CONTEXT, "kv_cache_bytes": per_token * CARD_CONTEXT,
            "devices": {f.device: {"verdict": f.verdict, "runtime": f.runtime} for f in fits},
            "serve": with_kv_flags(method.format.serve_command(artifact.name if artifact.is_file() else "."), kv_flags)}


def with_kv_flags(command: str, kv_flags: list[str] | None) -> str:
    """A serve command with the chosen KV-cache type's flags (quantkit.eval.kv: the engine's own spelling); a
    command that already sets the KV-cache dtype keeps its own."""
    if not kv_flags or "--kv-cache-dtype" in command:
        return command
    flags = " ".join(kv_flags)
    first, sep, other = command.partition(" (or: ")
    if other.startswith("mlx_lm.server"):  # the alternative takes the same flags; Ollama's does not
        other = other.removesuffix(")") + f" {flags})"
    return f"{first} {flags}{sep}{other}"


def measured_kv_sections(report: dict) -> list[tuple[str, int | None, dict]]:
    """(target name, its weights bytes or None, its KV-cache section) of a quantize report (quantkit.json:
    details.kv_cache_types) or an eval JSON (kv_cache)."""
    if "kv_cache" in report and isinstance(report["kv_cache"], dict) and "types" in report["kv_cache"]:
        return [(report.get("name", "artifact"), None, report["kv_cache"])]
    sections = []
    for target in report.get("targets") or []:
        details = target.get("details") or {}
        if details.get("kv_cache_types"):
            sections.append((target["name"], (details.get("serving") or {}).get("weights_bytes"),
                             details["kv_cache_types"]))
    return sections


def kv_context_rows(weights: int, section: dict, devices: list[Device], batch: int) -> list[dict]:
    """Per passing measured KV type: the largest context per sequence (`batch` sequences at once) each device
    holds beside the weights (with the plan's overhead), and the type's serve flags."""
    rows = []
    for row in section["types"]:
        if not row["passed"]:
            continue
        per_token = row["bytes_per_token"] * (1 + OVERHEAD)
        held = math.ceil(weights * (1 + OVERHEAD))
        contexts = {d.name: max(0, int((d.usable_bytes - held) / per_token / batch)) for d in devices}
        rows.append({"type": row["type"], "bytes_per_token": row["bytes_per_token"],
                     "kld_mean": row["total"]["kld_mean"], "serve_flags": row["serve_flags"],
                     "chosen": row["type"] == section.get("chosen"), "max_context": contexts})
    return rows
