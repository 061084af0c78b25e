"""Exact checks of the gate's math on synthetic logits."""

import math

import numpy as np
import pytest
import torch

from quantkit.eval import evaluate
from quantkit.run.recipe import Gate


def fake_logits(scale: float = 1.0, noise: float = 0.0, vocab: int = 32):
    """A logits function over token windows: a fixed random bigram table, optionally damaged."""
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(vocab, vocab, generator=gen) * 3
    damage = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(1)) * noise

    def logits(ids):
        return (table * scale + damage)[ids]

    return logits


def fake_model(scale: float = 1.0, noise: float = 0.0, vocab: int = 32, batch_size: int | None = None):
    """A Scorer over the bigram logits."""
    return evaluate.logits_scorer(fake_logits(scale, noise, vocab), vocab, batch_size)


@pytest.fixture
def windows():
    return torch.randint(0, 32, (6, 17), generator=torch.Generator().manual_seed(2))


def test_identical_candidate_scores_exactly(windows):
    baseline = evaluate.compute_baseline(fake_model(batch_size=4), windows)
    metrics = evaluate.compare(fake_model(batch_size=4), windows, baseline)
    assert metrics.kld_mean == 0.0 and metrics.kld_p99 == 0.0
    assert metrics.top1 == 1.0
    assert metrics.ppl == metrics.ppl_base and metrics.ppl_increase == 0.0
    assert metrics.positions == 6 * 16


def test_kld_matches_direct_computation(windows):
    baseline = evaluate.compute_baseline(fake_model(), windows)
    metrics = evaluate.compare(fake_model(noise=0.5), windows, baseline)
    p = torch.log_softmax(fake_logits()(windows)[:, :-1].double(), -1)
    q = torch.log_softmax(fake_logits(noise=0.5)(windows)[:, :-1].double(), -1)
    direct = (p.exp() * (p - q)).sum(-1).mean().item()
    assert metrics.kld_mean == pytest.approx(direct, rel=2e-3)
    nll = -q.gather(-1, windows[:, 1:, None]).mean().item()
    assert metrics.ppl == pytest.approx(math.exp(nll), rel=1e-5)


def test_divergence_statistics_match_direct_computation(windows):
    baseline = evaluate.compute_baseline(fake_model(), windows)
    metrics = evaluate.compare(fake_model(noise=0.5), windows, baseline)
    p = torch.log_softmax(fake_logits()(windows)[:, :-1].double(), -1).reshape(-1, 32)
    q = torch.log_softmax(fake_logits(noise=0.5)(windows)[:, :-1].double(), -1).reshape(-1, 32)
    kl = (p.exp() * (p - q)).sum(-1).numpy()
    assert metrics.kld_median == pytest.approx(np.percentile(kl, 50), rel=5e-3)
    assert metrics.kld_p90 == pytest.approx(np.percentile(kl, 90), rel=5e-3)
    assert metrics.kld_max == pytest.approx(kl.max(), rel=5e-3)
    targets = windows[:, 1:].reshape(-1, 1)
    delta = (q.gather(1, targets).exp() - p.gather(1, targets).exp()).abs().mean().item()
    assert metrics.delta_p == pytest.approx(delta, rel=1e-4)
    assert metrics.ppl_delta == pytest.approx(metrics.ppl - metrics.ppl_base)
    assert metrics.kld_median <= metrics.kld_p90 <= metrics.kld_p99 <= metrics.kld_max
    assert metrics.flips is None  # measured only with generations (quantkit.eval.generate)


def test_any_statistic_can_gate(windows):
    baseline = evaluate.compute_baseline(fake_model(), windows)
    metrics = evaluate.compare(fake_model(noise=0.5), windows, baseline)
    loose = evaluate.gate_verdict(metrics, Gate())
    assert [c.name for c in loose.checks] == ["ppl_increase", "kld_mean", "top1", "finite"]
    strict = evaluate.gate_verdict(metrics, Gate(max_kld_max=metrics.kld_max / 2, max_delta_p=1.0,
                                                 max_ppl_delta=metrics.ppl_delta / 2))
    assert strict.failed == ["ppl_delta", "kld_max"]
    assert "delta_p" in [c.name for c in strict.checks]
    tasks = evaluate.with_checks(loose, [evaluate.Check("task:t/acc", 0.5, 0.95, ">=", False)])
    assert tasks.failed == ["task:t/acc"] and tasks.checks[-1].name == "finite" and tasks.enforced


def test_max_flips_needs_prompts():
    with pytest.raises(ValueError, match="flip_prompts"):
        Gate(max_flips=0.1)
    assert Gate(max_flips=0.1, flip_prompts=4).flip_tokens == 16


