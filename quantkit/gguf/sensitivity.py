"""Per-tensor sensitivity of a GGUF quantization: what quantizing one tensor at each k-quant costs.

For every quantized tensor of the plan and every candidate type of llama.cpp's k-quant family
(Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_0) the tensor is quantized with quantkit's own kernels (the
bytes llama-quantize would write, imatrix included) and dequantized with gguf-py, and the error
is weighted by what the tensor's input carries:

    error(t, type) = sum_rows sum_j importance_j * (w - dequant(quant(w, type)))_j^2

importance_j is the imatrix entry (mean x_j^2 of the input column on the calibration windows), so
the error is the mean squared error the matmul's output takes on. token_embd has no matmul input:
its rows are weighted by how often each token occurs in the calibration windows instead; the
output head (no imatrix entry, as llama-imatrix) is weighted uniformly.

Errors of different tensors are in different units (an attn_k error passes a softmax, an
ffn_down error lands on the residual stream), so with `measure` each tensor's error curve is
scaled by a measured KL divergence: the calibration windows are run through the layer-streamed
forward (quantkit.stream) with only that tensor quantized at PROBE, and

    damage(t, type) = kld(t, PROBE) * error(t, type) / error(t, PROBE)

(KL divergence is quadratic in a small output perturbation, and so is the error). Without
`measure`, damage = error. The table is plain data (`Sensitivity.as_dict`), stored in the
report's details and read back by the fallback.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from quantkit.gguf.mixture import UNQUANTIZED, T
from quantkit.mixed import scaled_damage

CANDIDATES = (T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K, T.Q8_0)  # the k-quant family, fewest bits first
PROBE = T.Q3_K  # the type each tensor's KL divergence is measured at
SLAB_ELEMENTS = 1 << 21  # float32 values read and quantized at a time


@dataclass
class TensorSensitivity:
    name: str  # GGUF tensor name
    shape: tuple[int, ...]
    mixture: str  # the type llama.cpp's mixture gives it
    errors: dict[str, float]  # candidate type name -> importance-weighted squared error
    kld: float | None = None  # measured KL divergence with only this tensor at `probe`
    probe: str = PROBE.name

    @property
    def candidates(self) -> list[T]:
        return [T[name] for name in self.errors]

    def damage(self, qtype: T) -> float:
        return scaled_damage(self.kld, self.errors[qtype.name], self.errors[self.probe])

    def as_dict(self) -> dict:
        return {"tensor": self.name, "shape": list(self.shape), "mixture": self.mixture, "probe": self.probe,
                "kld": self.kld, "errors": self.errors,
                "damage": {c.name: self.damage(c) for c in self.candidates}}

    @classmethod
    def from_dict(cls, row: dict) -> "TensorSensitivity":
        return cls(row["tensor"], tuple(row["shape"]), row["mixture"], dict(row["errors"]), row["kld"], row["probe"])


@dataclass
class Sensitivity:
    tensors: list[TensorSensitivity]
    measured: bool  # damage scaled by measured KL divergence (else: the weighted error alone)
    windows: int = 0  # calibration windows the KL divergences were measured on
    seconds: dict[str, float] = field(default_factory=dict)  # "errors", "kld"

    def by_name(self) -> dict[str, TensorSensitivity]:
        return {t.name: t for t in self.tensors}

    def as_dict(self) -> dict:
        return {"measured": self.measured, "windows": self.windows, "seconds": self.seconds,
                "candidates": [c.name for c in CANDIDATES], "tensors": [t.as_dict() for t in self.tensors]}

    @classmethod
    def from_dict(cls, data: dict) -> "Sensitivity":
        return cls([TensorSensitivity.from_dict(r) for r in data["tensors"]], data["measured"], data["windows"],
                   dict(data["seconds"]))


def candidates(ncols: int) -> list[T]:
    """The candidate types whose block size divides a row (k-quants need multiples of 256)."""
    from gguf import GGML_QUANT_SIZES

    return [c for c in CANDIDATES if ncols % GGML_QUANT_SIZES[c][0] == 0]


def quantized_plans(plans) -> list:
    """The TensorPlans the mixture quantizes (the ones whose type a budget may change)."""
    return [p for p in plans if p.qtype not in UNQUANTIZED and candidates(p.shape[-1])]


def token_frequencies(windows, rows: int) -> np.ndarray:
    """Share of each token id among the calibration windows' tokens (token_embd's row weights)."""
    ids = np.asarray(windows).reshape(-1)
    counts = np.bincount(ids[ids < rows], minlength=rows).astype(np.float64)
    return (counts / max(1, ids.size)).astype(np.float32)


def slabs(handle, hf_name: str, rows: int, ncols: int) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, float32 rows) of one source matrix, a slab at a time."""
    step = max(1, SLAB_ELEMENTS // ncols)
    for start in range(0, rows, step):
        yield start, handle.read(hf_name, start, min(rows, start + step))


def matrices(handles, plan, quant_imatrix, importance) -> Iterator[tuple[str, int, np.ndarray | None, np.ndarray | None]]:
    """(HF name, rows, quantizer's imatrix, importance) of each 2-D matrix of a plan (one per expert)."""
    n = plan.shape[-1]
    if not plan.sources:
        yield plan.hf_name, plan.shape[0], quant_imatrix, importance
        return
    for i, hf in enumerate(plan.sources):
        part = slice(i * n, (i + 1) * n)
        yield (hf, plan.shape[1], None if quant_imatrix is None else quant_imatrix[part],
               None if importance is None else importance[part])


def weighted_error(rows: np.ndarray, qtype: T, quant_imatrix, col_weights, row_weights, threads: int = 1) -> float:
    """sum over the slab of col_weight_j * row_weight_i * (w - dequant(quant(w)))^2."""
    from quantkit.gguf.quants import dequantize, quantize

    diff = rows - dequantize(quantize(rows, qtype, quant_imatrix, threads=threads), qtype)
    diff *= diff
    if col_weights is not None:
        diff *= col_weights
    if row_weights is not None:
        diff *= row_weights[:, None]
    return float(diff.sum(dtype=np.float64))


def tensor_errors(handles, plan, quant_imatrix, importance, row_weights, threads: int = 1) -> dict[str, float]:
    """Importance-weighted squared error of one tensor at each candidate type."""
    cands = candidates(plan.shape[-1])
    errors = dict.fromkeys((c.name for c in cands), 0.0)
    for hf, rows, qim, imp in matrices(handles, plan, quant_imatrix, importance):
        for start, data in slabs(handles[hf], hf, rows, plan.shape[-1]):
            weights = None if row_weights is None else row_weights[start:start + len(data)]
            for c in cands:
                errors[c.name] += weighted_error(data, c, qim, imp, weights, threads)
    return errors


def error_table(model_dir: Path, plans, quant_imatrix: dict | None, importance: dict | None, calib_windows,
                threads: int = 1) -> list[TensorSensitivity]:
    """Weighted errors of every quantized tensor of the plan (quant_imatrix: what the quantizer uses,
    importance: the imatrix that weights the error; both {GGUF name: vector})."""
    from quantkit.gguf.convert import imatrix_for, open_handles
    from quantkit.model import check_model_dir

    handles = open_handles(check_model_dir(Path(model_dir)).weight_files)
    table = []
    try:
        for p in quantized_plans(plans):
            imp = imatrix_for(p, importance)
            row_weights = token_frequencies(calib_windows, p.shape[0]) if p.name == "token_embd.weight" else None
            errors = tensor_errors(handles, p, imatrix_for(p, quant_imatrix), imp, row_weights, threads)
            probe = PROBE.name if PROBE.name in errors else next(iter(errors))
            table.append(TensorSensitivity(p.name, tuple(p.shape), p.qtype.name, errors, probe=probe))
    finally:
        for h in set(handles.values()):
            h.close()
    return table


# ------------------------------------------------------------------ measured KL divergence


def quantized_matrices(handles, plan, qtype: T, quant_imatrix) -> dict:
    """{HF name: float32 torch tensor} of a plan's matrices quantized at qtype and dequantized."""
    import torch

    from quantkit.gguf.quants import dequantize, quantize

    out = {}
    for hf, rows, qim, _ in matrices(handles, plan, quant_imatrix, None):
        data = handles[hf].read(hf, 0, rows)
        out[hf] = torch.from_numpy(dequantize(quantize(data, qtype, qim), qtype))
    return out


def measure_klds(model_dir: Path, table: list[TensorSensitivity], plans, quant_imatrix: dict | None, windows,
                 workdir: Path | None = None) -> None:
    """Fill each row's `kld`: the calibration windows through the streamed float32 forward with only
    that tensor quantized at its probe type, against the unquantized forward."""
    from quantkit.gguf.convert import imatrix_for, open_handles
    from quantkit.mixed import single_tensor_klds
    from quantkit.model import check_model_dir

    plan_of = {p.name: p for p in plans}
    handles = open_handles(check_model_dir(Path(model_dir)).weight_files)

    def patches():
        for row in table:
            plan = plan_of[row.name]
            yield row.name, quantized_matrices(handles, plan, T[row.probe], imatrix_for(plan, quant_imatrix))

    try:
        klds = single_tensor_klds(model_dir, patches(), windows, "auto_precision.measure_windows: 0", workdir)
    finally:
        for h in set(handles.values()):
            h.close()
    for row in table:
        row.kld = klds[row.name]


def measure(model_dir: Path, plans, quant_imatrix: dict | None, importance: dict | None, calib_windows,
            measure_windows: int, threads: int = 1, workdir: Path | None = None) -> Sensitivity:
    """The sensitivity table of a plan: weighted errors, and with measure_windows > 0 the KL
    divergences measured on that many calibration windows."""
    import time

    started = time.perf_counter()
    table = error_table(model_dir, plans, quant_imatrix, importance, calib_windows, threads)
    seconds = {"errors": round(time.perf_counter() - started, 3)}
    windows = calib_windows[:measure_windows]
    if measure_windows > 0:
        started = time.perf_counter()
        measure_klds(model_dir, table, plans, quant_imatrix, windows, workdir)
        seconds["kld"] = round(time.perf_counter() - started, 3)
    return Sensitivity(table, measure_windows > 0, len(windows) if measure_windows > 0 else 0, seconds)
