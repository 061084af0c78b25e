"""The gate's KV measurement: one forward per type against a kept or a lockstep baseline (the same numbers), and
--kv-cache auto measuring the types smallest first until one passes (the same choice as measuring them all)."""

import copy
import dataclasses

import pytest
import torch

from quantkit.eval import evaluate, kv
from quantkit.eval.kv.measure import measure_types, smallest_passing
from quantkit.run.recipe import Gate


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def windows():
    return torch.randint(0, 256, (3, 40), generator=torch.Generator().manual_seed(1))


SHAPE = kv.Shape(head_dim=32, kv_heads=2, layers=4)


def mlx_types(*bits):
    return [kv.parse_one(f"mlx:{b}g32", SHAPE) for b in bits]


def test_lockstep_baseline_gives_the_kept_baselines_numbers(model, windows):
    kept = evaluate.compute_baseline(evaluate.model_scorer(model), windows, spill=False)
    base = copy.deepcopy(model)  # the base scored beside each type: its own model, as the gate's is
    lockstep = evaluate.lockstep_baseline(evaluate.model_scorer(base), windows)
    kinds = mlx_types(3, 8)
    a = measure_types(None, model, windows, kept, kinds, SHAPE, Gate())
    b = measure_types(None, model, windows, lockstep, kinds, SHAPE, Gate())
    for x, y in zip(a, b):
        assert x.own.kld_mean == pytest.approx(y.own.kld_mean, rel=1e-6)
        assert x.total.kld_mean == pytest.approx(y.total.kld_mean, rel=1e-6)
        assert x.total.top1 == y.total.top1 and x.passed == y.passed
    # the model against itself: a type's own damage is its total
    assert a[0].own.kld_mean == pytest.approx(a[0].total.kld_mean, rel=1e-5) and a[0].own.kld_mean > 0


def test_one_forward_per_type(model, windows):
    baseline = evaluate.compute_baseline(evaluate.model_scorer(model), windows, spill=False)
    calls = []
    hook = model.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        measure_types(None, model, windows, baseline, mlx_types(2, 4, 8), SHAPE, Gate())
    finally:
        hook.remove()
    batches = len(list(evaluate.iter_batches(windows, evaluate.batch_size_for(windows, 256))))
    assert len(calls) == batches * (1 + 3)  # the artifact with a 16-bit cache once, then each type once


def test_the_gates_kept_reading_is_the_one_scored_again(model, windows):
    """The artifact's reading kept as the gate compares it (evaluate.Keeper) holds what scoring it again would,
    bit for bit, so the types measured against it give the same numbers with one forward fewer."""
    baseline = evaluate.compute_baseline(evaluate.model_scorer(model), windows, spill=False)
    keeper = evaluate.Keeper(evaluate.positions(windows), spill=False)
    metrics = evaluate.compare(evaluate.model_scorer(model), windows, baseline, keep=keeper)
    assert metrics.kld_mean == 0 and keeper.baseline is not None
    for field in ("logprobs", "nll", "top1", "targets"):
        assert (getattr(keeper.baseline, field) == getattr(baseline, field)).all(), field
    kinds = mlx_types(3, 8)
    calls = []
    hook = model.model.register_forward_hook(lambda *_: calls.append(1))
    try:
        kept = measure_types(None, model, windows, baseline, kinds, SHAPE, Gate(), own=keeper.baseline)
    finally:
        hook.remove()
    batches = len(list(evaluate.iter_batches(windows, evaluate.batch_size_for(windows, 256))))
    assert len(calls) == batches * len(kinds)  # each type once, no 16-bit-cache forward
    again = measure_types(None, model, windows, baseline, kinds, SHAPE, Gate())
    for x, y in zip(kept, again):
        assert x.own == y.own and x.total == y.total and x.passed == y.passed


def test_one_candidate_against_two_bases_is_each_kl_rows(windows):
    """kl_rows_of's shared candidate terms give each base's kl_rows bit for bit."""
    generator = torch.Generator().manual_seed(2)
    cand = torch.randn(5, 300, generator=generator).log_softmax(-1)
    cand[0, 7] = float("-inf")
    bases = [torch.randn(5, 300, generator=generator).log_softmax(-1).half().numpy() for _ in range(2)]
    pair = evaluate.kl_rows_of(bases, cand, buffers=evaluate.Buffers())
    for base, kl in zip(bases, pair):
        assert torch.equal(kl, evaluate.kl_rows(base, cand))
    assert torch.equal(evaluate.kl_rows_of([cand.half().numpy()], cand)[0], torch.zeros(5))


