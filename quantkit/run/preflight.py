"""Disk preflight: estimate what a run will write beside OUT and refuse at once when the
filesystem lacks it (exit 2, with the numbers), instead of failing after the long work.

Rough on purpose: per target, the decoder's linear weights at the method's bits and everything
else at 16 bits; a merged LoRA checkpoint at 16 bits; the float16 baseline log-probs and the
float32 logits a streamed scorer spills (eval_windows x seq_len x vocab, 2 + 4 bytes at most);
with --resume, each method's saved progress beyond its artifact (MethodSpec.resume: Resume.bytes), less
what the interrupted run being resumed already wrote.
Staging, merged checkpoint and these files all live on OUT's filesystem (the staging directory
is beside OUT).
"""

from __future__ import annotations

import math
import shutil
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import InputError
from quantkit.methods import MethodSpec


@dataclass(frozen=True)
class DiskEstimate:
    artifacts: int
    merged_lora: int
    baseline: int
    saved_progress: int = 0  # --resume: each target's saved progress beyond its artifact (Resume.bytes)
    staged: int = 0  # --resume: bytes already in the staging directory the run takes over

    @property
    def total(self) -> int:
        return max(0, self.artifacts + self.merged_lora + self.baseline + self.saved_progress - self.staged)


def with_resume(estimate: DiskEstimate, info, targets: list[tuple[MethodSpec, object]], staged: int,
                calibration) -> DiskEstimate:
    """A --resume run's estimate: the saved progress of every target added (for the run's calibration windows:
    num_samples x seq_len), what an interrupted run already wrote (`staged`, which the resumed run keeps or
    overwrites) taken off."""
    from dataclasses import replace

    saved = sum(m.resume.bytes(info, o, calibration) for m, o in targets if m.resume)
    return replace(estimate, saved_progress=saved, staged=staged)


def estimate_bytes(quantized_params: int, other_params: int, target_bits: list[float], lora: bool,
                   eval_windows: int, seq_len: int, vocab: int) -> DiskEstimate:
    """Bytes a run writes: one artifact per target, the merged LoRA model, the float16 baseline
    and the spilled float32 logits of one scorer (both at most eval_windows x seq_len x vocab)."""
    artifacts = sum(int(quantized_params * bits / 8) + 2 * other_params for bits in target_bits)
    merged = 2 * (quantized_params + other_params) if lora else 0
    return DiskEstimate(artifacts, merged, (2 + 4) * eval_windows * seq_len * vocab)


def run_estimate(info, recipe, targets: list[tuple[MethodSpec, object]]) -> DiskEstimate:
    """The estimate for a run: its model, recipe and each target's (method, options)."""
    from quantkit.arch.roles import classify

    quantized = other = 0
    for name, (_dtype, shape) in info.tensors.items():
        count = 1
        for d in shape:
            count *= d
        if len(shape) == 2 and classify(name, info.towers) == "decoder":
            quantized += count
        else:
            other += count
    text = info.config.get("text_config") or info.config
    c = recipe.calibration
    return estimate_bytes(quantized, other, [m.sizes.stored_bits(o) for m, o in targets], bool(recipe.lora),
                          c.eval_windows, c.seq_len, int(text.get("vocab_size") or 0))


def check_disk(out: Path, estimate: DiskEstimate) -> None:
    """InputError with the numbers when OUT's filesystem has less free space than the estimate."""
    parent = out.resolve().parent
    free = shutil.disk_usage(parent).free
    if free >= estimate.total:
        return
    parts = [f"artifacts {_size(estimate.artifacts)}"]
    if estimate.merged_lora:
        parts.append(f"merged LoRA model {_size(estimate.merged_lora)}")
    if estimate.baseline:
        parts.append(f"baseline and spilled logits {_size(estimate.baseline)}")
    if estimate.saved_progress:
        parts.append(f"saved progress for --resume {_size(estimate.saved_progress)}")
    if estimate.staged:
        parts.append(f"less {_size(estimate.staged)} an interrupted run already wrote")
    raise InputError(f"not enough disk space in {parent}: the run writes about {_size(estimate.total)} "
                     f"({', '.join(parts)}), {_size(free)} is free",
                     hint="free some space, write to another filesystem, or run fewer targets or eval windows")


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


# ---------------------------------------------------------------- memory

FIXED_RAM = 768 * 2**20  # interpreter, torch, transformers and kernels before any weight (measured ~0.6-0.7 GiB)
FIXED_VRAM = 512 * 2**20  # CUDA context, cuBLAS workspaces and kernels before any weight


