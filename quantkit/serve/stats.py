"""What serve-check computes from an engine's top-k log-probabilities: pure numpy, no engine, no torch.

An engine reports, for each scored position, up to k candidate tokens with their log-probabilities
(TopK). The reference distribution at that position is either known in full (quantkit's own reading:
a row of log-probs over the whole vocabulary) or also top-k (the base served by the same engine).

KL divergence from top-k: the cells are the tokens whose probability is known under both
distributions, plus one cell holding everything else (probability 1 - the cells' sum under each).
A candidate the engine gives a probability of exactly 0 (log-prob -inf: float32 underflow in
llama.cpp) is not a cell; it stays in the rest.
Merging tokens into one cell never increases the KL divergence (data-processing inequality), so this
coarse KL(p || q) is a lower bound of the full one; it equals it when the cells hold the whole
vocabulary. `tail_mass` (1 - the sum of the engine's candidate probabilities) says how much of the
distribution the candidates leave out, and so how far the bound can be from the full value.

An engine whose log-probs carry an unknown constant per position (mlx_lm.server takes the
log-softmax in bfloat16: its log-probs sum to 0.89-1.13 in probability, off by up to 0.37 nats) is
measured with `scale_free_kl` instead: the least coarse KL over every scale of q's cells, which works
out as P * KL(p restricted to the cells and renormalized || q the same), P the reference's mass on
the cells. The true q is one of those scales, so this too never exceeds the full KL divergence.

Perplexity from top-k: the log-prob of the token that followed is exact where the engine gives it
(vLLM returns the prompt token's own log-prob) or where that token is among the candidates. Elsewhere
only an upper bound of it is known: a token outside the top-k is no more likely than the k-th
candidate, whose log-prob stands in for it, so the perplexity is then a lower bound (`ppl_exact`
False, `targets_outside` counts those positions). (The tail, 1 - the candidates' sum, would bound it
too, but rounding can take it to 0 when the candidates hold nearly all the mass.)
"""

from __future__ import annotations

from collections.abc import Callable

import math
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np

CHUNK_BYTES = 32 * 1024 * 1024  # float64 reference rows per block of positions
REST_FLOOR = 1e-12  # the rest cell's probability under q when rounding leaves it at or below 0
NO_TOKEN = -1


class TopK(NamedTuple):
    """An engine's reading of scored positions (window-major, predictions 0..L-2 of each window)."""

    ids: np.ndarray  # int64 (n, k): candidate token ids; NO_TOKEN pads rows with fewer (a row of NO_TOKEN: not scored)
    logprobs: np.ndarray  # float64 (n, k): their log-probabilities; -inf where ids is NO_TOKEN
    target: np.ndarray  # float64 (n,): log-prob of the token that followed, NaN where the engine did not give it


@dataclass(frozen=True)
class Agreement:
    """One distribution against a reference over the same positions."""

    positions: int  # positions both readings have
    kld_lower_bound: float  # mean coarse KL(reference || other), a lower bound of the mean KL divergence
    kld_lower_bound_p99: float
    tail_mass: float  # mean probability the other reading's candidates leave out (0: nothing left out)
    top1: float  # share of positions whose most likely token is the reference's

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Perplexity:
    ppl: float  # exp(mean NLL of the tokens that followed); a lower bound when ppl_exact is False
    ppl_exact: bool
    targets_outside: int  # positions whose token was not among the candidates and had no log-prob of its own

    def as_dict(self) -> dict:
        return asdict(self)


def pack_topk(rows: list[list[tuple[int, float]]], targets: list[float | None]) -> TopK:
    """TopK from per-position (id, log-prob) lists (an empty list: the position was not scored)."""
    width = max([len(r) for r in rows] + [1])
    ids = np.full((len(rows), width), NO_TOKEN, dtype=np.int64)
    logprobs = np.full((len(rows), width), -np.inf)
    for i, row in enumerate(rows):
        for j, (token, logprob) in enumerate(row):
            ids[i, j], logprobs[i, j] = token, logprob
    target = np.array([math.nan if t is None else t for t in targets], dtype=np.float64)
    return TopK(ids, logprobs, target)


def prefix_topk(next_token: Callable[[list[int]], list[tuple[int, float]]], windows: list[list[int]], name: str,
                progress: Callable[[str], None]) -> TopK:
    """TopK of every next-token prediction of the windows from an engine that gives the candidates of the next
    token only (llama-server, mlx_lm.server): `next_token(prefix)` once per prediction. The actual target's
    log-prob is known only when it is among the candidates."""
    rows = []
    for i, ids in enumerate(windows):
        progress(f"{name} next-token log-probs: window ({i + 1}/{len(windows)})")
        rows += [next_token(ids[:j]) for j in range(1, len(ids))]
    return pack_topk(rows, [None] * len(rows))