def test_auto_stops_at_the_smallest_passing_type(model, windows):
    baseline = evaluate.compute_baseline(evaluate.model_scorer(model), windows, spill=False)
    given = mlx_types(8, 2, 4, 3, 6)
    free = {r.kind.name: r.own.kld_mean for r in measure_types(None, model, windows, baseline, given, SHAPE, Gate())}
    assert free["mlx:3g32"] > free["mlx:4g32"] > free["mlx:8g32"]
    gate = Gate(max_kld=(free["mlx:3g32"] * free["mlx:4g32"]) ** 0.5)  # 4 bits and more pass
    every = measure_types(None, model, windows, baseline, given, SHAPE, gate)
    auto = measure_types(None, model, windows, baseline, given, SHAPE, gate, until_pass=True)
    assert [r.kind.name for r in auto] == [f"mlx:{b}g32" for b in (2, 3, 4, 6, 8)]  # smallest first
    assert [r.status for r in auto] == ["failed", "failed", "passed", "unneeded", "unneeded"]
    assert smallest_passing(auto).kind.name == smallest_passing(every).kind.name == "mlx:4g32"
    for r in auto[:3]:
        assert r.own.kld_mean == pytest.approx(free[r.kind.name], rel=1e-6)
    unneeded = auto[3].as_dict(SHAPE)
    assert unneeded["own"] is None and unneeded["total"] is None and not unneeded["passed"]


def test_auto_measures_every_type_of_the_passing_size(model, windows):
    """Two types of one size: auto measures both and chooses the closer, as measuring every type does."""
    baseline = evaluate.compute_baseline(evaluate.model_scorer(model), windows, spill=False)
    four, eight = mlx_types(4, 8)
    exact = dataclasses.replace(four, name="exact", key=lambda x: x, value=lambda x: x)
    auto = measure_types(None, model, windows, baseline, [eight, four, exact], SHAPE, Gate(), until_pass=True)
    assert [r.status for r in auto] == ["passed", "passed", "unneeded"]
    assert smallest_passing(auto).kind.name == "exact"


def test_auto_and_all_parse_the_same_types():
    assert kv.stops_at_first_pass("auto") and not kv.stops_at_first_pass("all")
    assert [k.name for k in kv.parse("all", SHAPE, "mlx")] == [k.name for k in kv.parse("auto", SHAPE, "mlx")]
    with pytest.raises(kv.UnsupportedError, match="all stands alone"):
        kv.parse("all,mlx:4", SHAPE, "mlx")


def test_a_resident_reading_is_built_once_for_every_type(micro_model, monkeypatch):
    """Resident, the artifact is read onto one model for all its types (its attention set for each), with the
    numbers a model built afresh for each type gives."""
    from quantkit.eval import scorers
    from quantkit.formats.gate import artifact_reading

    reading = artifact_reading(micro_model)
    placement = scorers.Placement(True)
    windows = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(3))
    baseline = evaluate.compute_baseline(scorers.reading_scorer(reading, "cpu", placement), windows)
    shape = kv.shape_of(reading.config)
    kinds = [kv.parse_one(name, shape) for name in ("mlx:4", "mlx:8", "llama.cpp:q4_0")]
    built, real = [], scorers.resident_reading
    monkeypatch.setattr(scorers, "resident_reading", lambda *a, **k: built.append(1) or real(*a, **k))
    together = measure_types(reading, None, windows, baseline, kinds, shape, Gate(), placement=placement)
    assert len(built) == 1
    alone = [measure_types(reading, None, windows, baseline, [k], shape, Gate(), placement=placement)[0]
             for k in kinds]
    assert len(built) == 1 + len(kinds)
    for x, y in zip(together, alone):
        assert x.own == y.own and x.total == y.total and x.own.kld_mean > 0


def test_the_gates_resident_model_serves_the_types(micro_model, monkeypatch):
    """The model the gate read the artifact onto (formats.gate.held_artifact) is the one the types are read on:
    the artifact is read once for the gate, its kept reading and every type."""
    from quantkit.eval import scorers
    from quantkit.formats import gate

    placement = scorers.Placement(True)
    windows = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(4))
    reading = gate.artifact_reading(micro_model)
    baseline = evaluate.compute_baseline(scorers.reading_scorer(reading, "cpu", placement), windows)
    shape = kv.shape_of(reading.config)
    kinds = [kv.parse_one(name, shape) for name in ("mlx:4", "llama.cpp:q8_0")]
    built, real = [], scorers.resident_reading
    monkeypatch.setattr(scorers, "resident_reading", lambda *a, **k: built.append(1) or real(*a, **k))
    held = gate.held_artifact(micro_model, None, "cpu", placement)
    keeper = evaluate.Keeper(evaluate.positions(windows))
    metrics = gate.evaluate_artifact(micro_model, None, windows, baseline, placement=placement, keep=keeper,
                                     held=held)
    rows = measure_types(held.reading, None, windows, baseline, kinds, shape, Gate(), placement=placement,
                         own=keeper.baseline, held=held)
    assert len(built) == 1 and metrics.kld_mean == 0
    fresh = measure_types(reading, None, windows, baseline, kinds, shape, Gate(), placement=placement)
    for x, y in zip(rows, fresh):
        assert x.own == y.own and x.total == y.total
    assert gate.held_artifact(micro_model, None, "cpu", scorers.STREAMED) is None
    assert gate.held_artifact(micro_model, None, "cpu", scorers.Placement(True, lockstep=True)) is None
