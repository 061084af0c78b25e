"""Quality metrics and the gate: perplexity, KL divergence and top-1 agreement against the base.

Protocol (also in README): held-out windows of `seq_len` tokens that never overlap the
calibration windows, each starting with BOS where the tokenizer has one. Every next-token
prediction inside a window is scored (seq_len - 1 per window). The baseline is run once per
run; its log-probabilities are kept in float16 (in memory, or in a temporary file read and written
with plain I/O when they would exceed SPILL_THRESHOLD bytes) together with its float32 NLL and argmax; or,
where keeping them would cost more memory than a second model (a large vocabulary), none are kept and the
base is scored again beside each candidate, chunk for chunk (lockstep_baseline: the same float16 rounding,
the same numbers). A
candidate's log-probabilities are rounded to float16 the same way, and both rows renormalized, before
the KL divergence KL(base || candidate) is taken, so an artifact identical to the base scores exactly 0
and the rounding moves the KL divergence only to second order (kl_rows).

A model is seen through a Scorer: windows -> an iterator of ScoredChunks, each the log-probs of
a block of consecutive positions (window-major, predictions 0..L-2 of each window) and their
targets. The baseline and the comparison consume the chunks on the fly, so no [positions x
vocab] float32 array is ever whole; a model object gives chunks through `model_scorer` (its output
head applied a chunk of positions at a time), a layer-streamed forward through
`quantkit.eval.stream.streamed_scorer`.

Non-finite values: a candidate position whose log-probs hold a NaN never agrees on
top-1 and has a NaN KL divergence, so NaN/Inf shows in the metrics, and the gate's `finite`
check fails any non-finite metric even when the gate is not enforced.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, NamedTuple

import numpy as np

SPILL_THRESHOLD = 64 * 1024 * 1024  # float16 baseline log-probs above this go to a file (quantkit.io.rowio)
BATCH_LOGITS_BYTES = 64 * 1024 * 1024  # float32 logits per forward batch; a few copies live at once
CHUNK_BYTES = 4 * 1024 * 1024  # float32 log-probs per scored chunk on a CPU; a few copies live at once. Small
# enough that the allocator serves every chunk from memory already mapped (a chunk of 32 MiB is a fresh memory map
# whose pages fault in on first touch: four times the cost of the arithmetic) and the passes over it stay in caches
GATE_METRICS = (  # (metric, threshold field, comparison)
    ("ppl_increase", "max_ppl_increase", "<="),
    ("ppl_delta", "max_ppl_delta", "<="),
    ("kld_mean", "max_kld", "<="),
    ("kld_median", "max_kld_median", "<="),
    ("kld_p90", "max_kld_p90", "<="),
    ("kld_p99", "max_kld_p99", "<="),
    ("kld_max", "max_kld_max", "<="),
    ("delta_p", "max_delta_p", "<="),
    ("top1", "min_top1", ">="),
    ("flips", "max_flips", "<="),
)
ALWAYS_CHECKED = ("ppl_increase", "kld_mean", "top1")  # in the gate's table with or without a threshold
NO_TOP1 = -1  # a baseline position whose log-probs are not finite: nothing agrees with it


class ScoredChunk(NamedTuple):
    logprobs: "torch.Tensor"  # noqa: F821  float32 (n, vocab): log-softmax of the next-token logits
    targets: "torch.Tensor"  # noqa: F821  int64 (n,): the tokens that followed


Scorer = Callable[["torch.Tensor"], Iterator[ScoredChunk]]  # noqa: F821  windows (w, L) -> chunks in position order
LogitsFn = Callable[["torch.Tensor"], "torch.Tensor"]  # noqa: F821  (input_ids (b, L) -> logits (b, L, V))
# under torchrun: this rank's per-position values -> every rank's, concatenated in rank order (the order of
# the windows, each rank scoring a contiguous share; quantkit.engines.llmcompressor.distributed.gather_positions)
Gather = Callable[[np.ndarray], np.ndarray]


@dataclass
class Baseline:
    logprobs: "np.ndarray | RowFile | None"  # noqa: F821  float16 (positions, vocab), read by row ranges; None: lockstep
    nll: np.ndarray  # float32 (positions,)
    top1: np.ndarray  # int32 (positions,); NO_TOP1 where the base's log-probs are not finite
    targets: np.ndarray  # int64 (positions,)
    tasks: "TaskBaseline | None" = None  # noqa: F821  the base's lm-eval scores (quantkit.eval.tasks), once per run
    flips: "FlipBaseline | None" = None  # noqa: F821  the base's greedy continuations (quantkit.eval.generate)
    scorer: "Scorer | None" = None  # lockstep: the base's Scorer, run beside each candidate (lockstep_baseline)
    shared: object = None  # lockstep: what the base's resident model lends a candidate's (quantkit.eval.resident.Shared)
    scored: bool = True  # nll, top1 and targets are filled (a lockstep baseline's after its first comparison)

    @property
    def ppl(self) -> float:
        return perplexity(self.nll)


@dataclass
class Metrics:
    """The gate's metrics of a candidate against the base on the held-out windows.

    kld_*: KL(base || candidate) per position, mean and percentiles (llama.cpp's --kl-divergence
    table); delta_p: mean |p_candidate - p_base| of the token that followed (llama.cpp's Δp);
    top1: share of positions whose most likely token is the base's (llama.cpp's "same top p");
    flips: share of greedily generated tokens from the first one where the candidate's continuation
    of a held-out prompt leaves the base's (quantkit.eval.generate; None when not measured). Fields
    a report written before they existed lacks read back as None."""

    positions: int
    ppl_base: float
    ppl: float
    ppl_increase: float
    kld_mean: float
    kld_p99: float
    top1: float
    ppl_delta: float | None = None
    kld_median: float | None = None
    kld_p90: float | None = None
    kld_max: float | None = None
    delta_p: float | None = None
    flips: float | None = None
    kld_histogram: list[int] | None = None  # positions per KLD_EDGES bin (below the first edge, ..., above the last)

    def as_dict(self) -> dict:
        return asdict(self)


# The KL divergence histogram's bin edges: two bins per decade from 1e-6 to 10 (the model card's figure).
KLD_EDGES = tuple(10.0 ** (e / 2) for e in range(-12, 3))


def kld_histogram(kl) -> list[int]:
    """Positions per bin of KLD_EDGES, with a bin below the first edge and one from the last edge up (non-finite
    values left out)."""
    kl = np.asarray(kl, dtype=np.float64)
    counts, _ = np.histogram(kl[np.isfinite(kl)], bins=[-np.inf, *KLD_EDGES, np.inf])
    return [int(c) for c in counts]


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


# ------------------------------------------------------------------ scorers


def positions(windows) -> int:
    """Scored positions of the windows: seq_len - 1 next-token predictions each."""
    return int(windows.shape[0]) * (int(windows.shape[1]) - 1)


def chunk_rows(vocab_size: int) -> int:
    """Positions per scored chunk so its float32 log-probs stay near CHUNK_BYTES."""
    return max(1, CHUNK_BYTES // (4 * vocab_size))


def score_logits(logits, ids) -> Iterator[ScoredChunk]:
    """float32 log-probs of predictions 0..L-2 of each window, flattened, a chunk of rows at a time."""
    import torch

    flat = logits[:, :-1, :].reshape(-1, logits.shape[-1])
    targets = ids[:, 1:].reshape(-1)
    step = chunk_rows(logits.shape[-1])
    for start in range(0, flat.shape[0], step):
        rows = flat[start : start + step]
        yield ScoredChunk(torch.log_softmax(rows.float(), dim=-1), targets[start : start + step])


def model_logits_fn(model) -> LogitsFn:
    def logits(ids):
        device = next(model.parameters()).device
        return model(input_ids=ids.to(device)).logits.float().cpu()

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


def inference_generator(function):
    """The generator function `function`, each of its steps run in torch.inference_mode and the mode restored
    at each yield (torch's decorator does so): a `with torch.inference_mode()` around a yield would leave the
    consumer in inference mode while the generator is suspended, and for good where it is never finished."""
    import torch

    return torch.inference_mode()(function)


def logits_scorer(logits_fn: LogitsFn, vocab_size: int | None = None, batch_size: int | None = None) -> Scorer:
    """A Scorer over a whole-batch logits function (batches sized by vocab_size unless given)."""

    @inference_generator
    def scorer(windows) -> Iterator[ScoredChunk]:
        for batch in iter_batches(windows, batch_size or batch_size_for(windows, vocab_size)):
            yield from score_logits(logits_fn(batch), batch)

    return scorer


def model_scorer(model) -> Scorer:
    """A Scorer over a model object in memory: its base model's last hidden states for a batch of windows,
    then its output head (and what its forward does to the logits: Finish) a chunk of
    positions at a time, each chunk's logits cast to float32 inside the log-softmax as model_logits_fn
    casts them: one chunk's logits are the most ever held, whatever the vocabulary."""
    from quantkit.io.memory import release_freed_memory

    vocab = model.config.get_text_config().vocab_size

    @inference_generator
    def scorer(windows) -> Iterator[ScoredChunk]:
        buffers = Buffers()  # one block of logits for every batch, not a fresh [positions, vocab] tensor each
        for batch in iter_batches(windows, batch_size_for(windows, vocab)):
            yield from score_model_batch(model, batch, buffers)
            release_freed_memory()  # the batch's freed activations go back: the peak does not creep

    return scorer


def score_model_batch(model, ids, buffers: Buffers | None = None) -> Iterator[ScoredChunk]:
    """Log-probs of predictions 0..L-2 of each window of `ids` from a model object (score_hidden), its head's
    logits in `buffers` where given."""
    from quantkit.arch.modules import decoder

    device = next(model.parameters()).device
    base = model.base_model  # the CausalLM itself where its prefix names no attribute (Llama4ForCausalLM)
    body = decoder(model) if base is model else base
    hidden = body(input_ids=ids.to(device), use_cache=False).last_hidden_state
    hidden = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    return score_hidden(hidden, ids[:, 1:].reshape(-1).to(device), model.get_output_embeddings(),
                        finish_of(model.config.get_text_config()), buffers)


GPU_CHUNK_BYTES = 1024 * 1024 * 1024  # on a GPU: large chunks keep it busy
HEAD_BLOCK_BYTES = 32 * 1024 * 1024  # a CPU's logits in the model's dtype per matmul of the head: the head's
# weight is read once per block (262144 entries at width 640, 4096 positions: blocks of 32 positions 2.8 s, 64:
# 2.1 s, 128: 1.7 s, each 16 MiB more held beside each model)


def chunk_positions(device, vocab: int) -> int:
    """Positions per chunk of float32 log-probs on `device`: chunk_rows on a CPU (4 positions of a 262144-entry
    vocabulary), GPU_CHUNK_BYTES' worth on a GPU (at least 128)."""
    import torch

    if torch.device(device).type == "cuda":
        return max(128, GPU_CHUNK_BYTES // (4 * vocab))
    return chunk_rows(vocab)


def head_block_positions(device, vocab: int, element_size: int) -> int:
    """Positions per matmul of the output head on `device`: HEAD_BLOCK_BYTES of logits on a CPU (64 positions
    of a 262144-entry vocabulary in 16 bits), a chunk's on a GPU."""
    import torch

    if torch.device(device).type == "cuda":
        return chunk_positions(device, vocab)
    return max(1, HEAD_BLOCK_BYTES // (element_size * vocab))


def plain_linear(module) -> bool:
    """A torch.nn.Linear without a bias whose forward is its class's, with no hooks: nothing else runs when it
    is called (compressed-tensors gives a quantized module a forward of its own)."""
    import torch

    return (type(module) is torch.nn.Linear and module.bias is None and "forward" not in vars(module)
            and not module._forward_hooks and not module._forward_pre_hooks)


@dataclass(frozen=True)
class Finish:
    """What the CausalLM's forward does to its head's logits, which quantkit's own head blocks do as it does:
    config.logits_scaling applied (Granite's divisor: quantkit.arch.modules.logits_scale), then Gemma's
    final_logit_softcapping."""

    scale: tuple[str, float] | None = None  # ("divide" | "multiply", logits_scaling)
    softcap: float | None = None

    def __call__(self, logits):
        """`logits` finished in place (the model's dtype, as its forward computes them)."""
        if self.scale is not None:
            how, value = self.scale
            logits = logits.div_(value) if how == "divide" else logits.mul_(value)
        if self.softcap is not None:
            logits = logits.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits


def finish_of(text_config) -> Finish:
    """The Finish of a model's text config (a transformers config or its dict)."""
    from quantkit.arch.modules import logits_scale

    values = text_config if isinstance(text_config, dict) else text_config.to_dict()
    return Finish(logits_scale(values), values.get("final_logit_softcapping"))


def head_logits(head, finish: Finish, hidden, out=None) -> "torch.Tensor":  # noqa: F821
    """Logits of hidden states (positions, hidden) in the model's dtype: the head, then what the model's forward
    does to them (Finish). A plain_linear head writes into `out` where given (the matmul its forward runs, into
    memory reused from call to call)."""
    import torch

    if out is not None and plain_linear(head):
        logits = torch.matmul(hidden, head.weight.t(), out=out)
    else:
        logits = head(hidden)
    return finish(logits)


def score_hidden(hidden, targets, head, finish: Finish, buffers: Buffers | None = None) -> Iterator[ScoredChunk]:
    """ScoredChunks of hidden states (positions, hidden) and their targets: the head applied a block of
    positions at a time (head_block_positions) into a buffer reused from block to block (`buffers`), each
    block's log-softmax taken in float32 a chunk of positions at a time (chunk_positions), as model_logits_fn
    casts the logits. One block of logits and a chunk of log-probs are the most held, whatever the vocabulary."""
    import torch

    buffers = buffers or Buffers()
    vocab, dtype, device = head.out_features, head.weight.dtype, hidden.device
    block, step = head_block_positions(device, vocab, dtype.itemsize), chunk_positions(device, vocab)
    for first in range(0, hidden.shape[0], block):
        rows = hidden[first : first + block]
        logits = head_logits(head, finish, rows, buffers.get("logits", rows.shape[0], vocab, dtype, device))
        for start in range(0, rows.shape[0], step):
            part = logits[start : start + step]
            yield ScoredChunk(torch.log_softmax(part, dim=-1, dtype=torch.float32),
                              targets[first + start : first + start + part.shape[0]])


# ------------------------------------------------------------------ baseline and comparison


def _allocate(shape: tuple[int, int], workdir: Path | None, spill: bool = True):
    """float16 rows in memory when small (or `spill` is False), else in an unlinked file (a memory map
    would keep every page written or read resident: the baseline's whole size in the RSS)."""
    from quantkit.io.rowio import RowFile

    if not spill or shape[0] * shape[1] * 2 <= SPILL_THRESHOLD:
        return np.empty(shape, dtype=np.float16)
    return RowFile(shape, np.float16, workdir, prefix="quantkit-baseline-")


def empty_baseline(n_positions: int, vocab: int, workdir: Path | None, spill: bool = True) -> Baseline:
    return Baseline(_allocate((n_positions, vocab), workdir, spill), np.empty(n_positions, np.float32),
                    np.empty(n_positions, np.int32), np.empty(n_positions, np.int64))


MAX_BLOCK = 1024  # entries per block of a row whose maximum is taken first (row_max)


def row_max(rows) -> tuple["torch.Tensor", "torch.Tensor"]:  # noqa: F821
    """Each row's maximum and the index of its first occurrence (what rows.max(-1) gives), from the maxima of
    blocks of MAX_BLOCK entries: on a CPU `max` with indices is a scalar loop, `amax` a vectorized one (about 12x
    faster over 262144 entries), and only the one block holding a row's maximum is searched for its index. The
    maximum of a row holding a NaN is NaN (amax propagates it), as max's is."""
    import torch

    n, vocab = rows.shape
    whole = vocab - vocab % MAX_BLOCK
    parts = [rows[:, :whole].unflatten(1, (-1, MAX_BLOCK)).amax(-1)] if whole else []
    if whole < vocab:
        parts.append(rows[:, whole:].amax(-1, keepdim=True))
    blocks = torch.cat(parts, 1) if len(parts) > 1 else parts[0]
    values = blocks.amax(-1)
    first = (blocks == values[:, None]).to(torch.uint8).argmax(-1)  # the first block holding the maximum
    columns = (first[:, None] * MAX_BLOCK + torch.arange(MAX_BLOCK, device=rows.device)).clamp_max_(vocab - 1)
    return values, first * MAX_BLOCK + rows.gather(1, columns).argmax(-1)  # clamped repeats come after the last


def top1_and_finite(logprobs) -> tuple["torch.Tensor", "torch.Tensor"]:  # noqa: F821
    """(argmax per position, NO_TOP1 where the log-probs are not finite; which positions hold no NaN), from
    one max per row: max propagates NaN, so a row's maximum is NaN exactly when the row holds one (-inf is
    a legitimate log-prob of 0; +inf cannot occur)."""
    import torch

    values, index = row_max(logprobs)
    finite = ~values.isnan()
    return torch.where(finite, index, NO_TOP1), finite


class Buffers:
    """Tensors reused from chunk to chunk under a name: a large vocabulary's rows are not allocated afresh for
    every chunk (on a CPU, allocations this large are fresh memory maps whose pages fault in on first touch:
    about four times the cost of the arithmetic on them). A buffer grows when more rows are asked for; fewer
    rows are a view of its first ones."""

    def __init__(self):
        self.held: dict = {}

    def get(self, name: str, rows: int, columns: int, dtype, device) -> "torch.Tensor":  # noqa: F821
        import torch

        held = self.held.get(name)
        if held is None or held.shape[0] < rows or held.shape[1] != columns or held.dtype != dtype \
                or held.device != torch.device(device):
            held = self.held[name] = None  # the old one freed before the new one is allocated
            held = self.held[name] = torch.empty((rows, columns), dtype=dtype, device=device)
        return held[:rows]


def target_nll(chunk: ScoredChunk) -> np.ndarray:
    return -chunk.logprobs.gather(1, chunk.targets[:, None])[:, 0].cpu().numpy()


def store_rows(rows, offset: int, logprobs) -> None:
    """Log-probs rounded to float16 into rows offset.. of the baseline: converted and written in one pass
    where the rows are in memory, through a float16 copy into a spilled file (quantkit.io.rowio.RowFile)."""
    import torch

    if isinstance(rows, np.ndarray):
        torch.from_numpy(rows[offset : offset + logprobs.shape[0]]).copy_(logprobs)
    else:
        rows[offset : offset + logprobs.shape[0]] = logprobs.to(torch.float16).cpu().numpy()


def keep_chunk(baseline: Baseline, offset: int, chunk: ScoredChunk) -> int:
    """What the gate needs of one scored chunk kept in rows offset.. of `baseline`; the next chunk's offset."""
    end = offset + chunk.logprobs.shape[0]
    store_rows(baseline.logprobs, offset, chunk.logprobs)
    baseline.nll[offset:end] = target_nll(chunk)
    baseline.top1[offset:end] = top1_and_finite(chunk.logprobs)[0].cpu().numpy()
    baseline.targets[offset:end] = chunk.targets.cpu().numpy()
    return end


class Keeper:
    """Scored chunks kept as a Baseline while they pass on to what consumes them (`compare(..., keep=)`): a
    candidate's own reading kept as it is measured, for what compares other readings of it with it later (the
    KV-cache types against the artifact's 16-bit-cache reading) without scoring it again. The log-probs are
    rounded to float16, in a file above SPILL_THRESHOLD bytes unless `spill` is False."""

    def __init__(self, n_positions: int, workdir: Path | None = None, spill: bool = True):
        self.n_positions, self.workdir, self.spill = n_positions, workdir, spill
        self.baseline: Baseline | None = None

    def passing(self, chunks: Iterable[ScoredChunk]) -> Iterator[ScoredChunk]:
        offset = 0
        for chunk in chunks:
            if self.baseline is None:
                self.baseline = empty_baseline(self.n_positions, chunk.logprobs.shape[-1], self.workdir, self.spill)
            offset = keep_chunk(self.baseline, offset, chunk)
            yield chunk


def baseline_from_chunks(chunks: Iterable[ScoredChunk], n_positions: int, workdir: Path | None = None,
                         spill: bool = True) -> Baseline:
    """Keep what the gate needs from the base's scored chunks (Keeper)."""
    keeper = Keeper(n_positions, workdir, spill)
    for _ in keeper.passing(chunks):
        pass
    return keeper.baseline


def compute_baseline(scorer: Scorer, windows, workdir: Path | None = None, spill: bool = True) -> Baseline:
    """Run the full-precision model once over the evaluation windows and keep what the gate needs (its
    log-probs in memory with `spill` False: a resident gate, whose memory was counted for them)."""
    import torch

    with torch.inference_mode():
        return baseline_from_chunks(scorer(windows), positions(windows), workdir, spill)


def lockstep_baseline(scorer: Scorer, windows, shared: object = None) -> Baseline:
    """A baseline that keeps none of the base's log-probs: `compare` runs `scorer` beside each candidate and
    compares chunk for chunk (the base's log-probs rounded to float16 as a kept baseline's are), filling the
    base's NLL, top-1 and targets as it goes. What the base's resident model lends a candidate's: `shared`."""
    n = positions(windows)
    return Baseline(None, np.empty(n, np.float32), np.empty(n, np.int32), np.empty(n, np.int64),
                    scorer=scorer, shared=shared, scored=False)


FLOAT16_MIN = -65504.0  # the most negative finite float16: a log-prob of -inf (probability 0) is read as this


def kl_rows(base16, cand, finite=None, buffers: Buffers | None = None) -> "torch.Tensor":  # noqa: F821
    """KL(base || cand) per position from float16-rounded log-probs; tiny negatives clamp to 0.

    Both rows are taken as distributions after rounding (each divided by its sum, Z), so the rounding
    enters the KL divergence only to second order (a float16 step of 1e-3 moves it by about 1e-6), where
    rounded, unnormalized rows put noise of their own size into every position, which the clamp at 0
    turned into a bias of ~5e-4. With p~ = exp(base) and d = base - cand:
        KL = sum(p~ * d) / Z_base - log Z_base + log Z_cand
    Identical rows score exactly 0. A log-prob of -inf is read as FLOAT16_MIN, so a token both give
    probability 0 (a masked vocabulary entry) adds exactly 0, and one only the candidate gives 0 adds a
    large finite term. A candidate position whose log-probs hold a NaN gets a NaN (`finite`: the positions
    without one, when the caller has them). Computed on the candidate's device (the base's rows, float16 as a
    numpy array or a tensor, are copied there) in `buffers` (reused from chunk to chunk where given)."""
    return kl_rows_of([base16], cand, finite, buffers)[0]


def kl_rows_of(bases: list, cand, finite=None, buffers: Buffers | None = None) -> list:
    """kl_rows of one candidate against each of `bases` (float16 rows of the same positions), the candidate's
    own terms (its float16 rounding and log Z) computed once."""
    import torch

    buffers = buffers or Buffers()
    if finite is None:
        finite = top1_and_finite(cand)[1]
    rounded, log_z_cand = candidate_terms(cand, buffers)
    last = len(bases) - 1
    return [torch.where(finite, kl_from(b, rounded, log_z_cand, buffers, reuse=i == last), math.nan)
            for i, b in enumerate(bases)]


def candidate_terms(cand, buffers: Buffers) -> tuple:
    """(the candidate's log-probs rounded to float16, as float32 with -inf read as FLOAT16_MIN; its log Z)."""
    import torch

    n, vocab = cand.shape
    half = buffers.get("kl half", n, vocab, torch.float16, cand.device).copy_(cand)
    rounded = buffers.get("kl cand", n, vocab, torch.float32, cand.device).copy_(half).clamp_min_(FLOAT16_MIN)
    scratch = buffers.get("kl base", n, vocab, torch.float32, cand.device)
    return rounded, torch.exp(rounded, out=scratch).sum(-1).log_()


def kl_from(base16, rounded, log_z_cand, buffers: Buffers, reuse: bool = True):
    """KL(base || cand) per position from the candidate's terms (candidate_terms); `reuse`: the candidate's
    rows are not needed again and hold the difference (no buffer more)."""
    import torch

    n, vocab = rounded.shape
    base16 = torch.from_numpy(np.asarray(base16)) if isinstance(base16, np.ndarray) else base16
    base = buffers.get("kl base", n, vocab, torch.float32, rounded.device).copy_(base16).clamp_min_(FLOAT16_MIN)
    diff = rounded if reuse else buffers.get("kl diff", n, vocab, torch.float32, rounded.device)
    torch.sub(base, rounded, out=diff)
    weights = base.exp_()
    z_base = weights.sum(-1)
    dot = torch.mul(weights, diff, out=diff).sum(-1)
    return (dot / z_base - z_base.log() + log_z_cand).clamp_min(0.0)


def compare_chunks(chunks: Iterable[ScoredChunk], baseline: Baseline, gather: Gather | None = None) -> Metrics:
    """Metrics of a candidate's scored chunks against the stored baseline, chunk by chunk. With `gather`
    (several ranks, each with its share of the windows and of the baseline), every position's KL
    divergence, NLL and top-1 agreement is gathered from every rank first, so the percentiles are those of
    every position and the metrics those of one process."""
    return compare_rows(stored_rows(chunks, baseline), baseline, gather)


def stored_rows(chunks: Iterable[ScoredChunk], baseline: Baseline) -> Iterator[tuple[int, object, ScoredChunk]]:
    """(offset, the kept baseline's float16 rows, the candidate's chunk) for each chunk."""
    offset = 0
    for chunk in chunks:
        end = offset + chunk.logprobs.shape[0]
        yield offset, baseline.logprobs[offset:end], chunk
        offset = end


def lockstep_rows(base_chunks: Iterable[ScoredChunk], chunks: Iterable[ScoredChunk],
                  baseline: Baseline) -> Iterator[tuple[int, object, ScoredChunk]]:
    """(offset, the base's log-probs rounded to float16, the candidate's rows) for the same positions of the two
    scorers' chunks (paired); the base's NLL, top-1 and targets go into `baseline` as they pass."""
    import torch

    offset, buffers = 0, Buffers()
    for base, chunk in paired(base_chunks, chunks):
        end = offset + chunk.logprobs.shape[0]
        baseline.nll[offset:end] = target_nll(base)
        baseline.top1[offset:end] = top1_and_finite(base.logprobs)[0].cpu().numpy()
        baseline.targets[offset:end] = base.targets.cpu().numpy()
        base16 = buffers.get("base16", *base.logprobs.shape, torch.float16, base.logprobs.device)
        yield offset, base16.copy_(base.logprobs), chunk
        offset = end
    baseline.scored = offset == baseline.nll.shape[0]


def paired(first: Iterable[ScoredChunk], second: Iterable[ScoredChunk]) -> Iterator[tuple[ScoredChunk, ScoredChunk]]:
    """Two scorers' chunks over the same windows, cut to the same positions: (a, b) with as many rows each.
    The first's next chunk is always asked for before the second's."""
    from quantkit.errors import InternalError

    first, second = iter(first), iter(second)
    a = b = None
    while True:
        a = a if a is not None and a.targets.shape[0] else next(first, None)
        b = b if b is not None and b.targets.shape[0] else next(second, None)
        if a is None or b is None:
            if a is not None or b is not None:
                raise InternalError("two scorers of the same windows gave different numbers of positions")
            return
        n = min(a.targets.shape[0], b.targets.shape[0])
        yield ScoredChunk(a.logprobs[:n], a.targets[:n]), ScoredChunk(b.logprobs[:n], b.targets[:n])
        a, b = ScoredChunk(a.logprobs[n:], a.targets[n:]), ScoredChunk(b.logprobs[n:], b.targets[n:])


def compare_rows(rows: Iterable[tuple[int, object, ScoredChunk]], baseline: Baseline,
                 gather: Gather | None = None) -> Metrics:
    """The metrics from (offset, base float16 rows, candidate chunk) triples (stored_rows, lockstep_rows)."""
    kls, nlls, agree, buffers = [], [], [], Buffers()
    for offset, base16, chunk in rows:
        end = offset + chunk.logprobs.shape[0]
        top1, finite = top1_and_finite(chunk.logprobs)
        kls.append(kl_rows(base16, chunk.logprobs, finite, buffers).cpu().numpy())
        nlls.append(target_nll(chunk))
        agree.append(top1.cpu().numpy() == baseline.top1[offset:end])
    columns = [np.concatenate(kls), np.concatenate(nlls), np.concatenate(agree), baseline.nll]
    kl, nll, agrees, base_nll = [gather(c) for c in columns] if gather else columns
    return summarize(kl, nll, int(agrees.sum()), base_nll)


def delta_p(nll: np.ndarray, base_nll: np.ndarray) -> float:
    """Mean |p_candidate - p_base| of the token that followed, from the two NLLs."""
    return float(np.mean(np.abs(np.exp(-nll.astype(np.float64)) - np.exp(-base_nll.astype(np.float64)))))


def compare(scorer: Scorer, windows, baseline: Baseline, gather: Gather | None = None,
            keep: Keeper | None = None) -> Metrics:
    """Metrics of a candidate against the baseline, streaming over the windows (this rank's share of them
    with `gather`: compare_chunks); a lockstep baseline's base is scored beside it (lockstep_rows). With `keep`,
    the candidate's own chunks are kept as they pass (Keeper)."""
    import torch

    with torch.inference_mode():
        chunks = scorer(windows) if keep is None else keep.passing(scorer(windows))
        if baseline.scorer is None:
            return compare_chunks(chunks, baseline, gather)
        return compare_rows(lockstep_rows(baseline.scorer(windows), chunks, baseline), baseline, gather)


def perplexity(nll: np.ndarray) -> float:
    return float(math.exp(float(np.mean(nll, dtype=np.float64))))


def summarize(kl: np.ndarray, nll: np.ndarray, agree: int, base_nll: np.ndarray) -> Metrics:
    """The metrics from every position's KL divergence and NLL, the count of top-1 agreements and the
    base's NLL per position."""
    ppl = perplexity(nll)
    base = perplexity(base_nll)
    return Metrics(
        positions=int(kl.shape[0]),
        ppl_base=base,
        ppl=ppl,
        ppl_increase=ppl / base - 1.0,
        kld_mean=float(np.mean(kl, dtype=np.float64)),
        kld_p99=float(np.percentile(kl, 99)),
        top1=agree / max(1, kl.shape[0]),
        ppl_delta=ppl - base,
        kld_median=float(np.percentile(kl, 50)),
        kld_p90=float(np.percentile(kl, 90)),
        kld_max=float(np.max(kl)),
        delta_p=delta_p(nll, base_nll),
        kld_histogram=kld_histogram(kl),
    )


# ------------------------------------------------------------------ gate


def non_finite(metrics: Metrics) -> list[str]:
    """Names of the metrics that are NaN or infinite."""
    return [name for name, value in metrics.as_dict().items()
            if isinstance(value, float) and not math.isfinite(value)]


def gate_verdict(metrics: Metrics, gate, enforced: bool = True) -> GateResult:
    """Check each metric against its threshold (a None threshold is reported, never fails).

    A last check, `finite` (value: how many metrics are NaN or infinite), fails whenever any
    metric is not finite, thresholds or not, and it is always enforced: the result's `enforced`
    is then True even when `enforced=False` was asked for (--no-gate), so a NaN artifact is never
    published. NaN compares false against every threshold, so its own check fails too.
    """
    checks = []
    for metric, threshold_field, op in GATE_METRICS:
        value = getattr(metrics, metric)
        threshold = getattr(gate, threshold_field)
        if threshold is None and metric not in ALWAYS_CHECKED:
            continue  # reported in the metrics, checked only when the gate sets a threshold
        ok = threshold is None or (value is not None and (value <= threshold if op == "<=" else value >= threshold))
        checks.append(Check(metric, math.nan if value is None else value, threshold, op, ok))
    bad = non_finite(metrics)
    checks.append(Check("finite", float(len(bad)), None, "==", not bad))
    passed = all(c.passed for c in checks)
    return GateResult(passed, enforced or bool(bad), checks)


def with_checks(verdict: GateResult, checks: list[Check]) -> GateResult:
    """The verdict with more checks (task recovery, quantkit.eval.tasks) added before `finite`."""
    merged = [c for c in verdict.checks if c.name != "finite"] + list(checks)
    merged += [c for c in verdict.checks if c.name == "finite"]
    return GateResult(all(c.passed for c in merged), verdict.enforced, merged)
