"""Disk preflight: estimate what a run will write beside OUT and refuse at once when the
filesystem lacks it (exit 2, with the numbers), instead of failing after the long work.

Rough on purpose: per target, the decoder's linear weights at the method's bits and everything
else at 16 bits; a merged LoRA checkpoint at 16 bits; the float16 baseline log-probs, which go to a
file where they do not fit in memory (eval_windows x seq_len x vocab x 2 bytes at most; logits never do);
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
from quantkit.io.checkpoint import unit_bytes
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
    """Bytes a run writes at most: one artifact per target, the merged LoRA model, the float16 baseline
    log-probs (eval_windows x seq_len x vocab x 2 bytes, where they go to a file)."""
    artifacts = sum(int(quantized_params * bits / 8) + 2 * other_params for bits in target_bits)
    merged = 2 * (quantized_params + other_params) if lora else 0
    return DiskEstimate(artifacts, merged, 2 * eval_windows * seq_len * vocab)


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
        parts.append(f"baseline log-probs {_size(estimate.baseline)}")
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

FIXED_RAM = 600 * 2**20  # interpreter, torch, transformers and kernels before any weight (measured 0.50 GiB for
# `quantkit eval`, 0.59 GiB once llm-compressor is imported)
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


def ram_estimate(info, recipe, targets, placement=None) -> RamEstimate:
    """Per step of a run with `placement` (default: the bounded path, everything streamed, the baseline's
    log-probs spilled above evaluate.SPILL_THRESHOLD, a method's tables on disk):
    - the baseline and each gate: streamed, one decoder layer (the .gguf candidate's in float32), a batch's
      activations, a slice of the output head and its logits, and the float32 chunks the scoring holds
      (streamed_bytes); resident (read_whole_bytes), the model whole, a batch and a few chunks of logits at
      the vocabulary's size (scoring_bytes); in lockstep, no baseline step: each gate holds the base and the
      artifact, less what they share (lockstep_bytes);
    - a target that needs the model holds what held_bytes says with the method's working set
      (Sizes.working_set: GPTQ's per-layer Hessians); one that loads no model its working set alone
      (fp8's model-free slabs); a compressed-tensors text decoder's gate is streamed like the base, a module
      decompressed at a time (quantkit.eval.compressed); any other compressed-tensors or bitsandbytes
      artifact is reloaded whole at its bits;
    - a target with a gate-driven fallback adds the fallback's steps (fallback_steps);
    - every step after the baseline also holds the baseline's log-probs kept in memory (kept_baseline_bytes);
    - a gate measuring KV-cache types keeps the artifact's own reading as well (in memory below
      evaluate.SPILL_THRESHOLD), and its KV step reads the artifact again as the gate does, comparing each chunk
      with both readings."""
    from quantkit.eval.scorers import Placement
    from quantkit.eval.stream import ACTIVATION_BYTES

    placement = placement or Placement(False)
    others, layers = unit_bytes(info)
    matrix = largest_matrix(info) or max(others.values(), default=0)  # what a streamed forward holds at once
    c = recipe.calibration
    kept = kept_baseline_bytes(info, c.seq_len, c.eval_windows, placement)
    streamed = streamed_bytes(info, c.seq_len, c.eval_windows)
    whole = read_whole_bytes(info, recipe, targets) if placement.resident and placement.device == "cpu" else {}
    steps = {}
    if c.eval_windows and not placement.lockstep:
        base = whole.get("baseline")
        steps["baseline"] = kept + (scoring_bytes(base, info, c.seq_len, c.eval_windows, BASELINE_COPIES) if base
                                    else matrix + streamed)
    for t in targets:
        working = t.method.sizes.working_set(info, t.options)
        if t.needs_model:
            held = held_bytes(info, recipe, others, layers, working, placement.tables_on_disk)
            steps[f"{t.name}: quantize"] = held + ACTIVATION_BYTES + kept
        elif working:
            steps[f"{t.name}: quantize"] = working + kept
        if c.eval_windows:
            steps[f"{t.name}: gate"] = gate_bytes(t, info, recipe, placement, whole, streamed) + kept
        if c.eval_windows and t.gate.kv_cache is not None:
            own = kept_baseline_bytes(info, c.seq_len, c.eval_windows, Placement(False))  # the artifact's reading
            steps[f"{t.name}: gate"] += own
            # the KV step compares each chunk with both (evaluate.kl_rows_of): one float32 chunk more
            steps[f"{t.name}: kv cache"] = steps[f"{t.name}: gate"] + chunk_bytes(info, c.seq_len, c.eval_windows)
        if c.eval_windows and getattr(t.options, "fallback", None) is not None:
            steps.update(fallback_steps(t.name, steps, info, recipe, kept))
    return RamEstimate(steps)


def fallback_steps(name: str, steps: dict[str, int], info, recipe, kept: int) -> dict[str, int]:
    """The steps a target's gate-driven fallback adds (quantkit.run.fallback, peaks reported under the same
    names): the sensitivity ladder's probes (probe_bytes), each requantization as the quantize step, each
    measurement of a raised artifact as the gate (its decoder read at the stored dtype whatever it raised)."""
    added = {f"{name}: fallback: sensitivity": probe_bytes(info, recipe) + kept}
    if f"{name}: quantize" in steps:
        added[f"{name}: fallback: requantize"] = steps[f"{name}: quantize"]
    added[f"{name}: fallback: eval"] = steps[f"{name}: gate"]
    return added


def probe_bytes(info, recipe) -> int:
    """What the ladder's probes hold (quantkit.mixed.sensitivity.probe_klds, on at most every calibration
    window): the layer-streamed float32 forward (a decoder matrix in float32 and streamed_bytes), the float32
    inputs it records of the layers the probes start at (every decoder layer, at most) and the probes' own
    baseline log-probs where they stay in memory (below evaluate.SPILL_THRESHOLD)."""
    from quantkit.eval.scorers import Placement

    c, shape = recipe.calibration, text_shape(info)
    text = info.config.get("text_config") or info.config
    recorded = 4 * int(text.get("num_hidden_layers") or 0) * c.num_samples * c.seq_len * shape.hidden_size
    probes_baseline = kept_baseline_bytes(info, c.seq_len, c.num_samples, Placement(False))
    return 2 * largest_matrix(info) + streamed_bytes(info, c.seq_len, c.num_samples) + recorded + probes_baseline


def gate_bytes(target, info, recipe, placement, whole: dict[str, int], streamed: int) -> int:
    """What one target's gate holds beside a kept baseline (ram_estimate): its artifact resident (in lockstep
    the base beside it, less what they share), or the candidate candidate_bytes says with the streamed
    forward's parts (`streamed`)."""
    c = recipe.calibration
    others, layers = unit_bytes(info)
    name = f"{target.name}: gate"
    if name in whole and placement.lockstep:
        shared = shared_bytes(info, target.method.format, recipe.dtype)
        return lockstep_bytes(whole["baseline"] + whole[name] - shared, info, c.seq_len, c.eval_windows)
    if name in whole:
        return scoring_bytes(whole[name], info, c.seq_len, c.eval_windows, SCORING_COPIES)
    matrix = largest_matrix(info) or max(others.values(), default=0)
    return candidate_bytes(target, info, matrix, streams_gate(target, info, recipe)) + streamed