def test_damaged_model_is_caught(windows):
    baseline = evaluate.compute_baseline(fake_model(), windows)
    metrics = evaluate.compare(fake_model(noise=2.0), windows, baseline)
    verdict = evaluate.gate_verdict(metrics, Gate(max_ppl_increase=0.05, max_kld=0.05, min_top1=0.9))
    assert not verdict.passed and set(verdict.failed) == {"ppl_increase", "kld_mean", "top1"}


def test_gate_without_thresholds_reports_but_passes(windows):
    baseline = evaluate.compute_baseline(fake_model(), windows)
    metrics = evaluate.compare(fake_model(noise=2.0), windows, baseline)
    verdict = evaluate.gate_verdict(metrics, Gate())
    assert verdict.passed and len(verdict.checks) == 4 and verdict.checks[-1].name == "finite"


def test_batch_size_bounds_logits_memory(windows):
    assert evaluate.batch_size_for(windows, 32) == 8
    assert evaluate.batch_size_for(torch.zeros(4, 512), 128_000) == 1
    assert evaluate.batch_size_for(windows, None) == 1


def test_large_baseline_spills_to_a_file(windows, tmp_path, monkeypatch):
    from quantkit.io.rowio import RowFile

    in_memory = evaluate.compute_baseline(fake_model(), windows)
    monkeypatch.setattr(evaluate, "SPILL_THRESHOLD", 16)
    baseline = evaluate.compute_baseline(fake_model(), windows, workdir=tmp_path)
    assert isinstance(baseline.logprobs, RowFile) and baseline.logprobs.dtype == np.float16
    assert np.array_equal(baseline.logprobs[0 : len(baseline.logprobs)], in_memory.logprobs)
    assert not list(tmp_path.iterdir())  # unlinked at once; nothing to clean up
    assert evaluate.compare(fake_model(), windows, baseline).kld_mean == 0.0
    damaged = fake_model(noise=0.5)  # a candidate's metrics are the same, bit for bit, from the file
    assert evaluate.compare(damaged, windows, baseline) == evaluate.compare(damaged, windows, in_memory)


def test_logits_scorer_batches_windows_and_chunks_positions(windows, monkeypatch):
    calls = []

    def counting(ids):
        calls.append(ids.shape[0])
        return fake_logits()(ids)

    monkeypatch.setattr(evaluate, "CHUNK_BYTES", 4 * 32 * 10)  # 10 positions per chunk
    chunks = list(evaluate.logits_scorer(counting, 32, batch_size=4)(windows))
    assert calls == [4, 2]
    assert [c.logprobs.shape[0] for c in chunks] == [10] * 6 + [4] + [10] * 3 + [2]
    assert torch.equal(torch.cat([c.targets for c in chunks]), windows[:, 1:].reshape(-1))


def nan_logits(ids):
    return torch.full((*ids.shape, 32), math.nan)


def test_nan_model_never_agrees_and_fails_an_unenforced_gate(windows):
    baseline = evaluate.compute_baseline(fake_model(), windows)
    metrics = evaluate.compare(evaluate.logits_scorer(nan_logits, 32), windows, baseline)
    assert metrics.top1 == 0.0
    assert math.isnan(metrics.kld_mean) and math.isnan(metrics.ppl) and math.isnan(metrics.kld_p99)
    verdict = evaluate.gate_verdict(metrics, Gate(), enforced=False)
    assert not verdict.passed and verdict.enforced and verdict.failed == ["finite"]
    assert verdict.checks[-1].value == 9.0  # ppl, ppl_increase, ppl_delta, the four KLD statistics, delta_p


def test_one_nan_position_shows_in_the_metrics(windows):
    def partly_nan(ids):
        logits = fake_logits()(ids).clone()
        logits[0, 3, 5] = math.nan
        return logits

    baseline = evaluate.compute_baseline(fake_model(), windows)
    metrics = evaluate.compare(evaluate.logits_scorer(partly_nan, 32), windows, baseline)
    assert metrics.top1 == pytest.approx(1 - 1 / metrics.positions)
    assert math.isnan(metrics.kld_mean)
    assert evaluate.gate_verdict(metrics, Gate(max_kld=1.0)).failed == ["kld_mean", "finite"]


def test_nan_baseline_agrees_with_nothing(windows):
    baseline = evaluate.compute_baseline(evaluate.logits_scorer(nan_logits, 32), windows)
    assert (baseline.top1 == evaluate.NO_TOP1).all()
    metrics = evaluate.compare(fake_model(), windows, baseline)
    assert metrics.top1 == 0.0 and not evaluate.gate_verdict(metrics, Gate(), enforced=False).passed