@dataclass(frozen=True)
class RamEstimate:
    """Peak memory of each step of a run (RAM, or the GPU's for a VramEstimate); the run's peak
    is the largest step plus the fixed part."""

    steps: dict[str, int]
    fixed: int = FIXED_RAM

    @property
    def peak(self) -> int:
        return self.fixed + max(self.steps.values(), default=0)

    def describe(self) -> str:
        return ", ".join(f"{name} {_size(n)}" for name, n in self.steps.items())


def unit_bytes(info) -> tuple[dict[str, int], dict[str, int]]:
    """Stored bytes per streamed unit: (every other module: embeddings, head, norms; each decoder
    layer), grouped by the same rule as quantkit.engines.transformers.offload_device_map."""
    from quantkit.io.checkpoint import LAYER_PREFIX
    from quantkit.io.safetensors import DTYPE_BYTES

    others: dict[str, int] = {}
    layers: dict[str, int] = {}
    for name, (dtype, shape) in info.tensors.items():
        match = LAYER_PREFIX.match(name)
        units, unit = (layers, match.group(1)) if match else (others, name.rsplit(".", 1)[0])
        units[unit] = units.get(unit, 0) + math.prod(shape) * DTYPE_BYTES.get(dtype, 1)
    return others, layers


def ram_estimate(info, recipe, targets, placement=None) -> RamEstimate:
    """Per step: the streamed baseline and gate hold one decoder layer (the .gguf candidate's in
    float32), a group's activations, a slice of the output head and its logits, and the baseline
    log-probs while they are small enough to stay in memory; a target that needs the model holds what
    held_bytes says with the method's working set (Sizes.working_set: GPTQ's per-layer Hessians);
    one that loads no model its working set alone (fp8's model-free slabs); a compressed-tensors text decoder is streamed like the base, a module
    decompressed at a time (quantkit.eval.compressed); any other compressed-tensors or bitsandbytes
    artifact is reloaded whole at its bits. With a resident placement on the CPU (gate_placement) the
    gate's steps hold the model whole instead (resident_need)."""
    from quantkit.eval.evaluate import SPILL_THRESHOLD
    from quantkit.eval.stream import ACTIVATION_BYTES, HEAD_SLICE_BYTES

    others, layers = unit_bytes(info)
    layer = max(layers.values(), default=0) or max(others.values(), default=0)
    model = sum(others.values()) + sum(layers.values())
    c = recipe.calibration
    text = info.config.get("text_config") or info.config
    store = 2 * c.eval_windows * c.seq_len * int(text.get("vocab_size") or 0)
    spill = placement is None or placement.spill
    store = store if store <= SPILL_THRESHOLD or not spill else 0  # above that it is spilled to a file
    streamed = ACTIVATION_BYTES + 2 * HEAD_SLICE_BYTES + store
    steps = {"baseline": layer + streamed} if c.eval_windows else {}
    for t in targets:
        working = t.method.sizes.working_set(info, t.options)
        if t.needs_model:
            steps[f"{t.name}: quantize"] = held_bytes(info, recipe, others, layers, working) + ACTIVATION_BYTES
        elif working:
            steps[f"{t.name}: quantize"] = working
        if c.eval_windows:
            steps[f"{t.name}: gate"] = candidate_bytes(t, model, layer, streams_gate(t, info, recipe)) + streamed
    if placement is not None and placement.resident and placement.device == "cpu":  # the model whole
        steps.update({name: resident_need(n, False, info, c.seq_len, c.eval_windows)[0] + store
                      for name, n in read_whole_bytes(info, recipe, targets).items()})
    return RamEstimate(steps)


def held_bytes(info, recipe, others: dict[str, int], layers: dict[str, int], working: int) -> int:
    """What RAM holds of a model loaded for a method (quantkit.run.pipeline.offload_plan): with --offload-dir
    the norms and one onloaded unit; a text decoder in RAM every decoder layer, the norms, and the larger
    of one table (onloaded for the first layer's inputs, or to save the head) and the method's working set; a VLM
    all of it."""
    from quantkit.io.checkpoint import is_vlm

    if recipe.offload_dir:
        return offloaded_bytes(others, layers, working)
    if is_vlm(info.config):
        return sum(others.values()) + sum(layers.values()) + working
    kept, tables = split_tables(others)
    return kept + sum(layers.values()) + max([*tables, working])


def offloaded_bytes(others: dict[str, int], layers: dict[str, int], per_layer: int) -> int:
    """What RAM holds of a model loaded with --offload-dir (quantkit.engines.transformers.offload_device_map): the
    modules left in memory (norms), plus the larger of the embedding table (onloaded while the first
    subgraph runs) and one decoder layer with the method's per-layer working set."""
    kept, tables = split_tables(others)
    return kept + max([*tables, max(layers.values(), default=0) + per_layer])


