"""quantkit.serve.stats: KL lower bounds, tail mass, top-1 and perplexity from top-k log-probs."""

import math

import numpy as np
import pytest

from quantkit.serve import stats

P = np.array([0.4, 0.3, 0.2, 0.1])  # the reference (base or quantkit's reading), known in full
Q = np.array([0.35, 0.3, 0.1, 0.25])  # the engine; its top-2 are tokens 0 and 1


def full_kl(p, q):
    return float(np.sum(p * np.log(p / q)))


def engine_topk(q: np.ndarray, k: int, targets=None) -> stats.TopK:
    """TopK of one row per distribution in q (rows), its k most likely tokens."""
    q = np.atleast_2d(q)
    rows = [[(int(t), float(np.log(row[t]))) for t in np.argsort(-row)[:k]] for row in q]
    return stats.pack_topk(rows, targets if targets is not None else [None] * len(rows))


def test_coarse_kl_exact_values_and_tail():
    topk = engine_topk(Q, 2)
    agreement = stats.against_full(np.log(P)[None, :], np.array([0]), topk)
    # cells {0}, {1} and the rest {2, 3}: p = (.4, .3, .3), q = (.35, .3, .35)
    expected = 0.4 * math.log(0.4 / 0.35) + 0.3 * math.log(0.3 / 0.3) + 0.3 * math.log(0.3 / 0.35)
    assert agreement.kld_lower_bound == pytest.approx(expected, abs=1e-12)
    assert agreement.kld_lower_bound <= full_kl(P, Q)
    assert agreement.tail_mass == pytest.approx(1 - 0.65)
    assert agreement.top1 == 1.0 and agreement.positions == 1


def test_coarse_kl_is_the_full_kl_with_every_token():
    topk = engine_topk(Q, 4)
    agreement = stats.against_full(np.log(P)[None, :], np.array([0]), topk)
    assert agreement.kld_lower_bound == pytest.approx(full_kl(P, Q), abs=1e-12)
    assert agreement.tail_mass == pytest.approx(0.0, abs=1e-12)


def test_lower_bound_holds_and_tightens_with_k():
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.full(50, 0.3), size=40)
    q = rng.dirichlet(np.full(50, 0.3), size=40)
    full = np.sum(p * np.log(p / q), axis=1)
    previous = np.zeros(40)
    for k in (1, 2, 5, 10, 25, 50):
        topk = engine_topk(q, k)
        pq = stats.full_on_cells(np.log(p), topk)
        bound = stats.coarse_kl(*pq)
        assert np.all(bound <= full + 1e-9)
        assert np.all(bound >= previous - 1e-9)  # nested cells: a finer partition never lowers the bound
        previous = bound
    np.testing.assert_allclose(previous, full, atol=1e-9)


def test_identical_distributions_give_zero():
    topk = engine_topk(P, 2)
    agreement = stats.against_full(np.log(P)[None, :], np.array([0]), topk)
    assert agreement.kld_lower_bound == pytest.approx(0.0, abs=1e-12)


def test_float16_reference_rows_are_normalized():
    rows = np.log(P).astype(np.float16)[None, :]  # sums to 1 only roughly
    agreement = stats.against_full(rows, np.array([0]), engine_topk(P, 4))
    assert agreement.kld_lower_bound < 1e-6


def test_topk_against_topk_uses_shared_cells():
    reference = stats.pack_topk([[(0, math.log(0.4)), (1, math.log(0.3))]], [None])
    other = stats.pack_topk([[(1, math.log(0.3)), (2, math.log(0.25))]], [None])
    agreement = stats.against_topk(reference, other)
    # one shared cell {1}; the rest holds p = 0.7, q = 0.7
    assert agreement.kld_lower_bound == pytest.approx(0.0, abs=1e-12)
    assert agreement.top1 == 0.0  # the reference's most likely is 0, the other's 1
    reference = stats.pack_topk([[(0, math.log(0.4)), (1, math.log(0.3))]], [None])
    other = stats.pack_topk([[(0, math.log(0.2)), (1, math.log(0.3))]], [None])
    expected = 0.4 * math.log(0.4 / 0.2) + 0.3 * math.log(1.0) + 0.3 * math.log(0.3 / 0.5)
    assert stats.against_topk(reference, other).kld_lower_bound == pytest.approx(expected)


