"""Exact checks of the gate's math on synthetic logits."""

import math

import numpy as np
import pytest
import torch

from quantkit import evaluate
from quantkit.recipe import Gate


def fake_model(scale: float = 1.0, noise: float = 0.0, vocab: int = 32):
    """A logits function over token windows: a fixed random bigram table, optionally damaged."""
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(vocab, vocab, generator=gen) * 3
    damage = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(1)) * noise

    def logits(ids):
        return (table * scale + damage)[ids]

    return logits


@pytest.fixture
def windows():
    return torch.randint(0, 32, (6, 17), generator=torch.Generator().manual_seed(2))


def test_identical_candidate_scores_exactly(windows):
    baseline = evaluate.compute_baseline(fake_model(), windows, batch_size=4)
    metrics = evaluate.compare(fake_model(), windows, baseline, batch_size=4)
    assert metrics.kld_mean == 0.0 and metrics.kld_p99 == 0.0
    assert metrics.top1 == 1.0
    assert metrics.ppl == metrics.ppl_base and metrics.ppl_increase == 0.0
    assert metrics.positions == 6 * 16
    assert baseline.forward_passes == 2  # 6 windows in batches of 4


def test_kld_matches_direct_computation(windows):
    baseline = evaluate.compute_baseline(fake_model(), windows)
    metrics = evaluate.compare(fake_model(noise=0.5), windows, baseline)
    p = torch.log_softmax(fake_model()(windows)[:, :-1].double(), -1)
    q = torch.log_softmax(fake_model(noise=0.5)(windows)[:, :-1].double(), -1)
    direct = (p.exp() * (p - q)).sum(-1).mean().item()
    assert metrics.kld_mean == pytest.approx(direct, rel=2e-3)
    nll = -q.gather(-1, windows[:, 1:, None]).mean().item()
    assert metrics.ppl == pytest.approx(math.exp(nll), rel=1e-5)


def test_damaged_model_is_caught(windows):
    baseline = evaluate.compute_baseline(fake_model(), windows)
    metrics = evaluate.compare(fake_model(noise=2.0), windows, baseline)
    verdict = evaluate.gate_verdict(metrics, Gate(max_ppl_increase=0.05, max_kld=0.05, min_top1=0.9))
    assert not verdict.passed and set(verdict.failed) == {"ppl_increase", "kld_mean", "top1"}


def test_gate_without_thresholds_reports_but_passes(windows):
    baseline = evaluate.compute_baseline(fake_model(), windows)
    metrics = evaluate.compare(fake_model(noise=2.0), windows, baseline)
    verdict = evaluate.gate_verdict(metrics, Gate())
    assert verdict.passed and len(verdict.checks) == 3


def test_batch_size_bounds_logits_memory(windows):
    assert evaluate.batch_size_for(windows, 32) == 8
    assert evaluate.batch_size_for(torch.zeros(4, 512), 128_000) == 1
    assert evaluate.batch_size_for(windows, None) == 1


def test_large_baseline_spills_to_a_memmap(windows, tmp_path, monkeypatch):
    monkeypatch.setattr(evaluate, "MEMMAP_THRESHOLD", 16)
    baseline = evaluate.compute_baseline(fake_model(), windows, workdir=tmp_path)
    assert isinstance(baseline.logprobs, np.memmap) and baseline.logprobs.dtype == np.float16
    assert not list(tmp_path.iterdir())  # unlinked at once; nothing to clean up
    assert evaluate.compare(fake_model(), windows, baseline).kld_mean == 0.0