def split_tables(others: dict[str, int]) -> tuple[int, list[int]]:
    """The non-layer units' bytes split by quantkit.io.checkpoint.is_offloaded_table: (what stays in memory
    in total, each vocabulary table's bytes)."""
    from quantkit.io.checkpoint import is_offloaded_table

    kept = sum(n for unit, n in others.items() if not is_offloaded_table(unit))
    return kept, [n for unit, n in others.items() if is_offloaded_table(unit)]


def streams_gate(target, info, recipe) -> bool:
    """Whether the gate reads the target's artifact itself, a layer at a time or resident (its format's
    `streams`: a .gguf and an mlx-lm directory always, a compressed-tensors text decoder whose output head
    stays 16-bit, no custom model code), rather than loading it whole."""
    return target.method.format.streams(info.config, target.method.layers.keeps_lm_head(target.options),
                                        recipe.trust_remote_code)


def candidate_bytes(target, model: int, layer: int, streamed: bool) -> int:
    """What the gate holds of one artifact: read by quantkit, a layer in the dtype its format computes in
    (a .gguf in float32: twice a 16-bit layer; a compressed-tensors or mlx-lm one dequantized to its stored
    dtype); loaded whole, the checkpoint at its bits."""
    if streamed:
        return layer * (2 if target.method.format.gate_dtype == "float32" else 1)
    return int(model * target.method.sizes.stored_bits(target.options) / 16)


def largest_matrix(info) -> int:
    """Stored bytes of the largest decoder-layer tensor (what a streamed forward holds at once)."""
    from quantkit.io.checkpoint import LAYER_PREFIX
    from quantkit.io.safetensors import DTYPE_BYTES

    sizes = [math.prod(shape) * DTYPE_BYTES.get(dtype, 1) for name, (dtype, shape) in info.tensors.items()
             if LAYER_PREFIX.match(name)]
    return max(sizes, default=0)


def vram_estimate(info, recipe, targets, placement=None, onload: bool = False) -> RamEstimate:
    """Per step, what the GPU holds when the run uses one: a streamed forward one weight matrix (in
    float32 for a .gguf) with a group's activations and a slice of the head; a target that needs
    the model, one decoder layer and the calibration activations with --offload-dir (llm-compressor's
    sequential pipeline onloads a layer at a time), else the whole model; a gate that does not stream
    (bitsandbytes, streams_gate false), the artifact at its bits; fp8 without the model, one slab of
    one weight. With a resident placement on the GPU (gate_placement) the gate's steps hold the model
    whole (resident_need). With `onload` (the model in RAM, llm-compressor onloading a layer at a time)
    a method holds one layer, as with --offload-dir."""
    from quantkit.eval.stream import ACTIVATION_BYTES, HEAD_SLICE_BYTES

    others, layers = unit_bytes(info)
    model = sum(others.values()) + sum(layers.values())
    streamed = 2 * largest_matrix(info) + ACTIVATION_BYTES + 2 * HEAD_SLICE_BYTES
    steps = {"baseline": streamed} if recipe.calibration.eval_windows else {}
    for t in targets:
        working = t.method.sizes.working_set(info, t.options)
        if t.needs_model:
            held = max(layers.values(), default=0) if recipe.offload_dir or onload else model
            steps[f"{t.name}: quantize"] = held + ACTIVATION_BYTES + working
        elif working:
            steps[f"{t.name}: quantize"] = working
        if recipe.calibration.eval_windows:
            steps[f"{t.name}: gate"] = streamed if streams_gate(t, info, recipe) else (
                candidate_bytes(t, model, 0, False) + ACTIVATION_BYTES)
    if placement is not None and placement.resident and placement.device == "cuda":
        steps.update({name: resident_need(n, True, info, recipe.calibration.seq_len, recipe.calibration.eval_windows)[0]
                      for name, n in read_whole_bytes(info, recipe, targets).items()})
    return RamEstimate(steps, FIXED_VRAM)


def available_vram() -> int:
    """Free memory of the current CUDA device (0 without one: no check)."""
    import torch

    if not torch.cuda.is_available():
        return 0
    free, _total = torch.cuda.mem_get_info()
    return int(free)


def check_vram(estimate: RamEstimate, available: int) -> None:
    """InputError with the numbers when the GPU's free memory is below the run's estimated peak."""
    if not available or estimate.peak <= available:
        return
    raise InputError(f"not enough GPU memory: the run needs about {_size(estimate.peak)} on the GPU at its peak "
                     f"({estimate.describe()}, plus {_size(estimate.fixed)} fixed), {_size(available)} is free",
                     hint="fewer --eval-windows or a shorter --seq-len, a GPU with more memory, or --device cpu")


