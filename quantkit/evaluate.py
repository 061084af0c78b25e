"""Quality metrics and the gate: perplexity, KL divergence and top-1 agreement against the base.

Protocol (also in README): held-out windows of `seq_len` tokens that never overlap the
calibration windows, each starting with BOS where the tokenizer has one. Every next-token
prediction inside a window is scored (seq_len - 1 per window). The baseline is run once per
run; its log-probabilities are kept in float16 (in memory, or in a memory-mapped file when
they would exceed MEMMAP_THRESHOLD bytes) together with its float32 NLL and argmax. A
candidate's log-probabilities are rounded to float16 the same way before the KL divergence
KL(base || candidate) is taken, so an artifact identical to the base scores exactly 0.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

MEMMAP_THRESHOLD = 512 * 1024 * 1024
BATCH_LOGITS_BYTES = 64 * 1024 * 1024  # float32 logits per forward batch; a few copies live at once
GATE_METRICS = (  # (metric, threshold field, comparison)
    ("ppl_increase", "max_ppl_increase", "<="),
    ("kld_mean", "max_kld", "<="),
    ("top1", "min_top1", ">="),
)


@dataclass
class Baseline:
    logprobs: np.ndarray  # float16 (positions, vocab)
    nll: np.ndarray  # float32 (positions,)
    top1: np.ndarray  # int32 (positions,)
    targets: np.ndarray  # int64 (positions,)
    forward_passes: int = 0

    @property
    def ppl(self) -> float:
        return float(math.exp(float(np.mean(self.nll, dtype=np.float64))))


@dataclass
class Metrics:
    positions: int
    ppl_base: float
    ppl: float
    ppl_increase: float
    kld_mean: float
    kld_p99: float
    top1: float

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Check:
    name: str
    value: float
    threshold: float | None
    op: str
    passed: bool


@dataclass
class GateResult:
    passed: bool
    enforced: bool
    checks: list[Check] = field(default_factory=list)

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if not c.passed]

    def as_dict(self) -> dict:
        return {"passed": self.passed, "enforced": self.enforced, "failed": self.failed,
                "checks": [asdict(c) for c in self.checks]}


LogitsFn = Callable[["torch.Tensor"], "torch.Tensor"]  # noqa: F821  (input_ids (b, L) -> logits (b, L, V))


def model_logits_fn(model) -> LogitsFn:
    def logits(ids):
        device = next(model.parameters()).device
        return model(input_ids=ids.to(device)).logits.float().cpu()

    config = getattr(model.config, "text_config", None) or model.config
    logits.vocab_size = getattr(config, "vocab_size", None)
    return logits


def batch_size_for(windows, vocab_size: int | None, limit: int = 8) -> int:
    """Windows per forward pass so one batch's float32 logits stay near BATCH_LOGITS_BYTES."""
    if not vocab_size:
        return 1
    per_window = windows.shape[1] * vocab_size * 4
    return max(1, min(limit, BATCH_LOGITS_BYTES // per_window))


def iter_batches(windows, batch_size: int):
    for start in range(0, len(windows), batch_size):
        yield windows[start : start + batch_size]


def _allocate(shape: tuple[int, int], workdir: Path | None) -> np.ndarray:
    if shape[0] * shape[1] * 2 <= MEMMAP_THRESHOLD:
        return np.empty(shape, dtype=np.float16)
    with tempfile.NamedTemporaryFile(prefix="quantkit-baseline-", suffix=".f16", dir=workdir) as handle:
        # The mapping outlives the name: the file is unlinked on close, freed when the array goes.
        return np.memmap(handle.name, dtype=np.float16, mode="w+", shape=shape)


def score_batch(logits, ids):
    """float32 log-probs for predictions 0..L-2 of each window, flattened, and their targets."""
    import torch

    logprobs = torch.log_softmax(logits[:, :-1, :].float(), dim=-1)
    targets = ids[:, 1:]
    return logprobs.reshape(-1, logprobs.shape[-1]), targets.reshape(-1)


def compute_baseline(logits_fn: LogitsFn, windows, batch_size: int | None = None,
                     workdir: Path | None = None) -> Baseline:
    """Run the full-precision model once over the evaluation windows and keep what the gate needs."""
    import torch

    batch_size = batch_size or batch_size_for(windows, getattr(logits_fn, "vocab_size", None))
    n_pos = windows.shape[0] * (windows.shape[1] - 1)
    vocab = None
    offset = 0
    passes = 0
    with torch.inference_mode():
        for batch in iter_batches(windows, batch_size):
            logprobs, targets = score_batch(logits_fn(batch), batch)
            passes += 1
            if vocab is None:
                vocab = logprobs.shape[-1]
                store = _allocate((n_pos, vocab), workdir)
                nll = np.empty(n_pos, np.float32)
                top1 = np.empty(n_pos, np.int32)
                all_targets = np.empty(n_pos, np.int64)
            end = offset + logprobs.shape[0]
            store[offset:end] = logprobs.to(torch.float16).numpy()
            nll[offset:end] = -logprobs.gather(1, targets[:, None])[:, 0].numpy()
            top1[offset:end] = logprobs.argmax(-1).numpy()
            all_targets[offset:end] = targets.numpy()
            offset = end
    return Baseline(store, nll, top1, all_targets, passes)


def kl_rows(base16: np.ndarray, cand) -> "torch.Tensor":
    """KL(base || cand) per position from float16-rounded log-probs; tiny negatives clamp to 0."""
    import torch

    p_log = torch.from_numpy(np.asarray(base16)).float()
    q_log = cand.to(torch.float16).float()
    kl = (p_log.exp() * (p_log - q_log)).sum(-1)
    return kl.clamp_min(0.0)


def compare(logits_fn: LogitsFn, windows, baseline: Baseline, batch_size: int | None = None) -> Metrics:
    """Metrics of a candidate against the stored baseline, streaming over the windows."""
    import torch

    batch_size = batch_size or batch_size_for(windows, getattr(logits_fn, "vocab_size", None))
    kls, nlls, agree = [], [], 0
    offset = 0
    with torch.inference_mode():
        for batch in iter_batches(windows, batch_size):
            logprobs, targets = score_batch(logits_fn(batch), batch)
            end = offset + logprobs.shape[0]
            kls.append(kl_rows(baseline.logprobs[offset:end], logprobs).numpy())
            nlls.append(-logprobs.gather(1, targets[:, None])[:, 0].numpy())
            agree += int((logprobs.argmax(-1).numpy() == baseline.top1[offset:end]).sum())
            offset = end
    return summarize(np.concatenate(kls), np.concatenate(nlls), agree, baseline)


def summarize(kl: np.ndarray, nll: np.ndarray, agree: int, baseline: Baseline) -> Metrics:
    ppl = float(math.exp(float(np.mean(nll, dtype=np.float64))))
    base = baseline.ppl
    return Metrics(
        positions=int(kl.shape[0]),
        ppl_base=base,
        ppl=ppl,
        ppl_increase=ppl / base - 1.0,
        kld_mean=float(np.mean(kl, dtype=np.float64)),
        kld_p99=float(np.percentile(kl, 99)),
        top1=agree / max(1, kl.shape[0]),
    )


def gate_verdict(metrics: Metrics, gate, enforced: bool = True) -> GateResult:
    """Check each metric against its threshold (a None threshold is reported, never fails)."""
    checks = []
    for metric, threshold_field, op in GATE_METRICS:
        value = getattr(metrics, metric)
        threshold = getattr(gate, threshold_field)
        ok = threshold is None or (value <= threshold if op == "<=" else value >= threshold)
        checks.append(Check(metric, value, threshold, op, ok))
    passed = all(c.passed for c in checks)
    return GateResult(passed, enforced, checks)


def evaluate_artifact(artifact: Path, base_dir: Path, windows, baseline: Baseline, device: str = "cpu",
                      trust_remote_code: bool = False) -> Metrics:
    """Load an artifact back from disk the way a user would and measure it against the baseline.

    The one measuring step shared by the pipeline's gate and `quantkit eval`.
    """
    from quantkit.artifacts import load_for_eval

    candidate = load_for_eval(artifact, base_dir, device, trust_remote_code)
    try:
        return compare(model_logits_fn(candidate), windows, baseline)
    finally:
        del candidate
