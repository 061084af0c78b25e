"""GGUF mixed precision: what quantizing one tensor at each type costs, and per-tensor types under a budget.

The candidates of a tensor are the types llama.cpp can give it and quantkit has a kernel for
(quantkit.gguf.quants.SUPPORTED, so new kernels join by themselves): the k-quants (Q2_K ... Q6_K) and
the 256-value i-quants (IQ4_XS, ...) where its rows are a multiple of 256 values, the 32-value types
(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL) everywhere (where the rows are not a multiple of 256 they are the
only ones: llama.cpp's fallback types). The types llama.cpp makes only with an imatrix (IQ3_XXS, IQ2_*,
IQ1_*) are candidates only when the tensor is quantized with one (never token_embd and output). For
every quantized tensor of the plan and every candidate, the tensor is quantized with quantkit's own
kernels (the bytes llama-quantize would write, imatrix included) and dequantized with gguf-py, and
the error is weighted by what the tensor's input carries:

    error(t, type) = sum_rows sum_j importance_j * (w - dequant(quant(w, type)))_j^2

importance_j is the imatrix entry (mean x_j^2 of the input column on the calibration windows), so
the error is the mean squared error the matmul's output takes on. token_embd has no matmul input:
its rows are weighted by how often each token occurs in the calibration windows instead; the
output head (no imatrix entry, as llama-imatrix) is weighted uniformly. Each row is quantized on its own,
so the sum is estimated from ERROR_ROWS rows of each matrix drawn across its weighted row norms and
scaled by the norms' ratio (`error_sample`): the table costs a fixed number of rows per matrix and
candidate, not the matrix (token_embd's rows of tokens the calibration lacks weigh 0 and are skipped
exactly). A candidate that is no
smaller than another with less error (Q4_0 beside Q4_K, both 4.5 bits per weight) is dropped from
the tensor's choices (quantkit.mixed.sensitivity.frontier).

Errors of different tensors are in different units (an attn_k error passes a softmax, an
ffn_down error lands on the residual stream), so with `measure` the errors are scaled into KL
divergence by gains measured on a few probe tensors per role and interpolated over depth
(quantkit.mixed.sensitivity: the calibration windows through the layer-streamed forward with only
the probe quantized at PROBE, or at its cheapest candidate where PROBE does not fit its rows). Without
`measure`, damage = error. The table is plain data (`Sensitivity.as_dict`), stored in the
report's details and read back by the fallback.

Per-tensor types under a size budget: `assign_types` is quantkit.mixed.budget.assign (greedy
marginal-gain knapsack) with the GGUF byte sizes. The size of a tensor is its data padded to the file's alignment (32 bytes, gguf-py's writer and
llama.cpp's default), so the tensors' total is exactly what they take in the file: a budget of the
mixture's total gives a file no larger than the mixture's (the metadata is the same).

The result is an ordinary per-tensor type map. `override_lines` writes it as llama-quantize
`--tensor-type-file` lines: one anchored regex per quantized tensor. llama-quantize matches each
pattern with std::regex_search on the tensor name (so `attn_v` alone would match every layer and
`output.weight` would match `attn_output.weight`), and a tensor matched by a pattern skips the
mixture rules entirely; every quantized tensor is named, so the mixture's attn_v / ffn_down
counters never matter and the file reproduces the types exactly.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT

from quantkit.gguf.mixture import IMATRIX_TYPES, UNQUANTIZED, T, category
from quantkit.mixed import budget
from quantkit.mixed.sensitivity import PROBES_PER_ROLE, SensitivityRow, frontier


HEAD_TENSORS = ("token_embd.weight", "output.weight")


def bits_per_weight(qtype: T) -> float:
    block, size = GGML_QUANT_SIZES[qtype]
    return 8 * size / block


def candidate_types() -> tuple[T, ...]:
    """Every quantized type quantkit has a kernel for, fewest bits first (a 256-block type before a
    32-block one of the same size: Q4_K before Q4_0)."""
    from quantkit.gguf.quants import SUPPORTED

    quantized = [t for t in SUPPORTED if t not in UNQUANTIZED]
    return tuple(sorted(quantized, key=lambda t: (bits_per_weight(t), -GGML_QUANT_SIZES[t][0])))
PROBE = T.Q3_K  # the type each probe tensor's KL divergence is measured at (where its rows take it)
SLAB_ELEMENTS = 1 << 21  # float32 values read and quantized at a time
ERROR_ROWS = 64  # rows of a matrix its weighted errors are measured on (see error_sample)


def table_row(name: str, shape: tuple[int, ...], plain: str, errors: dict[str, float]) -> SensitivityRow:
    """A sensitivity row of one tensor: candidates in size order with the dominated ones left out,
    probed at PROBE where its rows take it, else at its cheapest candidate."""
    order = frontier(errors, lambda name: bits_per_weight(T[name]))
    probe = PROBE.name if PROBE.name in errors else next(iter(errors))
    return SensitivityRow(name, tuple(shape), dict(errors), probe, plain, order=order)


@dataclass
class Sensitivity:
    tensors: list[SensitivityRow]
    measured: bool  # damage scaled by measured KL divergence (else: the weighted error alone)
    windows: int = 0  # calibration windows the KL divergences were measured on
    seconds: dict[str, float] = field(default_factory=dict)  # "errors", "kld"
    probes: int = 0  # tensors whose KL divergence was measured

    def by_name(self) -> dict[str, SensitivityRow]:
        return {t.name: t for t in self.tensors}

    def as_dict(self) -> dict:
        return {"measured": self.measured, "windows": self.windows, "probes": self.probes, "seconds": self.seconds,
                "candidates": [c.name for c in candidate_types()], "tensors": [t.as_dict() for t in self.tensors]}

    @classmethod
    def from_dict(cls, data: dict) -> "Sensitivity":
        return cls([SensitivityRow.from_dict(r) for r in data["tensors"]], data["measured"], data["windows"],
                   dict(data["seconds"]), data.get("probes", 0))


def candidates(ncols: int, imatrix: bool = False) -> list[T]:
    """The candidate types whose block size divides a row (k-quants and IQ4_XS need multiples of 256),
    fewest bits first; the types that need an imatrix only when the tensor is quantized with one."""
    return [c for c in candidate_types()
            if ncols % GGML_QUANT_SIZES[c][0] == 0 and (imatrix or c not in IMATRIX_TYPES)]


def plan_candidates(plan, has_imatrix: bool) -> list[T]:
    """A tensor's candidates when the run has an imatrix or not (token_embd and output never get one)."""
    weighted = has_imatrix and category(plan.name) not in ("token_embd", "output")
    return candidates(plan.shape[-1], weighted)