def available_ram() -> int:
    """MemAvailable from /proc/meminfo (0 where unknown: no check)."""
    return meminfo("MemAvailable")


def total_ram() -> int:
    """MemTotal from /proc/meminfo (0 where unknown)."""
    return meminfo("MemTotal")


def meminfo(field: str) -> int:
    """One field of /proc/meminfo in bytes (0 where unknown)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def check_ram(estimate: RamEstimate, limit: int | None) -> None:
    """InputError with the numbers when the run's estimated peak exceeds --max-memory (or the
    memory available now, when no limit is given)."""
    budget = limit or available_ram()
    if not budget or estimate.peak <= budget:
        return
    source = "--max-memory" if limit else "available memory"
    raise InputError(f"not enough memory: the run needs about {_size(estimate.peak)} at its peak "
                     f"({estimate.describe()}, plus {_size(estimate.fixed)} fixed), {source} is {_size(budget)}",
                     hint="use --offload-dir for the llm-compressor methods, fewer --eval-windows, "
                     "or a machine with more memory")


# ---------------------------------------------------------------- where the gate's forwards run

GPU_HEADROOM = 0.90  # share of the free GPU memory a resident gate may fill (allocator slack, other processes)
GPU_ACTIVATION_BYTES = 4 * 2**30  # a GPU's windows batched within this much of activations


def read_whole_bytes(info, recipe, targets) -> dict[str, int]:
    """What each model the gate reads itself (quantkit.eval.scorers.Reading) takes whole on its device, by
    step: the base at the run's dtype, each artifact as whole_bytes says. What loads through
    transformers anyway (a VLM, bitsandbytes, custom code) is not here: it is whole either way."""
    from quantkit.eval.stream import streamable

    if not recipe.calibration.eval_windows or recipe.trust_remote_code or not streamable(info.config):
        return {}
    steps = {"baseline": whole_bytes(info, recipe.dtype)}
    for t in targets:
        if streams_gate(t, info, recipe):
            steps[f"{t.name}: gate"] = whole_bytes(info, t.method.format.gate_dtype)
    return steps


def whole_bytes(info, dtype: str = "auto") -> int:
    """Bytes of a model of `info`'s shape read whole by quantkit in `dtype`: 'auto' as stored (the base; a
    compressed-tensors checkpoint decompressed to the stored dtype; an mlx-lm directory at its scales' dtype),
    'float32' (a .gguf; a base loaded so), any other 16-bit."""
    others, layers = unit_bytes(info)
    params = sum(math.prod(shape) for _dtype, shape in info.tensors.values())
    if dtype == "float32":
        return 4 * params
    if dtype != "auto":
        return 2 * params
    return sum(others.values()) + sum(layers.values())


def text_shape(info):
    """The text model's config as attributes, for quantkit.eval.stream.windows_per_group."""
    from types import SimpleNamespace

    text = info.config.get("text_config") or info.config
    hidden = int(text.get("hidden_size") or 0)
    return SimpleNamespace(hidden_size=hidden, intermediate_size=int(text.get("intermediate_size") or 4 * hidden),
                           num_attention_heads=int(text.get("num_attention_heads") or 1))