def held_bytes(info, recipe, others: dict[str, int], layers: dict[str, int], working: int,
               tables_on_disk: bool = True) -> int:
    """What RAM holds of a model loaded for a method (quantkit.run.pipeline.offload_plan): with --offload-dir
    the norms and one onloaded unit; a text decoder with its tables on disk every decoder layer, the norms,
    and the larger of one table (onloaded for the first layer's inputs, or to save the head) and the
    method's working set; a VLM, or a text decoder whose tables fit beside it, all of it and the working set."""
    from quantkit.arch.vlm import is_vlm

    if recipe.offload_dir:
        return offloaded_bytes(others, layers, working)
    if is_vlm(info.config) or not tables_on_disk:
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


def candidate_bytes(target, info, layer: int, streamed: bool) -> int:
    """What the gate holds of one artifact (`layer`: the 16-bit unit a streamed forward holds at once): read by
    quantkit, that unit in the dtype its format computes in (a .gguf in float32: twice it; a compressed-tensors
    or mlx-lm one dequantized to its stored dtype, a module at a time); loaded whole, loaded_whole_bytes."""
    if streamed:
        return layer * (2 if target.method.format.gate_dtype == "float32" else 1)
    return loaded_whole_bytes(target, info)


def loaded_whole_bytes(target, info) -> int:
    """An artifact loaded whole at its bits: the decoder layers at the method's stored bits, the tensors outside
    them (embeddings, norms, a head the method keeps 16-bit) as stored, as bitsandbytes and compressed-tensors
    keep them (a 262144-entry embedding table is most of a 270M model's bytes); a head it quantizes at its bits."""
    others, layers = unit_bytes(info)
    bits = target.method.sizes.stored_bits(target.options) / 16
    head = 0 if target.method.layers.keeps_lm_head(target.options) else others.get("lm_head", 0)
    return sum(others.values()) - head + int((sum(layers.values()) + head) * bits)


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
                candidate_bytes(t, info, 0, False) + ACTIVATION_BYTES)
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


