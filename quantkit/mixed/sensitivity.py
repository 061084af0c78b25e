"""Sensitivity: what quantizing one unit at each candidate precision costs, in KL divergence.

A unit (a GGUF tensor, a Linear layer) has a weighted error at each candidate precision (in its own
units: the output MSE its quantization adds to the layer's output). The damage model turns errors
into KL divergence:

    damage(t, c) = gain(t) * error(t, c)

where gain(t) is the KL divergence per unit of error. It is measured for a few probe units (the
calibration windows through the layer-streamed forward with only that unit quantized at its probe
precision: gain = kld / error(probe)) and interpolated for the rest: units are grouped by role (the
name with its layer index taken out: `blk.N.ffn_down.weight`, `model.layers.N.mlp.down_proj`) and
a role's gain is interpolated linearly over depth between its probes. KL divergence is quadratic in
a small output perturbation, as the error is, so within one role and depth the error ranks the
candidates and the gain carries what the rest of the network makes of that role at that depth.
Probes start the forward at their own layer (quantkit.eval.stream.start_scorer: the inputs of the
probed layers are recorded once), so a probe in the last layer costs one layer, not the whole model.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterable, Sequence

from quantkit.engines.llmcompressor.distributed import Ranks
from quantkit.errors import UnsupportedError

PROBES_PER_ROLE = 3  # units of one role whose KL divergence is measured: the first, middle and last layer's


@dataclass
class SensitivityRow:
    """One unit's weighted error at each candidate precision (cheapest first), and its gain."""

    name: str
    shape: tuple[int, ...]
    errors: dict[str, float]  # candidate -> weighted error, cheapest candidate first
    probe: str  # the candidate its KL divergence is measured at (when it is a probe)
    plain: str = ""  # the precision the plain (not mixed) artifact gives it
    kld: float | None = None  # measured KL divergence with only this unit at `probe` (None: not a probe)
    gain: float | None = None  # KLD per unit of error: measured (kld / error(probe)) or interpolated
    order: tuple[str, ...] = ()  # candidates cheapest first, dominated ones left out (default: `errors`' order)

    def __post_init__(self) -> None:
        self.order = tuple(self.order or self.errors)

    @property
    def candidates(self) -> list[str]:
        return list(self.order)

    def damage(self, candidate: str) -> float:
        error = self.errors[candidate]
        return error if self.gain is None else self.gain * error

    def as_dict(self) -> dict:
        return {"tensor": self.name, "shape": list(self.shape), "plain": self.plain, "probe": self.probe,
                "kld": self.kld, "gain": self.gain, "errors": self.errors, "candidates": self.candidates,
                "damage": {c: self.damage(c) for c in self.candidates}}

    @classmethod
    def from_dict(cls, row: dict) -> "SensitivityRow":
        return cls(row["tensor"], tuple(row["shape"]), dict(row["errors"]), row["probe"], row.get("plain", ""),
                   row["kld"], row.get("gain"), tuple(row.get("candidates", ())))


def frontier(errors: dict[str, float], cost: Callable[[str], float]) -> tuple[str, ...]:
    """The candidates worth choosing, cheapest first: each has a lower error than every candidate that
    costs no more (a same-size or dearer candidate with no less error is never chosen)."""
    kept, best = [], float("inf")
    for candidate in sorted(errors, key=lambda c: (cost(c), errors[c])):
        if errors[candidate] < best:
            kept.append(candidate)
            best = errors[candidate]
    return tuple(kept)


def role_and_depth(name: str) -> tuple[str, int | None]:
    """(role, layer index) of a unit name: the first index component is the layer (blk.N.,
    layers.N.), later ones (experts) are folded into the role; (name, None) without an index."""
    match = re.search(r"(^|\.)(\d+)\.", name)
    if match is None:
        return name, None
    role = name[:match.start(2)] + "N" + re.sub(r"\.\d+\.", ".*.", name[match.end(2):])
    return role, int(match.group(2))


def probe_names(rows: Sequence[SensitivityRow], per_role: int = PROBES_PER_ROLE) -> list[str]:
    """The rows whose KL divergence is measured: per role, `per_role` layers spread evenly from the
    first to the last (every row of a role with fewer layers)."""
    by_role: dict[str, list[tuple[int, str]]] = {}
    for r in rows:
        role, depth = role_and_depth(r.name)
        by_role.setdefault(role, []).append((depth or 0, r.name))
    chosen = []
    for members in by_role.values():
        members.sort()
        count = min(len(members), max(1, per_role))
        picks = sorted({round(i * (len(members) - 1) / max(1, count - 1)) for i in range(count)})
        chosen += [members[i][1] for i in picks]
    return chosen