def quantized_plans(plans) -> list:
    """The TensorPlans the mixture quantizes (the ones whose type a budget may change)."""
    return [p for p in plans if p.qtype not in UNQUANTIZED and candidates(p.shape[-1])]


def token_frequencies(windows, rows: int) -> np.ndarray:
    """Share of each token id among the calibration windows' tokens (token_embd's row weights)."""
    ids = np.asarray(windows).reshape(-1)
    counts = np.bincount(ids[ids < rows], minlength=rows).astype(np.float64)
    return (counts / max(1, ids.size)).astype(np.float32)


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


def row_norms(handle, hf_name: str, rows: int, ncols: int, col_weights) -> np.ndarray:
    """sum_j col_weight_j * w_ij^2 of every row i of a source matrix (float64), read a slab at a time."""
    step = max(1, SLAB_ELEMENTS // ncols)
    norms = []
    for start in range(0, rows, step):
        data = handle.read(hf_name, start, min(rows, start + step))
        data *= data
        if col_weights is not None:
            data *= col_weights
        norms.append(data.sum(axis=1, dtype=np.float64))
    return np.concatenate(norms)


def error_sample(handle, hf_name: str, rows: int, ncols: int, col_weights, row_weights,
                 limit: int = ERROR_ROWS) -> tuple[np.ndarray, float]:
    """(rows, scale): the rows of a matrix its weighted errors are measured on, and the factor that takes
    their sum to the whole matrix's. Every GGUF type quantizes each row on its own (blocks within a row;
    the imatrix weights columns), so a matrix's error is the sum of its rows'. With row weights
    (token_embd: token frequencies) the rows of weight 0 add nothing and are left out, exactly. Otherwise
    a matrix of more than `limit` rows is sampled: `limit` rows spread evenly over the rows ordered by
    their weighted norm (large and small rows both drawn), the sum scaled by the whole matrix's weighted
    norm over the sample's (a rounding error is close to proportional to the row's norm, so the ratio
    holds where a plain count would not: a few outlier rows carry much of the error)."""
    if row_weights is not None:
        return np.flatnonzero(row_weights[:rows]), 1.0
    if rows <= limit:
        return np.arange(rows), 1.0
    norms = row_norms(handle, hf_name, rows, ncols, col_weights)
    order = np.argsort(norms, kind="stable")
    index = np.unique(order[np.linspace(0, rows - 1, limit).round().astype(np.int64)])
    sampled = norms[index].sum()
    return index, float(norms.sum() / sampled) if sampled > 0 else rows / len(index)


def sampled_slabs(handle, hf_name: str, index: np.ndarray, ncols: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(row numbers, float32 rows) of the rows `index` (sorted, unique) of a source matrix, a slab at a
    time, each contiguous run of rows read at once."""
    step = max(1, SLAB_ELEMENTS // ncols)
    for start in range(0, len(index), step):
        part = index[start:start + step]
        runs = np.split(part, np.flatnonzero(np.diff(part) != 1) + 1)
        yield part, np.concatenate([handle.read(hf_name, int(run[0]), int(run[-1]) + 1) for run in runs])


class RowBlock:
    """A source handle read from row `first` on: a split's piece (TensorPlan.source_rows) as its own matrix."""

    def __init__(self, handle, first: int):
        self.handle, self.first = handle, first

    def read(self, name: str, start: int, stop: int) -> np.ndarray:
        return self.handle.read(name, self.first + start, self.first + stop)


def piece_handle(handles, plan, hf: str):
    """The handle a plan's matrix is read through: its source's, from the piece's first row for a split's piece."""
    return handles[hf] if plan.source_rows is None else RowBlock(handles[hf], plan.source_rows[0])


def rewritten(plan) -> bool:
    """Whether a plan's matrices are the converter's written values rather than rows of its source as stored: the
    family's step changes them (a transposition, a de-interleave, a reordering of columns, a cut into pieces of
    their own shapes), or a 3-D source is written as it is stored (one matrix per expert)."""
    return (not plan.sources and plan.values is None and len(plan.shape) >= 2
            and (plan.transform is not None or len(plan.shape) == 3))


class ArrayRows:
    """A handle over a matrix in memory: a rewritten plan's (`rewritten`) matrix read as a source's rows."""

    def __init__(self, data: np.ndarray):
        self.data = data

    def read(self, name: str, start: int, stop: int) -> np.ndarray:
        return np.array(self.data[start:stop], dtype=np.float32)


class Written:
    """The written values of the rewritten plans of a checkpoint and the way back to its tensors: each source the
    converter changes is read, changed as the converter changes it (its plan's transform), and its Hugging Face
    values are got back from its pieces as the gate reads the file (quantkit.gguf.loader.from_written, with the
    configuration the plans were made with: a text decoder's, whose stored names are the ones the converter maps)."""

    def __init__(self, handles, plans, config: dict):
        self.handles, self.config, self.pieces = handles, config, {}
        for p in plans:
            if rewritten(p):
                self.pieces.setdefault(p.hf_name, []).append(p)
        if config:
            self.pieces = {hf: split_order(config, hf, pieces) if len(pieces) > 1 else pieces
                           for hf, pieces in self.pieces.items()}

    def values(self, plan) -> np.ndarray:
        """A plan's float32 values in its written shape (what quantkit.gguf.convert.matrix_data quantizes)."""
        from quantkit.gguf.convert import written_values

        return written_values(self.handles[plan.hf_name], plan, plan.hf_name, plan.shape)

    def source(self, hf: str, replaced: dict[str, np.ndarray]) -> np.ndarray:
        """The source `hf` from its pieces' written values, those `replaced` names ({GGUF name: values}) in place."""
        from quantkit.gguf.loader import from_written

        parts = [replaced[p.name] if p.name in replaced else self.values(p) for p in self.pieces[hf]]
        return np.ascontiguousarray(from_written(self.config, hf, parts), dtype=np.float32)


def split_order(config: dict, hf: str, pieces: list) -> list:
    """A source's plans in the order its split cuts it (the order the reading joins them in), not the file's."""
    from quantkit.gguf.convert import gguf_name, name_map, split_names, tensor_rule

    tmap = name_map(config)
    order = [gguf_name(tmap, n) for n in split_names(tensor_rule(config, hf), hf)]
    return sorted(pieces, key=lambda p: order.index(p.name))


def split_matrices(values: np.ndarray, quant_imatrix, importance) -> Iterator[tuple[np.ndarray, object, object]]:
    """(matrix, quantizer's imatrix, importance) of each matrix of written values: the tensor, or each matrix of a
    3-D one with its own row-sized slice of the vectors (llama-quantize's importance per expert or head)."""
    if values.ndim == 2:
        yield values, quant_imatrix, importance
        return
    n = values.shape[-1]
    for i, matrix in enumerate(values):
        part = slice(i * n, (i + 1) * n)
        yield (matrix, None if quant_imatrix is None else quant_imatrix[part],
               None if importance is None else importance[part])


def plan_matrices(handles, written: Written, plan, quant_imatrix, importance) -> Iterator[tuple]:
    """(handle, name, rows, quantizer's imatrix, importance) of each 2-D matrix a plan quantizes: rows of its
    sources as stored (`matrices`), or of its written values where the converter changes them (`rewritten`)."""
    if rewritten(plan):
        for matrix, qim, imp in split_matrices(written.values(plan), quant_imatrix, importance):
            yield ArrayRows(matrix), plan.name, matrix.shape[0], qim, imp
        return
    for hf, rows, qim, imp in matrices(handles, plan, quant_imatrix, importance):
        yield piece_handle(handles, plan, hf), hf, rows, qim, imp


def round_trip(values: np.ndarray, qtype: T, quant_imatrix, threads: int = 1) -> np.ndarray:
    """Written values quantized at qtype and dequantized as the file holds them (each matrix of a 3-D tensor with
    its own importance vector)."""
    from quantkit.gguf.quants import dequantize, quantize

    out = [dequantize(quantize(m, qtype, qim, threads=threads), qtype).reshape(m.shape)
           for m, qim, _ in split_matrices(values, quant_imatrix, None)]
    return out[0] if values.ndim == 2 else np.stack(out)


def tensor_errors(handles, plan, quant_imatrix, importance, row_weights, threads: int = 1,
                  written: Written | None = None) -> dict[str, float]:
    """Importance-weighted squared error of one tensor at each candidate type, from the rows `error_sample`
    picks (scaled to the whole matrix where they are a sample); the candidates of a slab quantized on
    `threads` threads (the kernels release the GIL), each candidate's sum taken in the same order."""
    from concurrent.futures import ThreadPoolExecutor

    cands = candidates(plan.shape[-1], quant_imatrix is not None)
    errors = dict.fromkeys((c.name for c in cands), 0.0)
    written = written or Written(handles, [plan], {})
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        for handle, hf, rows, qim, imp in plan_matrices(handles, written, plan, quant_imatrix, importance):
            index, scale = error_sample(handle, hf, rows, plan.shape[-1], imp, row_weights)
            for part, data in sampled_slabs(handle, hf, index, plan.shape[-1]):
                weights = None if row_weights is None else row_weights[part]
                slab = pool.map(lambda c: weighted_error(data, c, qim, imp, weights), cands)
                for c, value in zip(cands, slab):
                    errors[c.name] += scale * value
    return errors


def error_table(model_dir: Path, plans, quant_imatrix: dict | None, importance: dict | None, calib_windows,
                threads: int = 1, progress: Callable[[str], None] = lambda message: None) -> list[SensitivityRow]:
    """Weighted errors of every quantized tensor of the plan (quant_imatrix: what the quantizer uses,
    importance: the imatrix that weights the error; both {GGUF name: vector})."""
    from quantkit.gguf.convert import imatrix_for, open_handles
    from quantkit.io.checkpoint import check_model_dir

    handles = open_handles(check_model_dir(Path(model_dir)).weight_files)
    table, written = [], Written(handles, plans, {})
    budgeted = quantized_plans(plans)
    try:
        for index, p in enumerate(budgeted):
            progress(f"sensitivity: weighted errors of {p.name} ({index + 1}/{len(budgeted)})")
            imp = imatrix_for(p, importance)
            row_weights = token_frequencies(calib_windows, p.shape[0]) if p.name == "token_embd.weight" else None
            errors = tensor_errors(handles, p, imatrix_for(p, quant_imatrix), imp, row_weights, threads, written)
            table.append(table_row(p.name, p.shape, p.qtype.name, errors))
    finally:
        for h in set(handles.values()):
            h.close()
    return table


# ------------------------------------------------------------------ measured KL divergence


def written_of(model_dir: Path, handles, plans) -> Written:
    """The checkpoint's rewritten plans (Written), with the configuration the plans are made with."""
    from quantkit.gguf.convert import load_hparams

    return Written(handles, plans, load_hparams(Path(model_dir)))


def quantized_matrices(handles, plan, qtype: T, quant_imatrix, threads: int = 1, written: Written | None = None) -> dict:
    """{HF name: float32 torch tensor} of a plan's matrices quantized at qtype and dequantized (TypedMatrices of
    that plan alone: a split's piece, the whole source matrix with that piece's rows so; a rewritten plan's
    source got back from its written values with this one quantized)."""
    import torch

    typed = TypedMatrices.of(handles, [(plan, qtype, quant_imatrix)], threads, written)
    return {hf: torch.from_numpy(typed.matrix(hf)) for hf in typed}


def start_layer(name: str, layers: int) -> int:
    """The first decoder layer a GGUF tensor changes: its block's; the head's is after the last one."""
    from quantkit.gguf.mixture import layer_of

    if name == "output.weight":
        return layers
    return max(0, layer_of(name))


def measure_klds(model_dir: Path, rows: list[SensitivityRow], plans, quant_imatrix: dict | None, windows,
                 workdir: Path | None = None, progress: Callable[[str], None] = lambda message: None,
                 threads: int = 1) -> dict:
    """{tensor: KL divergence} of the calibration windows through the streamed float32 forward with only
    that tensor quantized at its row's probe type, against the unquantized forward; each row's `kld`
    and `gain` are set (quantkit.mixed.sensitivity.set_gains)."""
    from quantkit.gguf.convert import imatrix_for, open_handles
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.mixed.sensitivity import Probe, layer_count, probe_klds, set_gains

    plan_of, layers = {p.name: p for p in plans}, layer_count(model_dir)
    handles = open_handles(check_model_dir(Path(model_dir)).weight_files)
    written = written_of(model_dir, handles, plans)

    def probe(row: SensitivityRow) -> Probe:
        plan = plan_of[row.name]
        return Probe(row.name, start_layer(row.name, layers),
                     lambda: quantized_matrices(handles, plan, T[row.probe], imatrix_for(plan, quant_imatrix), threads,
                                                written))

    try:
        klds = probe_klds(model_dir, [probe(r) for r in rows], windows, "auto_precision.measure_windows: 0", workdir,
                          progress)
    finally:
        for h in set(handles.values()):
            h.close()
    set_gains(rows, klds)
    return klds


class TypedMatrices(Mapping):
    """{HF name: float32 torch tensor} of every matrix of the plans `types` names, quantized at its type
    and dequantized when it is read, so a whole type map is applied one layer at a time; the last
    CACHED tensors read are kept (the head is read a slice at a time)."""

    CACHED = 2

    def __init__(self, handles, plans, types: dict[str, T], quant_imatrix: dict | None, threads: int = 1,
                 written: Written | None = None):
        from quantkit.gguf.convert import imatrix_for

        self.handles, self.cache, self.threads, self.written = handles, {}, threads, written
        self.sources: dict[str, list] = {}  # HF name -> (plan, rows, type, imatrix) of each plan reading it
        for p in plans:
            if p.name in types:
                self.add(p, types[p.name], imatrix_for(p, quant_imatrix))

    @classmethod
    def of(cls, handles, entries: list, threads: int = 1, written: Written | None = None) -> "TypedMatrices":
        """The matrices of (plan, type, the quantizer's imatrix vector) entries."""
        typed = cls(handles, [], {}, None, threads, written)
        for plan, qtype, qim in entries:
            typed.add(plan, qtype, qim)
        return typed

    def add(self, plan, qtype: T, quant_imatrix) -> None:
        if rewritten(plan):
            self.sources.setdefault(plan.hf_name, []).append((plan, None, qtype, quant_imatrix))
            return
        for hf, rows, qim, _ in matrices(self.handles, plan, quant_imatrix, None):
            self.sources.setdefault(hf, []).append((plan, rows, qtype, qim))

    def __getitem__(self, hf: str):
        import torch

        if hf not in self.cache:
            self.cache = dict(list(self.cache.items())[1 - self.CACHED:])
            self.cache[hf] = torch.from_numpy(self.matrix(hf))
        return self.cache[hf]

    def matrix(self, hf: str) -> np.ndarray:
        """The source matrix quantized and dequantized: whole, or each split piece (TensorPlan.source_rows) at
        its own type."""
        from quantkit.gguf.quants import dequantize, quantize

        pieces = self.sources[hf]
        if rewritten(pieces[0][0]):  # the source got back from its written pieces, each typed one quantized
            return self.written.source(hf, {plan.name: round_trip(self.written.values(plan), qtype, qim, self.threads)
                                            for plan, _, qtype, qim in pieces})
        whole = None
        for plan, rows, qtype, qim in pieces:
            values = dequantize(quantize(piece_handle(self.handles, plan, hf).read(hf, 0, rows), qtype, qim,
                                         threads=self.threads), qtype)
            if plan.source_rows is None:
                return values
            if whole is None:
                whole = self.handles[hf].read(hf, 0, self.handles[hf].header[hf]["shape"][0])
            whole[plan.source_rows[0]:plan.source_rows[1]] = values
        return whole

    def __iter__(self):
        return iter(self.sources)

    def __len__(self) -> int:
        return len(self.sources)


def measure_type_maps(model_dir: Path, plans, maps: dict[str, dict[str, T]], quant_imatrix: dict | None, windows,
                      workdir: Path | None = None, progress: Callable[[str], None] = lambda message: None,
                      threads: int = 1) -> dict[str, float]:
    """{label: KL divergence} of the calibration windows through the streamed float32 forward with every
    tensor of the map `maps[label]` quantized at its type at once, against the unquantized forward."""
    from quantkit.gguf.convert import open_handles
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.mixed.sensitivity import Probe, probe_klds

    handles = open_handles(check_model_dir(Path(model_dir)).weight_files)
    written = written_of(model_dir, handles, plans)
    probes = [Probe(label, 0, lambda types=types: TypedMatrices(handles, plans, types, quant_imatrix, threads, written))
              for label, types in maps.items()]
    try:
        return probe_klds(model_dir, probes, windows, "auto_precision.measure_windows: 0", workdir, progress)
    finally:
        for h in set(handles.values()):
            h.close()


def measure(model_dir: Path, plans, quant_imatrix: dict | None, importance: dict | None, calib_windows,
            measure_windows: int, threads: int = 1, workdir: Path | None = None,
            probes_per_role: int = PROBES_PER_ROLE, progress: Callable[[str], None] = lambda message: None
            ) -> Sensitivity:
    """The sensitivity table of a plan: weighted errors, and with measure_windows > 0 the gains
    measured on at most that many calibration windows (as many as one pass of the calibration windows
    pays for: quantkit.mixed.sensitivity.probe_windows) for `probes_per_role` tensors of each role
    (quantkit.mixed.sensitivity.probe_names) and interpolated for the others."""
    import time

    from quantkit.mixed.sensitivity import layer_count, probe_names, probe_windows, set_gains

    started = time.perf_counter()
    progress(f"sensitivity: weighted errors of {len(quantized_plans(plans))} tensors at every candidate type")
    table = error_table(model_dir, plans, quant_imatrix, importance, calib_windows, threads, progress)
    seconds = {"errors": round(time.perf_counter() - started, 3)}
    if measure_windows <= 0:
        return Sensitivity(table, False, 0, seconds)
    started = time.perf_counter()
    probes = set(probe_names(table, probes_per_role))
    layers = layer_count(model_dir)
    count = probe_windows(measure_windows, len(calib_windows), layers, [start_layer(n, layers) for n in probes])
    windows = calib_windows[:count]
    progress(f"sensitivity: KL divergence of {len(probes)} probe tensors alone on {len(windows)} windows")
    klds = measure_klds(model_dir, [r for r in table if r.name in probes], plans, quant_imatrix, windows, workdir,
                        progress, threads)
    set_gains(table, klds)
    seconds["kld"] = round(time.perf_counter() - started, 3)
    return Sensitivity(table, True, len(windows), seconds, len(klds))


# ------------------------------------------------------------------ budget


def nbytes(shape: tuple[int, ...], qtype: T) -> int:
    """A tensor's data at `qtype`, padded to the file's alignment."""
    block, size = GGML_QUANT_SIZES[qtype]
    count = 1
    for d in shape:
        count *= d
    data = count // block * size
    return (data + GGUF_DEFAULT_ALIGNMENT - 1) // GGUF_DEFAULT_ALIGNMENT * GGUF_DEFAULT_ALIGNMENT


def tensor_size(row: SensitivityRow, qtype: str) -> int:
    """The size model of quantkit.mixed.budget: a tensor's bytes in the file at a type (by name)."""
    return nbytes(row.shape, T[qtype])


def total_bytes(table: list[SensitivityRow], types: dict[str, T]) -> int:
    return budget.total_bytes(table, {name: t.name for name, t in types.items()}, tensor_size)


def mixture_types(table: list[SensitivityRow]) -> dict[str, T]:
    return {t.name: T[t.plain] for t in table}


def cheapest_bytes(table: list[SensitivityRow]) -> int:
    return budget.cheapest_bytes(table, tensor_size)


def assign_types(table: list[SensitivityRow], allowed: int) -> dict[str, T]:
    """Per-tensor types whose total bytes stay within `allowed`, the predicted damage reduced greedily
    (quantkit.mixed.budget.assign; BudgetError when the cheapest types exceed it)."""
    return {name: T[c] for name, c in budget.assign(table, allowed, tensor_size).items()}


def head_kept(table: list[SensitivityRow]) -> list[SensitivityRow]:
    """The table with the token embedding and the output head limited to their mixture's type or above
    (llama.cpp's rule: a tied embedding is the head, and the head keeps a high type), for a second search."""
    from dataclasses import replace

    def kept(row: SensitivityRow) -> SensitivityRow:
        floor = bits_per_weight(T[row.plain])
        order = tuple(c for c in row.candidates if bits_per_weight(T[c]) >= floor)
        return replace(row, order=order) if order else row

    return [kept(r) if r.name in HEAD_TENSORS else r for r in table]


def override_lines(types: dict[str, T]) -> list[str]:
    """llama-quantize --tensor-type-file lines (anchored regex = type) naming every tensor."""
    return [f"^{re.escape(name)}$={qtype.name.lower()}" for name, qtype in sorted(types.items())]