def check_ram(estimate: RamEstimate, limit: int | None, bound: str = "--max-memory") -> None:
    """InputError with the numbers when the run's estimated peak exceeds the bound (`limit`, named `bound`:
    --max-memory, or the recipe's max_memory), or the memory available now when no limit is given."""
    budget = limit or available_ram()
    if not budget or estimate.peak <= budget:
        return
    source = bound if limit else "available memory"
    raise InputError(f"not enough memory: the run needs about {_size(estimate.peak)} at its peak "
                     f"({estimate.describe()}, plus {_size(estimate.fixed)} fixed), {source} is {_size(budget)}",
                     hint="use --offload-dir for the llm-compressor methods, fewer --eval-windows, "
                     "or a machine with more memory")


# ---------------------------------------------------------------- where the gate's forwards run

GPU_HEADROOM = 0.90  # share of the free GPU memory a resident gate may fill (allocator slack, other processes)
GPU_ACTIVATION_BYTES = 4 * 2**30  # a GPU's windows batched within this much of activations
CPU_ACTIVATION_BYTES = 128 * 2**20  # a resident CPU forward's: no layer is read per batch, so a batch only needs
# rows enough for the matmuls (4 windows of 512 tokens at width 640: 2048 rows), the memory goes to the models
RAM_HEADROOM = 0.10  # share of the memory available now a run leaves free (other processes, page cache, slack)
MIN_RAM_HEADROOM = 512 * 2**20  # and at least this much
BASELINE_COPIES = 2  # chunks of float32 log-probs the baseline's scoring holds: the log-probs, their float16 copy
SCORING_COPIES = 4  # comparing a chunk: the candidate's log-probs, the KL divergence's two float32 buffers and its
# float16 one (quantkit.eval.evaluate.kl_rows)
LOCKSTEP_COPIES = 6  # the same, with the base's log-probs and their float16 copy beside the candidate's


def streamed_bytes(info, seq_len: int, windows: int) -> int:
    """What a streamed forward holds beside its current weight matrix, one phase at a time: a group's hidden
    states throughout, and the largest of the decoder's activations for the group, a slice of the output head
    with the group's logits for it (quantkit.eval.stream.head_slice_rows), and the block of float32 logits
    (stream.block_positions) with the chunks of log-probs the scoring holds while comparing (evaluate.chunk_rows)."""
    from quantkit.eval.evaluate import chunk_rows
    from quantkit.eval.stream import ACTIVATION_BYTES, block_positions, head_slice_rows, windows_per_group
    from quantkit.io.safetensors import DTYPE_BYTES

    vocab, shape, size = vocab_size(info), text_shape(info), DTYPE_BYTES.get(info.dtype, 4)
    positions = min(windows_per_group(shape, seq_len, ACTIVATION_BYTES), max(1, windows)) * seq_len
    rows = min(vocab, head_slice_rows(positions, shape.hidden_size))
    head = rows * shape.hidden_size * size + 4 * rows * positions
    chunk = 4 * vocab * min(chunk_rows(vocab), positions) if vocab else 0
    block = 4 * vocab * min(block_positions(vocab), positions) if vocab else 0
    hidden = positions * shape.hidden_size * size
    return hidden + max(batch_bytes(info, seq_len, windows, ACTIVATION_BYTES), head + block,
                        block + SCORING_COPIES * chunk)