def test_unscored_positions_are_left_out():
    topk = stats.pack_topk([[(0, math.log(0.35)), (1, math.log(0.3))], []], [None, None])
    rows = np.log(np.stack([P, P]))
    agreement = stats.against_full(rows, np.array([0, 0]), topk)
    assert agreement.positions == 1
    assert stats.scored(topk).tolist() == [True, False]
    assert stats.top1_of(topk).tolist() == [0, stats.NO_TOKEN]


def test_reference_rows_are_read_in_blocks(monkeypatch):
    monkeypatch.setattr(stats, "CHUNK_BYTES", 8 * 4 * 3)  # three rows per block
    rng = np.random.default_rng(1)
    p = rng.dirichlet(np.ones(4), size=10)
    q = rng.dirichlet(np.ones(4), size=10)
    topk = engine_topk(q, 2)
    whole = stats.coarse_kl(*stats.full_on_cells(np.log(p), topk)).mean()
    assert stats.against_full(np.log(p), p.argmax(1), topk).kld_lower_bound == pytest.approx(whole)


def test_perplexity_exact_from_the_engines_own_target_logprob():
    topk = engine_topk(np.stack([Q, Q]), 2, targets=[math.log(0.1), math.log(0.25)])
    result = stats.perplexity(topk, np.array([2, 3]))
    assert result.ppl_exact and result.targets_outside == 0
    assert result.ppl == pytest.approx(math.exp(-(math.log(0.1) + math.log(0.25)) / 2))


def test_perplexity_from_candidates_and_bounded_outside_them():
    topk = engine_topk(np.stack([Q, Q]), 2)
    result = stats.perplexity(topk, np.array([1, 3]))  # 1 is a candidate, 3 (p = .25) is not
    assert not result.ppl_exact and result.targets_outside == 1
    # token 3 stands in as the k-th candidate (.3) >= its true .25: a lower bound
    assert result.ppl == pytest.approx(math.exp(-(math.log(0.3) + math.log(0.3)) / 2))
    assert result.ppl <= math.exp(-(math.log(0.3) + math.log(0.25)) / 2)


def test_compared_perplexity_takes_only_the_positions_whose_engine_value_is_exact():
    topk = engine_topk(np.stack([Q, Q, Q]), 2)
    reading_nll = np.array([1.0, 2.0, 3.0])  # the reading's NLL of each position's token
    compared = stats.compared_perplexity(topk, np.array([0, 3, 1]), reading_nll)  # 3 is outside the top-2
    assert compared.positions == 2
    assert compared.engine == pytest.approx(math.exp(-(math.log(0.35) + math.log(0.3)) / 2))
    assert compared.reading == pytest.approx(math.exp((1.0 + 3.0) / 2))
    assert compared.drift == pytest.approx(abs(compared.engine / compared.reading - 1))


def test_compared_perplexity_shows_an_engine_better_than_the_reading():
    """Where every target is among the candidates, an engine that predicts them better than the reading
    is a drift too (a lower bound checked for an excess only could never show it)."""
    topk = engine_topk(np.stack([Q, Q]), 2)
    compared = stats.compared_perplexity(topk, np.array([0, 0]), np.array([3.0, 3.0]))
    assert compared.engine == pytest.approx(1 / 0.35) and compared.reading == pytest.approx(math.exp(3.0))
    assert compared.drift > 0.8


def test_compared_perplexity_without_a_covered_position_is_nan():
    compared = stats.compared_perplexity(engine_topk(Q, 2), np.array([3]), np.array([1.0]))
    assert compared.positions == 0 and math.isnan(compared.drift)


def test_the_kth_candidate_bounds_a_missing_target():
    q = np.array([0.9, 0.05, 0.03, 0.02])
    value, exact = stats.target_logprobs(engine_topk(q, 2), np.array([3]))
    assert not exact[0] and value[0] == pytest.approx(math.log(0.05))