def test_zero_base_probability_is_not_nan(windows):
    """A token the base gives probability 0 (log-prob -inf, e.g. a masked vocab entry) adds 0, not NaN."""
    def masked(ids):
        logits = fake_logits()(ids).clone()
        logits[..., 7] = -math.inf
        return logits

    baseline = evaluate.compute_baseline(evaluate.logits_scorer(masked, 32), windows)
    metrics = evaluate.compare(evaluate.logits_scorer(masked, 32), windows, baseline)
    assert metrics.kld_mean == 0.0 and metrics.top1 == 1.0


def test_a_non_strict_reload_fails_the_run():
    """Missing, unexpected or mis-shaped tensors on reload are exit 3, whatever the gate says."""
    from pathlib import Path

    import pytest

    from quantkit.errors import ArtifactReloadError
    from quantkit.eval.artifacts import check_strict_reload

    check_strict_reload(Path("ok"), {"missing_keys": set(), "unexpected_keys": set(), "mismatched_keys": []})
    with pytest.raises(ArtifactReloadError) as err:
        check_strict_reload(Path("art"), {"missing_keys": {"model.layers.0.mlp.experts.gate_up_proj"},
                                          "unexpected_keys": {"model.layers.0.block_sparse_moe.experts.0.w1.weight"},
                                          "mismatched_keys": []})
    assert err.value.exit_code == 3 and "1 missing" in err.value.message and "1 unexpected" in err.value.message


def test_float16_rounding_adds_no_floor_to_the_kl_divergence():
    """A KL divergence of 5e-5 (a good fp8 artifact) read through float16 log-probs: within 10% of the exact
    float32 value (unnormalized rounded rows put a floor of ~5e-4 under it); identical rows score 0."""
    import torch

    from quantkit.eval.evaluate import kl_rows

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(256, 32000, generator=gen) * 3
    base = torch.log_softmax(logits, -1)
    cand = torch.log_softmax(logits + torch.randn(256, 32000, generator=gen) * 0.01, -1)
    exact = float((base.exp() * (base - cand)).sum(-1).mean())
    assert 3e-5 < exact < 1e-4
    assert abs(float(kl_rows(base.half().numpy(), cand).mean()) - exact) < 0.1 * exact
    assert float(kl_rows(base.half().numpy(), base).max()) == 0.0


def test_lockstep_scores_the_base_beside_the_candidate_with_the_kept_baselines_numbers(windows):
    """No log-probs of the base kept: the same metrics, to the bit, as a kept baseline, with chunks of the two
    scorers cut differently; the base's NLL, top-1 and targets are filled as the comparison runs."""
    kept = evaluate.compute_baseline(fake_model(batch_size=4), windows)
    lockstep = evaluate.lockstep_baseline(fake_model(batch_size=4), windows)
    assert lockstep.logprobs is None and not lockstep.scored
    metrics = evaluate.compare(fake_model(noise=0.5, batch_size=1), windows, lockstep)
    assert metrics == evaluate.compare(fake_model(noise=0.5, batch_size=1), windows, kept)
    assert lockstep.scored and lockstep.ppl == kept.ppl
    assert (lockstep.top1 == kept.top1).all() and (lockstep.targets == kept.targets).all()


def test_paired_cuts_two_scorers_chunks_to_the_same_positions(windows, monkeypatch):
    monkeypatch.setattr(evaluate, "CHUNK_BYTES", 4 * 32 * 7)  # 7 positions per chunk: they cross the windows
    pairs = list(evaluate.paired(fake_model(batch_size=1)(windows), fake_model(batch_size=4)(windows)))
    assert all(a.targets.shape == b.targets.shape for a, b in pairs)
    assert torch.equal(torch.cat([a.targets for a, _ in pairs]), windows[:, 1:].reshape(-1))
    assert torch.equal(torch.cat([a.logprobs for a, _ in pairs]), torch.cat([b.logprobs for _, b in pairs]))
    from quantkit.errors import InternalError

    with pytest.raises(InternalError):
        list(evaluate.paired(fake_model()(windows), fake_model()(windows[:-1])))


@pytest.mark.parametrize("vocab", [1, 7, 1023, 1024, 1025, 3000, 4096])
def test_row_max_is_torch_max(vocab):
    """Ties (the first index wins), a NaN anywhere in a row (its maximum is NaN), rows of -inf, a vocabulary
    the blocks do not divide: the maxima and indices of Tensor.max."""
    generator = torch.Generator().manual_seed(vocab)
    for trial in range(12):
        rows = torch.randint(-3, 3, (6, vocab), generator=generator).float()
        if trial % 3 == 0:
            rows[1, int(torch.randint(0, vocab, (1,), generator=generator))] = math.nan
        if trial % 4 == 0:
            rows[2] = -math.inf
        values, index = evaluate.row_max(rows)
        expected = rows.max(-1)
        finite = ~expected.values.isnan()
        assert torch.equal(values.isnan(), ~finite)
        assert torch.equal(values[finite], expected.values[finite])
        assert torch.equal(index[finite], expected.indices[finite])