def vocab_size(info) -> int:
    text = info.config.get("text_config") or info.config
    return int(text.get("vocab_size") or 0)


def batch_bytes(info, seq_len: int, windows: int, budget: int) -> int:
    """Activations of one batch of windows (quantkit.eval.stream.windows_per_group: as many as fit `budget` at
    float32, one at least, no more than there are) at the checkpoint's element size (16-bit: half)."""
    from quantkit.eval.stream import windows_per_group
    from quantkit.io.safetensors import DTYPE_BYTES

    shape = text_shape(info)
    group = windows_per_group(shape, seq_len, budget)
    per_window = seq_len * (8 * shape.hidden_size + 3 * shape.intermediate_size + 2 * shape.num_attention_heads * seq_len)
    return min(group, max(1, windows)) * per_window * DTYPE_BYTES.get(info.dtype, 4)


def chunk_bytes(info, seq_len: int, windows: int, cuda: bool = False) -> int:
    """float32 log-probs of one chunk of positions of a resident forward (quantkit.eval.evaluate.chunk_positions)."""
    from quantkit.eval.evaluate import chunk_positions

    vocab = vocab_size(info)
    if not vocab:
        return 0
    return 4 * vocab * min(chunk_positions("cuda" if cuda else "cpu", vocab), max(1, windows * seq_len))


def head_block_bytes(info, seq_len: int, windows: int, cuda: bool = False) -> int:
    """Logits in the model's dtype of one block of positions of a resident forward's output head, held from
    block to block (quantkit.eval.evaluate.head_block_positions)."""
    from quantkit.eval.evaluate import head_block_positions
    from quantkit.io.safetensors import DTYPE_BYTES

    vocab, size = vocab_size(info), DTYPE_BYTES.get(info.dtype, 4)
    if not vocab:
        return 0
    return size * vocab * min(head_block_positions("cuda" if cuda else "cpu", vocab, size), max(1, windows * seq_len))


def resident_activation_bytes(cuda: bool) -> int:
    """The activations a resident forward batches its windows within, on a GPU or a CPU."""
    return GPU_ACTIVATION_BYTES if cuda else CPU_ACTIVATION_BYTES


def scoring_bytes(models: int, info, seq_len: int, windows: int, copies: int, cuda: bool = False,
                  sides: int = 1) -> int:
    """A resident forward: `models` bytes of weights, each side's block of the head's logits, and the larger of
    a batch's activations (beside the two chunks the other side of a lockstep holds) and `copies` chunks of
    log-probs while scoring."""
    budget = resident_activation_bytes(cuda)
    chunk = chunk_bytes(info, seq_len, windows, cuda)
    head = sides * head_block_bytes(info, seq_len, windows, cuda)
    return models + head + max(batch_bytes(info, seq_len, windows, budget) + 2 * chunk, copies * chunk)


def lockstep_bytes(models: int, info, seq_len: int, windows: int) -> int:
    """The base and an artifact resident side by side (`models`: both, less what they share), a batch's
    activations at a time and both sides' chunks of logits."""
    return scoring_bytes(models, info, seq_len, windows, LOCKSTEP_COPIES, sides=2)


def baseline_bytes(info, seq_len: int, windows: int) -> int:
    """The float16 baseline log-probs of the held-out windows."""
    return 2 * windows * seq_len * vocab_size(info)


def kept_baseline_bytes(info, seq_len: int, windows: int, placement) -> int:
    """The baseline's log-probs a run keeps in memory: none in lockstep, all of them where `placement` keeps
    them in memory, else those below the size at which they go to a file (evaluate.SPILL_THRESHOLD)."""
    from quantkit.eval.evaluate import SPILL_THRESHOLD

    stored = baseline_bytes(info, seq_len, windows)
    if placement.lockstep or (placement.spill and stored > SPILL_THRESHOLD):
        return 0
    return stored