def test_underflowed_candidates_stay_in_the_rest():
    """llama.cpp writes a probability that underflows float32 as 0 (log-prob -inf); vLLM writes -9999."""
    rows = np.log(np.array([[0.6, 0.4 - 1e-30, 1e-30]]))
    underflow = stats.pack_topk([[(0, math.log(0.6)), (1, math.log(0.4)), (2, -math.inf)]], [None])
    clamped = stats.pack_topk([[(0, math.log(0.6)), (1, math.log(0.4)), (2, -9999.0)]], [None])
    for topk in (underflow, clamped):
        assert stats.against_full(rows, np.array([0]), topk).kld_lower_bound == pytest.approx(0.0, abs=1e-9)


def test_full_kl_matches_direct():
    rng = np.random.default_rng(2)
    p, q = rng.dirichlet(np.ones(6), size=5), rng.dirichlet(np.ones(6), size=5)
    assert stats.full_kl(np.log(p), np.log(q)) == pytest.approx(np.mean(np.sum(p * np.log(p / q), 1)))


def test_full_against_full_on_the_engines_cells():
    rows_p, rows_q = np.log(P)[None, :], np.log(Q)[None, :]
    agreement = stats.full_against_full(rows_p, rows_q, engine_topk(Q, 2))
    expected = 0.4 * math.log(0.4 / 0.35) + 0.3 * math.log(0.3 / 0.35)
    assert agreement.kld_lower_bound == pytest.approx(expected) and agreement.top1 == 1.0


def test_greedy_agreement():
    assert stats.matching_prefix([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert stats.matching_prefix([1, 2], [1, 2]) == 2
    assert stats.identical_share([1, 2, 3, 4], [1, 2, 9, 4]) == 0.75
    assert stats.identical_share([1, 2, 3, 4], [1, 2]) == 0.5  # a token the engine did not give differs
    result = stats.greedy_agreement([[1, 2, 3], [4, 5, 6], [7, 8, 9]], [[1, 2, 3], [4, 0, 6], None], 3)
    assert result.prompts == 2 and result.per_prompt == [3, 1]
    assert result.identical_share == pytest.approx((1 + 2 / 3) / 2)


def test_pack_topk_pads():
    topk = stats.pack_topk([[(3, -0.1)], [(1, -1.0), (2, -2.0)]], [None, -1.0])
    assert topk.ids.tolist() == [[3, stats.NO_TOKEN], [1, 2]]
    assert np.isneginf(topk.logprobs[0, 1]) and math.isnan(topk.target[0]) and topk.target[1] == -1.0


def test_scale_free_kl_ignores_a_constant_and_stays_below_the_full_kl():
    topk = engine_topk(Q, 2)
    log_p, log_q = stats.full_on_cells(np.log(P)[None, :], topk)
    shifted = stats.scale_free_kl(log_p, log_q + 0.3)
    assert shifted == pytest.approx(stats.scale_free_kl(log_p, log_q))
    # P * KL(p | cells || q | cells): cells {0, 1}, P = .7
    p_hat, q_hat = np.array([0.4, 0.3]) / 0.7, np.array([0.35, 0.3]) / 0.65
    assert shifted[0] == pytest.approx(0.7 * np.sum(p_hat * np.log(p_hat / q_hat)))
    assert shifted[0] <= stats.coarse_kl(log_p, log_q)[0] <= full_kl(P, Q)


def test_scale_free_kl_is_a_lower_bound_for_any_scale():
    rng = np.random.default_rng(3)
    p = rng.dirichlet(np.full(30, 0.5), size=20)
    q = rng.dirichlet(np.full(30, 0.5), size=20)
    full = np.sum(p * np.log(p / q), axis=1)
    for k in (1, 3, 10, 30):
        log_p, log_q = stats.full_on_cells(np.log(p), engine_topk(q, k))
        for shift in (-0.4, 0.0, 0.4):
            assert np.all(stats.scale_free_kl(log_p, log_q + shift) <= full + 1e-9)