def test_buffers_are_reused_and_grow():
    buffers = evaluate.Buffers()
    first = buffers.get("a", 4, 8, torch.float32, "cpu")
    fewer = buffers.get("a", 2, 8, torch.float32, "cpu")
    assert fewer.shape == (2, 8) and fewer.data_ptr() == first.data_ptr()
    assert buffers.get("a", 6, 8, torch.float32, "cpu").shape == (6, 8)
    assert buffers.get("a", 6, 8, torch.float16, "cpu").dtype == torch.float16
    assert buffers.get("b", 1, 3, torch.float32, "cpu").shape == (1, 3)


def test_kl_rows_in_reused_buffers_are_the_fresh_ones():
    """The same buffers through chunks of different sizes (the last one smaller): each chunk's KL divergence is
    the one computed in fresh memory."""
    generator = torch.Generator().manual_seed(0)
    base = torch.log_softmax(torch.randn(13, 300, generator=generator) * 3, -1)
    cand = torch.log_softmax(base + 0.1 * torch.randn(13, 300, generator=generator), -1)
    base16 = base.to(torch.float16).numpy()
    buffers = evaluate.Buffers()
    for first, last in ((0, 5), (5, 10), (10, 13), (0, 13)):
        reused = evaluate.kl_rows(base16[first:last], cand[first:last], buffers=buffers)
        assert torch.equal(reused, evaluate.kl_rows(base16[first:last], cand[first:last]))


def test_a_head_with_a_forward_of_its_own_is_called():
    """score_hidden writes a plain nn.Linear head's logits into a reused buffer; a head with hooks or a forward
    of its own (a quantized one) is called as the model calls it."""
    head = torch.nn.Linear(8, 16, bias=False)
    hidden = torch.randn(5, 8)
    called, targets = [], torch.zeros(5, dtype=torch.long)

    @torch.inference_mode()
    def scored(finish=evaluate.Finish()):  # as the scorers call it
        return torch.cat([c.logprobs for c in evaluate.score_hidden(hidden, targets, head, finish)])

    assert evaluate.plain_linear(head)
    plain = scored()
    head.register_forward_hook(lambda *a: called.append(1))
    assert not evaluate.plain_linear(head)
    hooked = scored()
    with torch.no_grad():
        assert called and torch.allclose(plain, hooked) and torch.allclose(plain, torch.log_softmax(head(hidden), -1))
        capped = scored(evaluate.Finish(softcap=2.0))
        assert torch.allclose(capped, torch.log_softmax(torch.tanh(head(hidden) / 2.0) * 2.0, -1))
        divided = scored(evaluate.Finish(scale=("divide", 8.0)))  # Granite's logits_scaling
        assert torch.allclose(divided, torch.log_softmax(head(hidden) / 8.0, -1))


def test_an_unfinished_scorer_leaves_the_caller_out_of_inference_mode(windows):
    """A scorer stopped after its first chunk (or by an error, as paired's) does not leave inference mode on:
    the mode is the scorer's own, step by step."""
    chunks = fake_model()(windows)
    next(chunks)
    assert not torch.is_inference_mode_enabled() and torch.is_grad_enabled()
    with pytest.raises(Exception):
        list(evaluate.paired(fake_model()(windows), fake_model()(windows[:-1])))
    assert not torch.is_inference_mode_enabled()


def test_a_model_objects_batches_share_one_logits_buffer(windows, monkeypatch):
    """A model loaded whole (bitsandbytes through transformers) scored a window per batch: one logits buffer for
    every batch (a large vocabulary's [positions, vocab] block is not allocated afresh per batch), the chunks the
    model's own log-softmax."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1)).eval()
    made = []

    class Counted(evaluate.Buffers):
        def __init__(self):
            super().__init__()
            made.append(self)

    monkeypatch.setattr(evaluate, "Buffers", Counted)
    monkeypatch.setattr(evaluate, "BATCH_LOGITS_BYTES", 1)  # a window per batch
    ours = torch.cat([c.logprobs for c in evaluate.model_scorer(model)(windows)])
    with torch.no_grad():
        theirs = torch.log_softmax(model(windows).logits[:, :-1].float(), -1).reshape(-1, 32)
    assert len(made) == 1 and set(made[0].held) == {"logits"}
    torch.testing.assert_close(ours, theirs)