def probe_windows(limit: int, calib_windows: int, layers: int, starts: Sequence[int]) -> int:
    """How many calibration windows the probes are measured on: at most `limit`, and no more than keeps the
    probes' forwards (each from its start layer through the head, the head counted as one layer) within
    one pass of every calibration window through the model, so that the measurement grows with the
    calibration asked for instead of costing a fixed number of windows; at least one."""
    passes = sum(layers + 1 - min(layers, s) for s in starts)
    return max(1, min(limit, calib_windows * (layers + 1) // max(1, passes)))


def set_gains(rows: Sequence[SensitivityRow], klds: dict[str, float]) -> None:
    """Each row's gain: kld / error(probe) where it was measured; elsewhere interpolated linearly over
    depth between the measured rows of its role (the nearest one's beyond them; the mean of every
    measured gain for a role without any)."""
    for r in rows:
        if r.name in klds:
            r.kld = klds[r.name]
            reference = r.errors[r.probe]
            r.gain = r.kld / reference if reference > 0 else 0.0
    known: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        if r.name in klds:
            role, depth = role_and_depth(r.name)
            known.setdefault(role, []).append((depth or 0, r.gain))
    gains = [g for points in known.values() for _, g in points]
    fallback = sum(gains) / len(gains) if gains else None
    for r in rows:
        if r.name not in klds:
            role, depth = role_and_depth(r.name)
            r.gain = interpolate(sorted(known[role]), depth or 0) if role in known else fallback


def ranks(values: Sequence[float]) -> list[float]:
    """Ranks from 0, ties sharing the mean of their ranks."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    start = 0
    while start < len(order):
        end = start
        while end + 1 < len(order) and values[order[end + 1]] == values[order[start]]:
            end += 1
        for i in order[start:end + 1]:
            out[i] = (start + end) / 2
        start = end + 1
    return out


def rank_correlation(xs: Sequence[float], ys: Sequence[float]) -> float | None:
    """Spearman's rank correlation of two equally long sequences (None below three points or without spread)."""
    if len(xs) < 3:
        return None
    rx, ry = ranks(xs), ranks(ys)
    mx, my = sum(rx) / len(rx), sum(ry) / len(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    spread = (sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry)) ** 0.5
    return cov / spread if spread else None


def proxy_agreement(rows: Sequence[SensitivityRow]) -> float | None:
    """How well the weighted error alone (the cheap proxy) ranks the probes' measured KL divergence: Spearman's
    rank correlation over the probe rows (1: the same order)."""
    probes = [r for r in rows if r.kld is not None]
    return rank_correlation([r.errors[r.probe] for r in probes], [r.kld for r in probes])


def interpolate(points: list[tuple[int, float]], x: int) -> float:
    """Piecewise-linear through (x, y) points sorted by x, flat beyond the ends."""
    if x <= points[0][0]:
        return points[0][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return points[-1][1]


class PatchedWeights:
    """A WeightSource (quantkit.eval.stream) giving `patch`'s tensors in place of the base's."""

    def __init__(self, base, patch: dict):
        self.base, self.patch = base, patch

    def keys(self):
        return self.base.keys()

    def get(self, name: str):
        return self.patch[name] if name in self.patch else self.base.get(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.base.shape(name)

    def rows(self, name: str, index):
        return self.patch[name][index] if name in self.patch else self.base.rows(name, index)


@dataclass
class Probe:
    """One unit quantized alone: the checkpoint tensors it replaces (made when measured, so one probe
    is in memory at a time), the input transforms of its modules (activation quantization: {module
    name: x -> x'}), and the first decoder layer it changes (0: the embedding; the layer count: the head)."""

    name: str
    start: int
    patch: Callable[[], dict]
    inputs: dict[str, Callable] = field(default_factory=dict)


def check_streamable(model_dir: Path, setting: str) -> None:
    """UnsupportedError when the checkpoint has no layer-streamed forward (`setting`: the option
    that turns the measurement off, for the hint): a mixture of experts streams where its per-expert tensors stack
    as transformers' loading stacks them (stored_as_read)."""
    from quantkit.eval.stream import streamable
    from quantkit.io.checkpoint import check_model_dir

    info = check_model_dir(Path(model_dir))
    if not streamable(info.config, info.tensors) and stored_as_read(info.config) is None:
        raise UnsupportedError(f"measured sensitivity needs the layer-streamed forward, which {info.architecture} "
                               "does not have (a VLM, or a checkpoint whose tensors transformers converts when it "
                               "reads them, beyond stacking the experts)", hint=f"set {setting} (the weighted error alone)")


def stored_as_read(config: dict) -> Callable | None:
    """source -> the WeightSource the streamed model of a mixture of experts reads over a source of the
    checkpoint's stored tensors, for a full-precision text decoder whose loading conversion renames tensors and
    stacks the per-expert projections (quantkit.eval.experts.stacks_experts): the names renamed as transformers
    renames them (RenamedWeights: Mixtral's block_sparse_moe -> mlp, w1 -> gate_proj), the experts then stacked
    into the fused tensors (FusedExperts), so a probe patches the stored tensors; or only renames them (Granite 4
    MoE's stacked experts, load_named). None for any other model."""
    from quantkit.arch.families.base import ExpertCheckpoint
    from quantkit.arch.moe import expert_count, moe_layout
    from quantkit.arch.vlm import is_vlm
    from quantkit.eval.experts import FusedExperts, RenamedWeights, load_named, stacks_experts, text_model_type

    if is_vlm(config) or "quantization_config" in config or config.get("auto_map") or not expert_count(config):
        return None
    model_type = text_model_type(config)
    if renames_only(model_type):  # Granite 4 MoE's stacked experts: input_linear -> experts.gate_up_proj
        return lambda source: load_named(source, model_type)
    if not stacks_experts(config):
        return None
    layout, stacked = moe_layout(config), ExpertCheckpoint()
    return lambda source: FusedExperts(RenamedWeights(source, layout, model_type), stacked)


def renames_only(model_type: str) -> bool:
    """Whether transformers' loading conversion of the model type renames checkpoint tensors and does nothing else."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    from quantkit.arch.moe import load_renamings

    rows = get_checkpoint_conversion_mapping(model_type) or []
    return bool(rows) and len(load_renamings(model_type)) == len(rows)


def streamed_checkpoint(config, stored, dtype):
    """(the streamed model of a checkpoint over its `stored` tensors, source -> the source that model reads over a
    source of the stored tensors); a mixture of experts' stored buffers (DeepSeek-V3's and GLM-4.5's router
    correction bias) read into its model."""
    from quantkit.eval.experts import load_buffers
    from quantkit.eval.stream import build_meta_model, stream_built, stream_model

    as_read = stored_as_read(config.to_dict())
    if as_read is None:
        return stream_model(config, stored, dtype), lambda source: source
    model, source = build_meta_model(config, dtype), as_read(stored)
    load_buffers(model, source)
    return stream_built(model, config, source), as_read


def layer_count(model_dir: Path) -> int:
    from quantkit.engines.transformers import hf_config

    return hf_config(model_dir).get_text_config().num_hidden_layers


@dataclass
class _Hooked:
    handles: list = field(default_factory=list)

    def close(self) -> None:
        for handle in self.handles:
            handle.remove()


def transform_inputs(model, inputs: dict[str, Callable]) -> _Hooked:
    """Forward pre-hooks replacing the first input of each named module by its transform."""
    modules = dict(model.named_modules())
    return _Hooked([modules[name].register_forward_pre_hook(lambda _m, args, fn=fn: (fn(args[0]), *args[1:]))
                    for name, fn in inputs.items()])


def resumable_start(config: dict, start: int) -> int:
    """The decoder layer a probe's forward may resume from: `start`, or the embedding (0) where the family's layers
    hand state to later ones within one forward (Gemma 4's KV-shared layers read the keys and values of earlier
    layers from `shared_kv_states`, which a forward resumed past them lacks: its record's `sequential` names the
    whole text model as one unit)."""
    from quantkit.arch.families import of_config
    from quantkit.arch.families.text import text_hparams

    family = of_config(config)
    whole = family is not None and family.sequential is not None and family.sequential(text_hparams(config))
    return 0 if whole else start


def probe_klds(model_dir: Path, probes: Iterable[Probe], windows, setting: str, workdir: Path | None = None,
               progress: Callable[[str], None] = lambda message: None, ranks: Ranks = Ranks()) -> dict[str, float]:
    """{name: mean KL divergence} of the streamed float32 forward over `windows` with one probe at a
    time applied, against the unpatched forward. The unpatched pass records the inputs of the layers
    the probes start at; each probe's forward resumes there. Under torchrun each rank scores its share of the
    windows and every position's divergence is gathered (quantkit.engines.llmcompressor.distributed), so each
    mean is the one-process mean."""
    import torch

    from quantkit.engines.llmcompressor.distributed import gather_positions, measured_share
    from quantkit.engines.transformers import hf_config
    from quantkit.eval import evaluate
    from quantkit.eval.stream import recording_scorer, start_scorer
    from quantkit.io.checkpoint import SafetensorsWeights

    windows, split = measured_share(windows, ranks)
    gather = gather_positions if split else None

    check_streamable(model_dir, setting)
    config = hf_config(model_dir)
    probes = [replace(p, start=resumable_start(config.to_dict(), p.start)) for p in probes]
    stored = SafetensorsWeights(model_dir)
    streamed, as_read = streamed_checkpoint(config, stored, torch.float32)
    base = as_read(stored)  # what the probes' forwards go back to
    text, record = config.get_text_config(), {}
    baseline = evaluate.compute_baseline(recording_scorer(streamed, text, {p.start for p in probes}, record),
                                         windows, workdir)
    klds = {}
    for index, probe in enumerate(probes):
        progress(f"sensitivity: {probe.name} alone ({index + 1}/{len(probes)})")
        streamed.weights.source = as_read(PatchedWeights(stored, probe.patch()))
        hooks = transform_inputs(streamed.model, probe.inputs)
        try:
            metrics = evaluate.compare(start_scorer(streamed, text, probe.start, record), windows, baseline,
                                       gather)
        finally:
            hooks.close()
            streamed.weights.source = base
        klds[probe.name] = max(0.0, metrics.kld_mean)
    return klds