def spills(info, seq_len: int, windows: int) -> bool:
    """Whether a baseline that may go to a file does (above evaluate.SPILL_THRESHOLD)."""
    from quantkit.eval.evaluate import SPILL_THRESHOLD

    return baseline_bytes(info, seq_len, windows) > SPILL_THRESHOLD


def shared_bytes(info, fmt, dtype: str = "auto") -> int:
    """What an artifact of the Format `fmt` resident beside the base holds with the same values (quantkit.eval.
    resident.Shared): the tensors outside the decoder layers where the format keeps them as the base stores
    them (Format.keeps_base_tensors: compressed-tensors' embeddings, head and final norm); a .gguf (float32)
    and an mlx-lm directory share nothing."""
    if not fmt.keeps_base_tensors or dtype not in ("auto", info.dtype):
        return 0
    others, _layers = unit_bytes(info)
    return sum(others.values())


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
    """(bytes a resident gate holds on the device with the largest model read whole, its activation budget):
    the model, a batch's activations and the scoring's chunks of logits (scoring_bytes)."""
    budget = resident_activation_bytes(cuda)
    return scoring_bytes(largest, info, seq_len, windows, SCORING_COPIES, cuda), budget


def ram_budget(max_memory: int | None, bound: str = "--max-memory") -> tuple[int, str]:
    """(the peak a run may reach in RAM, what that is): the memory available now less RAM_HEADROOM (at least
    MIN_RAM_HEADROOM), and within `max_memory` (named `bound`: --max-memory, or the recipe's max_memory)
    when the run is bounded."""
    available = available_ram()
    free = available - max(MIN_RAM_HEADROOM, int(RAM_HEADROOM * available)) if available else 0
    if max_memory and (not free or max_memory <= free):
        return max_memory, f"{bound} {_size(max_memory)}"
    if not available:
        return 0, "the memory available now is unknown"
    return max(0, free), f"{_size(available)} available now, less {RAM_HEADROOM:.0%} headroom"


def gate_placement(info, recipe, targets, max_memory: int | None = None, ranks: int = 1,
                   bound: str = "--max-memory"):
    """Where a run's models go, chosen once before any work. On a CPU, the first of cpu_placements whose
    peak (ram_estimate) fits ram_budget: the gate resident (the base scored beside each artifact, or its
    log-probs kept in memory), a method's model whole in RAM, the baseline's log-probs in memory; streamed a
    layer at a time, tables on disk and log-probs in a file only as far as they must. On a GPU the gate is
    resident when the largest model it reads itself fits the free GPU memory (placement_for), and a method's
    model whole on the GPU when the run's GPU peak with it fits, else onloaded from RAM a layer at a time."""
    from dataclasses import replace

    from quantkit.engines.transformers import device_map
    from quantkit.eval.scorers import Placement

    device = device_map(recipe.device)
    if device != "cuda":
        budget, source = ram_budget(max_memory, bound)
        return choose(cpu_placements(info, recipe, targets, ranks), budget, source,
                      lambda p: ram_estimate(info, recipe, targets, p).peak, bounded=max_memory is not None)
    steps = read_whole_bytes(info, recipe, targets)
    c = recipe.calibration
    placement = (placement_for(max(steps.values()), device, info, c.seq_len, c.eval_windows) if steps
                 else Placement(False, device))
    if not any(t.needs_model for t in targets):
        return placement
    whole = vram_estimate(info, recipe, targets, placement).peak <= GPU_HEADROOM * available_vram()
    return replace(placement, onload=not whole)


def measurements(recipe, targets) -> int:
    """How many times the run scores an artifact (a target with a gate-driven fallback counts twice: it may
    measure again)."""
    if not recipe.calibration.eval_windows:
        return 0
    return sum(2 if getattr(t.options, "fallback", None) is not None else 1 for t in targets)


