"""quantkit.serve.check without an engine: the verdict, the report's JSON, the context asked for."""

import json
import math

import pytest

from quantkit.serve import check, stats
from quantkit.serve.load import LoadResult


def agreement(kld: float, top1: float = 1.0) -> stats.Agreement:
    return stats.Agreement(100, kld, kld * 3, 0.1, top1)


def report(vs_reading: stats.Agreement, ppl: stats.Perplexity, tolerances: check.Tolerances,
           vs_base: stats.Agreement | None = None, normalized: bool = True,
           compared: stats.ComparedPerplexity | None = None, own_kld: float | None = 0.0011,
           gated_kld: float | None = None) -> check.ServeReport:
    result = check.ServeReport(
        artifact="a", kind="compressed-tensors", base="b", engine={"name": "vllm", "version": "0"},
        windows={"count": 1, "seq_len": 101, "positions": 100, "scored": 100}, base_from="quantkit", logprobs=20,
        logprobs_normalized=normalized, vs_base=vs_base or agreement(0.001), vs_reading=vs_reading, reading_vs_base=agreement(0.001),
        reading_vs_base_kld=own_kld, ppl=ppl, ppl_base=10.0, ppl_reading=10.2,
        ppl_compared=compared or stats.ComparedPerplexity(100, ppl.ppl, 10.2),
        greedy=stats.GreedyAgreement(2, 8, 8.0, 1.0, [8, 8]),
        load=[LoadResult(1, 1, 64, 8, 0.01, 6400.0, 100.0, 90.0)], tolerances=tolerances, gated_kld=gated_kld)
    result.checks = check.verdict(result)
    return result


EXACT = stats.Perplexity(10.25, True, 0)


def test_a_close_reading_passes():
    result = report(agreement(0.001), EXACT, check.Tolerances())
    assert result.passed and [c.name for c in result.checks] == ["reading_kld", "ppl_drift"]


def test_each_check_fails_on_its_own():
    assert report(agreement(0.5), EXACT, check.Tolerances()).failed == ["reading_kld"]
    assert report(agreement(0.001), stats.Perplexity(12.0, True, 0), check.Tolerances()).failed == ["ppl_drift"]
    assert report(agreement(0.001, top1=0.5), EXACT, check.Tolerances(min_reading_top1=0.9)).failed == [
        "reading_top1"]
    assert report(agreement(0.001), EXACT, check.Tolerances(max_base_kld=0.01), vs_base=agreement(0.9)).failed == [
        "base_kld"]


def test_the_reading_may_differ_by_the_artifacts_own_kld():
    """An engine as far from quantkit's reading as that reading is from the base reads the same artifact with other
    rounding (fp8 activations rounded after a float32 or a bfloat16 product): it passes; further, it fails."""
    assert report(agreement(0.03), EXACT, check.Tolerances(), own_kld=0.035).passed
    result = report(agreement(0.05), EXACT, check.Tolerances(), own_kld=0.035)
    assert result.failed == ["reading_kld"] and result.checks[0].threshold == 0.035
    assert report(agreement(0.03), EXACT, check.Tolerances(), own_kld=0.001).failed == ["reading_kld"]
    assert report(agreement(0.03), EXACT, check.Tolerances(), own_kld=None).failed == ["reading_kld"]  # engine base


def test_the_allowance_is_never_more_than_the_gate_measured():
    """A config.json edited after the gate moves quantkit's reading from the base too: the allowance stays the KLD
    the gate measured (quantkit.json), so the engine's different reading still fails."""
    assert report(agreement(0.03), EXACT, check.Tolerances(), own_kld=0.035, gated_kld=0.034).passed
    tampered = report(agreement(0.19), EXACT, check.Tolerances(), own_kld=0.4, gated_kld=0.001)
    assert tampered.failed == ["reading_kld"] and tampered.checks[0].threshold == 0.02


def test_the_ppl_drift_is_checked_where_both_perplexities_are_exact_and_fails_either_way():
    bound = stats.Perplexity(5.0, False, 40)  # over every position a lower bound: not what is compared
    assert report(agreement(0.001), bound, check.Tolerances(), compared=stats.ComparedPerplexity(60, 10.3, 10.2)).passed
    for engine in (8.0, 13.0):  # below or above the reading on the same exact positions
        result = report(agreement(0.001), bound, check.Tolerances(), compared=stats.ComparedPerplexity(60, engine, 10.2))
        assert result.failed == ["ppl_drift"]
    nothing = stats.ComparedPerplexity(0, math.nan, math.nan)  # no exact position: the check cannot pass
    assert report(agreement(0.001), bound, check.Tolerances(), compared=nothing).failed == ["ppl_drift"]


def test_ppl_is_not_checked_where_log_probs_are_not_normalized():
    result = report(agreement(0.001), stats.Perplexity(12.0, True, 0), check.Tolerances(), normalized=False)
    assert result.passed and [c.name for c in result.checks] == ["reading_kld"]


def test_nan_fails():
    assert not report(agreement(math.nan), EXACT, check.Tolerances()).passed


def test_report_json():
    data = report(agreement(0.001), EXACT, check.Tolerances(max_base_kld=0.01)).as_dict()
    json.dumps(data)
    assert data["passed"] and data["failed"] == [] and data["vs_reading"]["kld_lower_bound"] == 0.001
    assert data["load"][0]["ttft_s"] == 0.01 and data["tolerances"]["max_base_kld"] == 0.01
    assert {c["name"] for c in data["checks"]} == {"reading_kld", "ppl_drift", "base_kld"}


def test_context_covers_the_longest_request():
    generation = check.Generation(prompts=2, steps=16, load_steps=32)
    assert check.context_needed(64, generation) == 64 + 32 + check.CONTEXT_MARGIN
    assert check.context_needed(512, check.Generation(steps=600, load_steps=8)) == 256 + 600 + check.CONTEXT_MARGIN


def test_unknown_base_source(tmp_path):
    import numpy as np

    with pytest.raises(Exception, match="unknown base_from"):
        check.serve_check(tmp_path, tmp_path, np.zeros((1, 8), np.int64), base_from="hub")