def resident_need(largest: int, cuda: bool, info, seq_len: int, windows: int) -> tuple[int, int]:
    """(bytes a resident gate holds with the largest model read whole, its activation budget): the model,
    a batch's activations (all the windows, or as many as the device's budget takes) and a few chunks of
    float32 logits."""
    from quantkit.eval.resident import CPU_CHUNK_BYTES, GPU_CHUNK_BYTES, MIN_CHUNK_POSITIONS
    from quantkit.eval.stream import ACTIVATION_BYTES, windows_per_group

    budget = GPU_ACTIVATION_BYTES if cuda else ACTIVATION_BYTES
    activation = min(budget, budget // windows_per_group(text_shape(info), seq_len, budget) * windows)
    text = info.config.get("text_config") or info.config
    logits = 4 * windows * seq_len * int(text.get("vocab_size") or 0)
    vocab = int(text.get("vocab_size") or 0)
    chunks = 3 * min(max(GPU_CHUNK_BYTES if cuda else CPU_CHUNK_BYTES, 4 * MIN_CHUNK_POSITIONS * vocab), logits)
    return largest + activation + chunks, budget


def baseline_bytes(info, seq_len: int, windows: int) -> int:
    """The float16 baseline log-probs of the held-out windows."""
    text = info.config.get("text_config") or info.config
    return 2 * windows * seq_len * int(text.get("vocab_size") or 0)


def run_cpu_budget(info, recipe, targets, max_memory: int | None) -> tuple[int, str]:
    """(bytes a resident gate may hold in RAM, where that figure comes from): within --max-memory when
    given; otherwise the run's estimated peak with a streamed gate (a method that loads the model holds
    it anyway; a streamed gate holds a batch's activations too), so the gate never raises the peak."""
    if max_memory:
        return max_memory - FIXED_RAM, f"--max-memory {_size(max_memory)}"
    return max(ram_estimate(info, recipe, targets).steps.values(), default=0), "this run's peak with a streamed gate"


def placement_for(largest: int, device: str, info, seq_len: int, windows: int, cpu_budget: tuple[int, str]):
    """Resident on `device` when the largest model read whole fits (quantkit.eval.scorers.Placement): on a
    GPU within its free memory, on a CPU within `cpu_budget` and the memory available now."""
    from quantkit.eval.scorers import Placement

    cuda = device == "cuda"
    need, activation = resident_need(largest, cuda, info, seq_len, windows)
    if cuda:
        free = available_vram()
        budget, source = int(GPU_HEADROOM * free) - FIXED_VRAM, f"{_size(free)} free on the GPU"
    else:
        budget, source = cpu_budget
        available = available_ram()
        if available and available - FIXED_RAM < budget:
            budget, source = available - FIXED_RAM, "the memory available now"
    why = f"the model whole needs {_size(need)}; {source}: {_size(max(0, budget))}"
    stored = baseline_bytes(info, seq_len, windows)
    room = budget - need if not cuda else (available_ram() or stored * 4) // 4  # a GPU host: a quarter of its RAM
    return Placement(need <= budget, device, activation, why, spill=need > budget or stored > room)


def gate_placement(info, recipe, targets, max_memory: int | None = None):
    """Where a run's models go, chosen once before any work: the gate resident when the largest model it
    reads itself fits (placement_for; on a CPU within run_cpu_budget), else streamed a layer at a time;
    on a GPU, a method's model whole on the GPU when the run's GPU peak with it fits, else onloaded from
    RAM a layer at a time (`onload`)."""
    from dataclasses import replace

    from quantkit.engines.transformers import device_map
    from quantkit.eval.scorers import Placement

    steps = read_whole_bytes(info, recipe, targets)
    device = device_map(recipe.device)
    c = recipe.calibration
    budget = run_cpu_budget(info, recipe, targets, max_memory) if device != "cuda" and steps else (0, "")
    placement = (placement_for(max(steps.values()), device, info, c.seq_len, c.eval_windows, budget) if steps
                 else Placement(False, device))
    if device != "cuda" or not any(t.needs_model for t in targets):
        return placement
    whole = vram_estimate(info, recipe, targets, placement).peak <= GPU_HEADROOM * available_vram()
    return replace(placement, onload=not whole)


def describe_placement(placement, info, seq_len: int) -> str:
    """One line: "gate: resident on cuda, batch 16 (...)" or "gate: streamed on cpu, 0.1 GiB per layer (...)"."""
    from quantkit.eval.stream import windows_per_group

    if placement.resident:
        batch = windows_per_group(text_shape(info), seq_len, placement.activation_bytes)
        return f"gate: resident on {placement.device}, batch {batch} ({placement.why})"
    _others, layers = unit_bytes(info)
    hint = "" if placement.device == "cuda" else "; --max-memory lets it stay whole"
    return (f"gate: streamed on {placement.device}, {_size(max(layers.values(), default=0))} per layer "
            f"({placement.why}{hint})")


def eval_placement(info, gate_dtype: str, device: str, seq_len: int, windows: int, max_memory: int | None = None):
    """Where `quantkit eval` runs its forwards for a base of `info`'s shape and an artifact its format computes
    in `gate_dtype` (quantkit.formats.Format.gate_dtype): as gate_placement, the CPU's budget being --max-memory
    or what a streamed forward holds anyway."""
    from quantkit.eval.stream import ACTIVATION_BYTES, HEAD_SLICE_BYTES

    largest = max(whole_bytes(info), whole_bytes(info, gate_dtype))
    if max_memory:
        budget = (max_memory - FIXED_RAM, f"--max-memory {_size(max_memory)}")
    else:
        _others, layers = unit_bytes(info)
        streamed = max(layers.values(), default=0) + ACTIVATION_BYTES + 2 * HEAD_SLICE_BYTES
        budget = (streamed, "a streamed forward's peak")
    return placement_for(largest, device, info, seq_len, windows, budget)