def scored(topk: TopK) -> np.ndarray:
    """bool (n,): positions the engine gave candidates for."""
    return (topk.ids != NO_TOKEN).any(axis=1)


def probabilities(logprobs: np.ndarray) -> np.ndarray:
    """exp of log-probs in float64 (-inf gives 0)."""
    return np.exp(np.asarray(logprobs, dtype=np.float64))


def log_normalized(logprob_rows: np.ndarray) -> np.ndarray:
    """Full log-prob rows in float64, each shifted to sum to 1 in probability (float16 rows do only
    roughly)."""
    rows = np.asarray(logprob_rows, dtype=np.float64)
    top = rows.max(axis=1, keepdims=True)
    return rows - (top + np.log(np.exp(rows - top).sum(axis=1, keepdims=True)))


def tail_mass(topk: TopK) -> np.ndarray:
    """float64 (n,): 1 - the sum of each position's candidate probabilities, at least 0."""
    return np.clip(1.0 - probabilities(topk.logprobs).sum(axis=1), 0.0, 1.0)


def coarse_kl(log_p: np.ndarray, log_q: np.ndarray) -> np.ndarray:
    """KL(p || q) per row over the given cells plus one cell for the rest.

    log_p, log_q: float64 (n, m), the two distributions' log-probs of the same m tokens; a column
    whose log_q is -inf is not a cell of that row (its mass stays in the rest). Terms are taken from
    the log-probs themselves (vLLM writes -9999 for a probability that underflows); a cell with p = 0
    adds 0; the rest cell's q is floored at REST_FLOOR (a larger q only lowers the term, so the bound
    holds)."""
    cell = np.isfinite(log_q)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        p = np.where(cell, probabilities(log_p), 0.0)
        q = np.where(cell, probabilities(log_q), 0.0)
        terms = np.where(p > 0, p * (log_p - log_q), 0.0)
        p_rest = np.clip(1.0 - p.sum(axis=1), 0.0, 1.0)
        q_rest = np.clip(1.0 - q.sum(axis=1), REST_FLOOR, 1.0)
        rest = np.where(p_rest > 0, p_rest * (np.log(p_rest) - np.log(q_rest)), 0.0)
    return np.maximum(terms.sum(axis=1) + rest, 0.0)


def scale_free_kl(log_p: np.ndarray, log_q: np.ndarray) -> np.ndarray:
    """min over c of coarse_kl(log_p, log_q + c) per row: P * KL(p | cells || q | cells) (module docstring);
    cells as in coarse_kl."""
    cell = np.isfinite(log_q)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        p = np.where(cell, probabilities(log_p), 0.0)
        mass_p = p.sum(axis=1)
        log_mass_q = np.log(np.where(cell, probabilities(log_q), 0.0).sum(axis=1))
        terms = np.where(p > 0, p * ((log_p - np.log(mass_p)[:, None]) - (log_q - log_mass_q[:, None])), 0.0)
    return np.maximum(np.where(mass_p > 0, terms.sum(axis=1), 0.0), 0.0)


def full_on_cells(rows: np.ndarray, topk: TopK) -> tuple[np.ndarray, np.ndarray]:
    """(log p, log q): a full distribution (log-prob rows, normalized) and the engine's candidates, on
    the engine's candidate tokens (-inf in log q where a column is not a cell)."""
    log_full = log_normalized(rows)
    known = (topk.ids != NO_TOKEN) & (topk.ids < log_full.shape[1])  # an id past the rows: no known probability
    log_q = np.where(known, topk.logprobs, -np.inf)
    log_p = np.where(known, np.take_along_axis(log_full, np.where(known, topk.ids, 0), axis=1), -np.inf)
    return log_p, log_q


def shared_cells(reference: TopK, other: TopK) -> tuple[np.ndarray, np.ndarray]:
    """(log p, log q) on the other reading's candidates that are also the reference's (-inf elsewhere)."""
    match = (other.ids[:, :, None] == reference.ids[:, None, :]) & (other.ids[:, :, None] != NO_TOKEN)
    log_p = np.where(match, reference.logprobs[:, None, :], -np.inf).max(axis=2)
    log_q = np.where(match.any(axis=2) & np.isfinite(log_p), other.logprobs, -np.inf)
    return log_p, log_q