def cpu_placements(info, recipe, targets, ranks: int = 1) -> list:
    """A CPU run's placements, the one to use first: the gate resident (with the baseline's log-probs kept in
    memory, in a file, or in lockstep), the one that holds least first (the kept baseline before the file where
    they hold the same: log-probs below evaluate.SPILL_THRESHOLD stay in memory either way; lockstep after the
    others where several artifacts would each score the base again), then streamed with the log-probs in memory,
    then in a file; each with a method's tables in RAM, then on disk (where a method loads the model).

    A file holds a large vocabulary's log-probs (4 windows of 256 positions of 262144 entries in float16: 512 MiB,
    the size of a 270M model's weights) for the price of writing and reading them once per gate, where in memory
    they sit beside every later step, and lockstep holds the base beside each artifact: the gate's numbers are
    the same from each (the same float16 rows)."""
    from quantkit.eval.scorers import Placement
    from quantkit.eval.stream import ACTIVATION_BYTES

    whole = read_whole_bytes(info, recipe, targets)
    gated = {f"{t.name}: gate" for t in targets} if recipe.calibration.eval_windows else set()
    modes = []
    if whole:
        modes = [{"resident": True, "spill": False}, {"resident": True, "spill": True}]
        if ranks == 1 and gated and gated <= set(whole):  # every model the gate reads, read by quantkit
            modes.append({"resident": True, "spill": False, "lockstep": True})
        again = measurements(recipe, targets) > 1  # lockstep would score the base once per measurement

        def order(mode: dict) -> tuple:
            peak = ram_estimate(info, recipe, targets, Placement(**mode, tables_on_disk=False)).peak
            return (again and mode.get("lockstep", False), peak)

        modes.sort(key=order)
    modes += [{"resident": False, "spill": False}, {"resident": False, "spill": True}]
    tables = [False, True] if any(t.needs_model for t in targets) and not recipe.offload_dir else [False]
    return [Placement(device="cpu", tables_on_disk=on_disk,
                      activation_bytes=CPU_ACTIVATION_BYTES if mode["resident"] else ACTIVATION_BYTES, **mode)
            for mode in modes for on_disk in tables]


def choose(candidates: list, budget: int, source: str, peak, bounded: bool = False):
    """The first candidate Placement whose `peak` fits `budget` (the last one where none does), with why it
    was chosen and, for a streamed one, the room a resident one would have needed; a method's own forwards
    and a streamed group's logits get the budget's room beside the estimated peak, except in a run the user
    bounds (`bounded`): there the estimate's own error (up to about 15% measured) is all the slack the bound
    has, so they take none and stream."""
    from dataclasses import replace

    chosen = next((p for p in candidates if budget and peak(p) <= budget), candidates[-1])
    resident = [peak(p) for p in candidates if p.resident]
    why = f"peak about {_size(peak(chosen))}; {source}: {_size(budget)}"
    if not chosen.resident and resident:
        why = f"resident the run would peak at about {_size(min(resident))}; {source}: {_size(budget)}"
    return replace(chosen, why=why if resident else "", room=0 if bounded else max(0, budget - peak(chosen)))


def placement_for(largest: int, device: str, info, seq_len: int, windows: int):
    """Resident on a GPU when the largest model read whole fits 90% of its free memory
    (quantkit.eval.scorers.Placement); its baseline's log-probs in host memory within a quarter of the RAM."""
    from quantkit.eval.scorers import Placement

    need, activation = resident_need(largest, True, info, seq_len, windows)
    free = available_vram()
    budget = int(GPU_HEADROOM * free) - FIXED_VRAM
    why = f"the model whole needs {_size(need)}; {_size(free)} free on the GPU: {_size(max(0, budget))}"
    stored = baseline_bytes(info, seq_len, windows)
    room = (available_ram() or stored * 4) // 4
    return Placement(need <= budget, device, activation, why, spill=need > budget or stored > room,
                     tables_on_disk=False, room=max(0, budget - need))


