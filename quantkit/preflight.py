"""Disk preflight: estimate what a run will write beside OUT and refuse at once when the
filesystem lacks it (exit 2, with the numbers), instead of failing after the long work.

Rough on purpose: per target, the decoder's linear weights at the method's bits and everything
else at 16 bits; a merged LoRA checkpoint at 16 bits; the memory-mapped float16 baseline
(eval_windows x seq_len x vocab). Staging, merged checkpoint and baseline all live on OUT's
filesystem (the staging directory is beside OUT).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

from quantkit.errors import InputError

GGUF_MIX_MARGIN = 1.15  # mixtures give some tensors more bits than the base type (Q4_K_M: Q6_K parts)


@dataclass(frozen=True)
class DiskEstimate:
    artifacts: int
    merged_lora: int
    baseline: int

    @property
    def total(self) -> int:
        return self.artifacts + self.merged_lora + self.baseline


def estimate_bytes(quantized_params: int, other_params: int, target_bits: list[float], lora: bool,
                   eval_windows: int, seq_len: int, vocab: int) -> DiskEstimate:
    """Bytes a run writes: one artifact per target, the merged LoRA model, the float16 baseline."""
    artifacts = sum(int(quantized_params * bits / 8) + 2 * other_params for bits in target_bits)
    merged = 2 * (quantized_params + other_params) if lora else 0
    return DiskEstimate(artifacts, merged, 2 * eval_windows * seq_len * vocab)


def target_bits(method: str, options) -> float:
    """Stored bits per quantized weight, scales included (roughly)."""
    if method in ("gptq", "awq"):
        return options.bits + (32 / options.group_size if options.group_size > 0 else 0)  # fp16 scale + zero
    if method == "nf4":
        return 8.0 if options.scheme == "int8" else 4.127
    if method == "gguf":
        return gguf_bits(options.gguf_type) * GGUF_MIX_MARGIN
    return 8.0  # fp8, smoothquant (int8)


def gguf_bits(gguf_type: str) -> float:
    from gguf import GGML_QUANT_SIZES

    from quantkit.gguf.mixture import FILE_TYPES

    block, size = GGML_QUANT_SIZES[FILE_TYPES[gguf_type][1]]
    return 8 * size / block


def run_estimate(info, recipe, targets: list[tuple[str, object]]) -> DiskEstimate:
    """The estimate for a run: its model, recipe and each target's (method name, options)."""
    from quantkit.plan import classify

    quantized = other = 0
    for name, (_dtype, shape) in info.tensors.items():
        count = 1
        for d in shape:
            count *= d
        if len(shape) == 2 and classify(name) == "decoder":
            quantized += count
        else:
            other += count
    text = info.config.get("text_config") or info.config
    c = recipe.calibration
    return estimate_bytes(quantized, other, [target_bits(m, o) for m, o in targets], bool(recipe.lora),
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
        parts.append(f"baseline logits {_size(estimate.baseline)}")
    raise InputError(f"not enough disk space in {parent}: the run writes about {_size(estimate.total)} "
                     f"({', '.join(parts)}), {_size(free)} is free",
                     hint="free some space, write to another filesystem, or run fewer targets or eval windows")


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