def top1_of(topk: TopK) -> np.ndarray:
    """int64 (n,): each position's most likely candidate (NO_TOKEN where not scored)."""
    best = np.take_along_axis(topk.ids, topk.logprobs.argmax(axis=1)[:, None], axis=1)[:, 0]
    return np.where(scored(topk), best, NO_TOKEN)


def rows_of(topk: TopK, index) -> TopK:
    """The positions `index` (a slice or a mask) of a reading."""
    return TopK(topk.ids[index], topk.logprobs[index], topk.target[index])


def row_ranges(n: int, vocab: int) -> list[tuple[int, int]]:
    """Consecutive ranges of positions whose float64 rows stay near CHUNK_BYTES."""
    step = max(1, CHUNK_BYTES // (8 * max(1, vocab)))
    return [(start, min(n, start + step)) for start in range(0, n, step)]


def summarize(kl: np.ndarray, tail: np.ndarray, same_top1: np.ndarray) -> Agreement:
    """Agreement from per-position coarse KL, tail mass and top-1 matches."""
    if len(kl) == 0:
        return Agreement(0, math.nan, math.nan, math.nan, math.nan)
    return Agreement(len(kl), float(np.mean(kl)), float(np.percentile(kl, 99)), float(np.mean(tail)),
                     float(np.mean(same_top1)))


def full_rows_kl(rows: np.ndarray, reference_top1: np.ndarray, topk: TopK,
                 divergence=coarse_kl) -> tuple[np.ndarray, ...]:
    """(divergence, tail mass, same top-1) of the scored positions of a block: full log-prob rows of
    the reference and their argmax against the engine's top-k."""
    keep = scored(topk)
    sub = rows_of(topk, keep)
    p, q = full_on_cells(np.asarray(rows, dtype=np.float64)[keep], sub)
    return divergence(p, q), tail_mass(sub), top1_of(sub) == np.asarray(reference_top1)[keep]


def against_full(rows, reference_top1: np.ndarray, topk: TopK, divergence=coarse_kl) -> Agreement:
    """An engine's top-k against a distribution known in full over the positions the engine scored.

    rows: the reference's log-prob rows (an array or anything sliced by row ranges, such as the
    baseline's RowFile), read a block of positions at a time; reference_top1: their argmax;
    divergence: coarse_kl, or scale_free_kl for an engine whose log-probs are not normalized."""
    parts = [full_rows_kl(rows[start:end], reference_top1[start:end], rows_of(topk, slice(start, end)), divergence)
             for start, end in row_ranges(len(topk.ids), rows.shape[1])]
    return summarize(*(np.concatenate(column) for column in zip(*parts)))


def against_topk(reference: TopK, topk: TopK, divergence=coarse_kl) -> Agreement:
    """An engine's top-k against another top-k reading (the base served by the same engine), over the
    positions both scored; the tail reported is the other reading's."""
    keep = scored(reference) & scored(topk)
    ref, sub = rows_of(reference, keep), rows_of(topk, keep)
    p, q = shared_cells(ref, sub)
    return summarize(divergence(p, q), tail_mass(sub), top1_of(sub) == top1_of(ref))


def full_pair_kl(p_rows: np.ndarray, q_rows: np.ndarray, topk: TopK, divergence=coarse_kl) -> tuple[np.ndarray, ...]:
    """(divergence, tail mass, same top-1) of a block: two full distributions on the engine's cells."""
    keep = scored(topk)
    sub = rows_of(topk, keep)
    log_p, cells = full_on_cells(np.asarray(p_rows, dtype=np.float64)[keep], sub)
    log_q, _ = full_on_cells(np.asarray(q_rows, dtype=np.float64)[keep], sub)
    same = np.asarray(p_rows)[keep].argmax(axis=1) == np.asarray(q_rows)[keep].argmax(axis=1)
    return divergence(log_p, np.where(np.isfinite(cells), log_q, -np.inf)), tail_mass(sub), same


def full_against_full(p_rows, q_rows, topk: TopK, divergence=coarse_kl) -> Agreement:
    """Two distributions known in full, on the engine's candidate cells of each position: the bound the
    engine's numbers give, for a like-for-like comparison (tail: the engine's)."""
    parts = [full_pair_kl(p_rows[start:end], q_rows[start:end], rows_of(topk, slice(start, end)), divergence)
             for start, end in row_ranges(len(topk.ids), p_rows.shape[1])]
    return summarize(*(np.concatenate(column) for column in zip(*parts)))


def target_logprobs(topk: TopK, targets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(log-prob of each scored position's next token or an upper bound of it, bool exact) over the
    scored positions: the engine's own value, else the candidate's, else the k-th candidate's."""
    keep = scored(topk)
    ids, logprobs, given = rows_of(topk, keep)
    hit = ids == np.asarray(targets)[keep][:, None]
    candidate = np.where(hit, logprobs, -np.inf).max(axis=1)
    bound = np.where(ids != NO_TOKEN, logprobs, np.inf).min(axis=1)
    exact = ~np.isnan(given) | hit.any(axis=1)
    value = np.where(~np.isnan(given), given, np.where(hit.any(axis=1), candidate, bound))
    return value, exact


def perplexity(topk: TopK, targets: np.ndarray) -> Perplexity:
    """Perplexity of the tokens that followed from the engine's log-probs (a lower bound where some
    were outside the candidates; module docstring)."""
    value, exact = target_logprobs(topk, targets)
    if len(value) == 0:
        return Perplexity(math.nan, False, 0)
    return Perplexity(float(math.exp(-float(np.mean(value)))), bool(exact.all()), int((~exact).sum()))


@dataclass(frozen=True)
class ComparedPerplexity:
    """The engine's and the reading's perplexity on the same positions: those where the engine's log-prob of
    the token that followed is exact (its own value, or the token among its candidates). Both are exact there,
    so their ratio can show a difference either way, whatever share of the tokens the candidates miss."""

    positions: int
    engine: float
    reading: float

    @property
    def drift(self) -> float:
        """|engine / reading - 1| (NaN with no position to compare on)."""
        return abs(self.engine / self.reading - 1.0) if self.positions else math.nan

    def as_dict(self) -> dict:
        return {**asdict(self), "drift": self.drift}


def compared_perplexity(topk: TopK, targets: np.ndarray, reading_nll: np.ndarray) -> ComparedPerplexity:
    """ComparedPerplexity from the engine's candidates and the reading's NLL of every position (the same
    positions as `targets`)."""
    value, exact = target_logprobs(topk, targets)
    reading = np.asarray(reading_nll, dtype=np.float64)[scored(topk)][exact]
    if not exact.any():
        return ComparedPerplexity(0, math.nan, math.nan)
    return ComparedPerplexity(int(exact.sum()), float(math.exp(-float(np.mean(value[exact])))),
                              float(math.exp(float(np.mean(reading)))))


def matching_prefix(reference: list[int], other: list[int]) -> int:
    """Tokens from the start before the two continuations first differ."""
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return min(len(reference), len(other))


def identical_share(reference: list[int], other: list[int]) -> float:
    """Share of positions holding the same token, over the longer continuation (a missing token differs)."""
    length = max(len(reference), len(other))
    if length == 0:
        return 1.0
    return sum(a == b for a, b in zip(reference, other)) / length


@dataclass(frozen=True)
class GreedyAgreement:
    """Greedy continuations of held-out prompts: the engine's against quantkit's reading's."""

    prompts: int  # prompts compared (a prompt the engine could not be sent as the same ids is left out)
    steps: int  # tokens asked for per prompt
    matching_prefix: float  # mean tokens before the first difference
    identical_share: float  # mean share of identical tokens (identical_share)
    per_prompt: list[int]  # matching prefix of each compared prompt

    def as_dict(self) -> dict:
        return asdict(self)


def greedy_agreement(reference: list[list[int]], engine: list[list[int] | None], steps: int) -> GreedyAgreement:
    pairs = [(r, e) for r, e in zip(reference, engine) if e is not None]
    prefixes = [matching_prefix(r, e) for r, e in pairs]
    shares = [identical_share(r, e) for r, e in pairs]
    return GreedyAgreement(len(pairs), steps, float(np.mean(prefixes)) if pairs else math.nan,
                           float(np.mean(shares)) if pairs else math.nan, prefixes)


def full_kl(p_rows, q_rows) -> float:
    """Mean KL(p || q) of two distributions known in full (log-prob rows, each normalized), read a
    block of positions at a time."""
    total = 0.0
    for start, end in row_ranges(len(p_rows), p_rows.shape[1]):
        log_p, log_q = log_normalized(p_rows[start:end]), log_normalized(q_rows[start:end])
        with np.errstate(invalid="ignore"):
            total += float(np.where(log_p > -np.inf, np.exp(log_p) * (log_p - log_q), 0.0).sum())
    return total / max(1, len(p_rows))