def describe_placement(placement, info, seq_len: int, windows: int | None = None) -> str:
    """One line: where the gate runs and why, with the numbers: "gate: resident on cpu, batch 8, the base scored
    beside each artifact (peak about ...; ... available now ...)" or "gate: streamed on cpu, 0.1 GiB per layer
    (resident the run would peak at about ...; ...)"."""
    from quantkit.eval.stream import windows_per_group

    if placement.resident:
        batch = windows_per_group(text_shape(info), seq_len, placement.activation_bytes)
        batch = min(batch, windows) if windows else batch
        kept = where_baseline_goes(placement, info, seq_len, windows)
        return f"gate: resident on {placement.device}, batch {batch}{kept} ({placement.why})"
    _others, layers = unit_bytes(info)
    kept = ", the baseline's log-probs in a file" if placement.spill else ", the baseline's log-probs in memory"
    return (f"gate: streamed on {placement.device}, {_size(max(layers.values(), default=0))} per layer{kept} "
            f"({placement.why})")


def where_baseline_goes(placement, info, seq_len: int, windows: int | None) -> str:
    """describe_placement's words for a resident gate's baseline ("" where the windows are not known yet)."""
    if placement.lockstep:
        return ", the base scored beside each artifact"
    if placement.spill and not windows:
        return ""
    if placement.spill and spills(info, seq_len, windows):
        return ", the baseline's log-probs in a file"
    return ", the baseline's log-probs in memory"


def eval_estimate(info, fmt, seq_len: int, windows: int, placement, reads_artifact: bool = True) -> RamEstimate:
    """`quantkit eval`'s peak per step, as ram_estimate's baseline and gate steps: the base and an artifact of
    the Format `fmt` (`reads_artifact`: read by quantkit; else loaded whole through its format's `load`)."""
    kept = kept_baseline_bytes(info, seq_len, windows, placement)
    base, artifact = whole_bytes(info), whole_bytes(info, fmt.gate_dtype)
    if placement.lockstep:
        shared = shared_bytes(info, fmt) if reads_artifact else 0
        return RamEstimate({"base and artifact": lockstep_bytes(base + artifact - shared, info, seq_len, windows)})
    if placement.resident:
        base_step = scoring_bytes(base, info, seq_len, windows, BASELINE_COPIES)
        artifact_step = scoring_bytes(artifact, info, seq_len, windows, SCORING_COPIES)
    else:
        matrix = largest_matrix(info)
        base_step = matrix + streamed_bytes(info, seq_len, windows)
        artifact_step = base_step + (matrix if fmt.gate_dtype == "float32" else 0)  # a .gguf's matrix in float32
    if not reads_artifact:
        artifact_step = scoring_bytes(artifact, info, seq_len, windows, SCORING_COPIES)
    return RamEstimate({"baseline": base_step + kept, "artifact": artifact_step + kept})


def eval_placement(info, fmt, device: str, seq_len: int, windows: int, max_memory: int | None = None,
                   reads_artifact: bool = True):
    """Where `quantkit eval` runs its forwards for a base of `info`'s shape and an artifact of the Format `fmt`
    (quantkit.formats.detect): as gate_placement, one artifact measured: on a CPU the first of resident (in
    lockstep, or with the baseline kept in memory or in a file, whichever holds least), streamed with the
    baseline's log-probs in memory, in a file, that fits the memory available now (or --max-memory)."""
    from quantkit.eval.scorers import Placement

    if device == "cuda":
        return placement_for(max(whole_bytes(info), whole_bytes(info, fmt.gate_dtype)), device, info, seq_len, windows)
    budget, source = ram_budget(max_memory)
    batch = CPU_ACTIVATION_BYTES
    resident = [Placement(True, "cpu", batch, spill=False), Placement(True, "cpu", batch),
                Placement(True, "cpu", batch, spill=False, lockstep=True)]

    def peak(p) -> int:
        return FIXED_RAM + max(eval_estimate(info, fmt, seq_len, windows, p, reads_artifact).steps.values())

    resident.sort(key=peak)
    candidates = [*resident, Placement(False, "cpu", spill=False), Placement(False, "cpu")]
    return choose(candidates, budget, source, peak, bounded=max_memory is not None)
