"""serve-check: an artifact loaded by the engine that serves it, measured from the engine's own numbers.

The engine runs as a real server on 127.0.0.1 (quantkit.serve.process) and is asked, on the held-out
windows the gate used, for (1) the log-probs of every next-token prediction, (2) greedy continuations
of held-out prompts, (3) streamed continuations at a few concurrencies (quantkit.serve.load), (4) its own
token ids of the held-out windows' text (quantkit.serve.tokens), since everything else is sent as ids. Its
numbers are set against quantkit's own readings of the same windows: the base (quantkit.eval.scorers
base_scorer, or the base served by the same engine with base_from="engine") and the artifact as the
gate read it (artifact_scorer, artifact_logits). The statistics are quantkit.serve.stats.

The verdict (Tolerances, checked in this order):
- reading_kld: the KL divergence of the engine from quantkit's reading of the artifact, a lower bound
  from the engine's top-k (stats module), at most `max_reading_kld`, or at most quantkit's reading's own KL
  divergence from the base on the same windows where that is larger (`reading_threshold`): an engine that
  computes a scheme with other, equivalent arithmetic rounds the activations differently, so its reading and
  quantkit's are two draws of the scheme's rounding noise around the base. That allowance is capped by the KLD
  the artifact's gate measured where it is known (`gated_kld`, from quantkit.json): a config.json edited after
  the gate moves quantkit's reading as well, and must not raise the bar it is checked against;
- ppl_drift: |ppl engine / ppl reading - 1| at most `max_ppl_drift`, both perplexities taken on the positions
  where the engine's log-prob of the token that followed is exact (its own, or the token among its top-k
  candidates: stats.ComparedPerplexity), so a difference either way fails it; not checked for an engine
  whose log-probs are not normalized;
- reading_top1 (when `min_reading_top1` is set): the engine's most likely token is the reading's at
  that share of the positions at least;
- base_kld (when `max_base_kld` is set, e.g. the gate's max_kld): the engine's KL divergence from the
  base, a lower bound, at most that. A lower bound above the gate's threshold means the served artifact
  fails the gate, whatever quantkit's reading says (a config edited after the gate changes both);
- tokenization: the engine's ids of every held-out text equal the Hugging Face tokenizer's (a
  difference is reported at its first position, with the ids and pieces around it).
Greedy agreement and the load test are reported, not checked.

Independent of quantkit.json: the caller gives the windows and the base, so the pipeline can run it on a
staged artifact.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np

from quantkit.errors import InputError, InternalError, UnsupportedError
from quantkit.eval.evaluate import Check
from quantkit.serve import stats, support, tokens
from quantkit.serve.engines import AUTO, Engine, Installed, engine_for, find_engine, get_engine, kinds_served
from quantkit.serve.load import LoadResult, load_test
from quantkit.serve.process import failure_reason, free_port, log_tail, running
from quantkit.serve.settings import Endpoint, ServeOptions, engine_env

BASE_FROM = ("quantkit", "engine")
CONTEXT_MARGIN = 16  # tokens of context beyond the longest request


@dataclass(frozen=True)
class Tolerances:
    """Where the engine's reading must agree with the gate's (module docstring).

    Defaults from measurements on small trained Llama models (hidden 256, vocabulary 1024; vLLM CPU in
    bfloat16, llama-server, mlx_lm.server on a CPU): correct artifacts read by the engine within a KLD
    of 0.0004-0.0023 of quantkit's reading (the most: llama.cpp's Q4_K_M, whose k-quant dot products
    quantize the activations too) and a perplexity within 1%; an artifact whose config.json was edited
    after the gate in a way the engine reads differently (tie_word_embeddings) was 0.19-11.6 off with
    a perplexity 59% off or more. max_reading_kld sits near 10x from both. An artifact that loses more than
    that to the base may read as far from quantkit's reading (reading_threshold). Top-1 is not checked by
    default: on nearly flat distributions it flips on near-ties under bfloat16 rounding (46-82% at a
    KLD of 1e-4 or less on a barely trained model), while the KLD and perplexity do not move."""

    max_reading_kld: float = 0.02
    max_ppl_drift: float = 0.05
    min_reading_top1: float | None = None
    max_base_kld: float | None = None

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Generation:
    """Greedy continuations and the load test: how many and how long."""

    prompts: int = 4
    steps: int = 16
    load_steps: int = 32
    concurrencies: tuple[int, ...] = (1, 8)


@dataclass
class ServeReport:
    artifact: str
    kind: str
    base: str
    engine: dict  # name, version, executable, device, command, queried
    windows: dict  # count, seq_len, positions, scored
    base_from: str
    logprobs: int  # candidates per position asked of the engine (0: the whole vocabulary)
    logprobs_normalized: bool  # False: the engine's log-probs carry a constant per position (KL scale-free)
    vs_base: stats.Agreement
    vs_reading: stats.Agreement
    reading_vs_base: stats.Agreement | None  # quantkit's reading against the base on the engine's cells
    reading_vs_base_kld: float | None  # the same, full distributions (the gate's KLD on these windows)
    ppl: stats.Perplexity
    ppl_base: float
    ppl_reading: float
    ppl_compared: stats.ComparedPerplexity  # engine and reading on the positions where the engine's value is exact
    greedy: stats.GreedyAgreement
    load: list[LoadResult]
    tolerances: Tolerances
    tokenization: tokens.Tokenization | None = None  # None: not asked (a report from before the check)
    # with --kv-cache: the type, the engine's flags, and the engine against quantkit's reading with a 16-bit cache
    # (vs_reading is against the reading with the type: the closer of the two says which cache the engine used)
    kv_cache: dict | None = None
    gated_kld: float | None = None  # the artifact's KLD from the base as its gate measured it (caps reading_threshold)
    checks: list[Check] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    @property
    def failed(self) -> list[str]:
        return [c.name for c in self.checks if not c.passed]

    def as_dict(self) -> dict:
        def plain(value):
            return value.as_dict() if hasattr(value, "as_dict") else value

        data = {name: plain(value) for name, value in self.__dict__.items() if name not in ("load", "checks")}
        return {**data, "load": [r.as_dict() for r in self.load], "checks": [asdict(c) for c in self.checks],
                "passed": self.passed, "failed": self.failed}


# ------------------------------------------------------------------ the engine


def pick_engine(kind: str, name: str) -> Installed:
    """The installed engine for the artifact kind (`name` "auto") or the one named."""
    return find_engine(engine_for(kind) if name == AUTO else name)


def prepare(artifact: Path, engine: str = AUTO) -> tuple[str, Installed, support.Accelerator]:
    """(artifact kind, the engine, this device), or exit 2 before any work: the engine is not installed
    or cannot serve this format on this device (cheap: config.json, headers, nvidia-smi)."""
    from quantkit.formats import detect

    kind = detect(Path(artifact)).kind
    found = pick_engine(kind, engine)
    accelerator = support.accelerator()
    support.check_servable(found.name, Path(artifact), kind, accelerator)
    return kind, found, accelerator


def served_path(artifact: Path, kind: str) -> Path:
    """What the engine loads (its format's served_path): the .gguf file for llama-server, the directory otherwise."""
    from quantkit.formats import get_format

    return get_format(kind).served_path(Path(artifact))


def context_needed(seq_len: int, generation: Generation) -> int:
    """Context for the longest request: a window, or a prompt plus its continuation."""
    prompt = max(1, seq_len // 2)
    return max(seq_len, prompt + generation.steps, seq_len + generation.load_steps) + CONTEXT_MARGIN


@contextmanager
def serving(engine: Installed, model: Path, options: ServeOptions, log_dir: Path | None,
            progress: Callable[[str], None]) -> Iterator[tuple[Path, str, list[str]]]:
    """The engine serving `model`: yields (its log, its url, the command); stopped on every exit path.
    The log is in a temporary directory (removed afterwards) unless `log_dir` is given."""
    client, model = get_engine(engine.name), Path(model).resolve()  # the server runs in its log directory
    with tempfile.TemporaryDirectory(prefix="quantkit-serve-") as tmp:
        logs = Path(log_dir) if log_dir else Path(tmp)
        logs.mkdir(parents=True, exist_ok=True)
        port = free_port()
        command = client.command(engine, model, port, options)
        log = logs / f"{engine.name}-{model.name}.log"
        progress(f"starting {engine.name} on 127.0.0.1:{port} ({model.name}); log: {log}")
        with running(command, engine_env(client.environment(options)), port, client.HEALTH, log,
                     options.start_timeout, engine.name, progress) as server:
            yield log, server.url, command


@contextmanager
def engine_failures(engine: Installed, log: Path) -> Iterator[None]:
    """A request the server fails (HTTP 5xx, a dropped connection) becomes UnsupportedError (exit 2)
    with the cause from the server's log: the engine loaded the artifact but cannot run it."""
    try:
        yield
    except (InternalError, OSError) as exc:
        reason = failure_reason(log_tail(log))
        raise UnsupportedError(f"{engine.name} failed while serving ({str(exc).splitlines()[0]}): {reason}",
                               hint="the format loads but does not run in this engine on this device") from exc


# ------------------------------------------------------------------ one run


@dataclass(frozen=True)
class Setup:
    """What one check runs on: the artifact, its engine, the windows and the settings."""

    artifact: Path
    kind: str
    base_dir: Path
    engine: Installed
    accelerator: support.Accelerator
    windows: np.ndarray  # int64 (w, L)
    prompts: list[list[int]]  # held-out prompts for the greedy continuations
    options: ServeOptions
    generation: Generation
    base_from: str
    engine_base: Path  # what the engine serves as the base with base_from "engine"
    device: str  # where quantkit computes its own readings
    trust_remote_code: bool
    kv: object = None  # quantkit.eval.kv.KvType the engine is started with and quantkit's reading simulates; None: 16-bit

    @property
    def client(self) -> Engine:
        return get_engine(self.engine.name)


@dataclass
class QuantkitSide:
    """quantkit's own readings of the windows and prompts."""

    base: object  # quantkit.eval.evaluate.Baseline of the base, None with base_from "engine"
    reading: object  # Baseline of the artifact (with the Setup's KV type, where it has one)
    greedy: list[list[int]]
    reading_16bit_cache: object = None  # with a KV type: the artifact's Baseline with a 16-bit cache


@dataclass
class EngineSide:
    """What the engine answered."""

    version: str
    command: list[str]
    topk: stats.TopK
    greedy: list[list[int] | None]
    load: list[LoadResult]
    token_ids: list[list[int]]  # the engine's ids of each held-out text
    base_topk: stats.TopK | None = None


def plan(artifact: Path, base_dir: Path, windows, engine: str, options: ServeOptions | None,
         generation: Generation | None, base_from: str, engine_base: Path | None, device: str,
         trust_remote_code: bool, kv_cache: str | None = None) -> Setup:
    """The Setup, or exit 2 before any work (prepare, served_kv_type)."""
    from quantkit.eval.generate import flip_prompts

    if base_from not in BASE_FROM:
        raise InputError(f"unknown base_from '{base_from}'", hint=f"use one of: {', '.join(BASE_FROM)}")
    kind, found, accelerator = prepare(Path(artifact), engine)
    kv = served_kv_type(kv_cache, found.name, Path(base_dir), accelerator)
    generation = generation or Generation()
    windows = np.asarray(windows, dtype=np.int64)
    options = replace(options or ServeOptions(), device=accelerator.kind, kv_flags=kv.flag if kv else ())
    options = replace(options, max_model_len=options.max_model_len or context_needed(windows.shape[1], generation))
    prompts = flip_prompts(windows, generation.prompts).tolist()
    return Setup(Path(artifact), kind, Path(base_dir), found, accelerator, windows, prompts, options, generation,
                 base_from, Path(engine_base or base_dir), device, trust_remote_code, kv)


def served_kv_type(spec: str | None, engine: str, base_dir: Path, accelerator: support.Accelerator):
    """--kv-cache of serve-check: the one KV type (quantkit.eval.kv) the engine is started with and quantkit's
    reading simulates, or exit 2 before any work where the engine lacks it or its served prompt log-probs would
    not show it; None without one."""
    if spec is None:
        return None
    from quantkit.eval import kv
    from quantkit.io.checkpoint import check_model_dir

    unseen = get_engine(engine).PROMPT_KV_UNSEEN
    if unseen:
        raise UnsupportedError(f"serve-check --kv-cache: {unseen}",
                               hint="measure the type with quantize or eval --kv-cache")
    kinds = kv.parse(spec, kv.shape_of(check_model_dir(base_dir).config), engine, cpu=accelerator.kind == "cpu")
    if len(kinds) != 1:
        raise InputError(f"serve-check --kv-cache {spec}: give one type (the engine is started with it)",
                         hint="e.g. --kv-cache llama.cpp:q8_0 or vllm:fp8; --kv-cache auto belongs to quantize and eval")
    (kind,) = kinds
    if kind.engine != engine:
        raise UnsupportedError(f"serve-check --kv-cache {kind.name}: a {kind.engine} KV cache, but the artifact is "
                               f"served by {engine}", hint=f"choose a {engine} type")
    if kind.raw_prefill:
        raise UnsupportedError(f"serve-check --kv-cache {kind.name}: the engine attends over a prompt's raw keys and "
                               "values in its first prefill chunk, so the prompt log-probs it serves do not show this "
                               "cache", hint="measure it with quantize or eval --kv-cache")
    return kind


def quantkit_side(setup: Setup, stop: int | None, progress: Callable[[str], None]) -> QuantkitSide:
    """The base (unless served by the engine) and the artifact as quantkit reads them, and quantkit's
    greedy continuations of the prompts (stopping at `stop`, the EOS of engines that stop there)."""
    import torch

    from quantkit.eval import evaluate, generate, scorers
    from quantkit.formats import gate
    from quantkit.io.checkpoint import check_model_dir

    windows, s = torch.from_numpy(setup.windows), setup
    base = None
    if s.base_from == "quantkit":
        progress(f"quantkit's reading of the base: {s.base_dir}")
        scorer = scorers.base_scorer(check_model_dir(s.base_dir), device=s.device, trust_remote_code=s.trust_remote_code)
        base = evaluate.compute_baseline(scorer, windows)
    progress(f"quantkit's reading of the artifact: {s.artifact}" + (f", KV cache {s.kv.name}" if s.kv else ""))
    with artifact_readers(s) as (scorer, logits):
        reading = evaluate.compute_baseline(scorer, windows)
        progress(f"quantkit's greedy continuations of {len(s.prompts)} held-out prompts")
        greedy = generate.greedy_tokens(logits, s.prompts, s.generation.steps, stop=stop)
    plain = None
    if s.kv is not None:
        progress("quantkit's reading of the artifact with a 16-bit KV cache (what the engine would serve without it)")
        plain = evaluate.compute_baseline(gate.artifact_scorer(s.artifact, s.base_dir, s.device, s.trust_remote_code),
                                          windows)
    return QuantkitSide(base, reading, greedy, plain)


@contextmanager
def artifact_readers(setup: Setup) -> Iterator[tuple]:
    """(scorer, logits function) of the artifact as the engine serves it: through the Setup's KV type where it has
    one (quantkit.formats.gate.kv_readers)."""
    from quantkit.formats import gate

    s = setup
    if s.kv is None:
        yield (gate.artifact_scorer(s.artifact, s.base_dir, s.device, s.trust_remote_code),
               gate.artifact_logits(s.artifact, s.base_dir, s.device, s.trust_remote_code))
        return
    with gate.kv_readers(s.artifact, s.base_dir, s.kv, s.device, s.trust_remote_code) as readers:
        yield readers


def ask(setup: Setup, endpoint: Endpoint, texts: list[str], progress: Callable[[str], None]) -> tuple:
    """(top-k per position, greedy continuations, load results, its ids of the texts) from the running engine."""
    s, client = setup, setup.client
    progress(f"the engine's tokenization of {len(texts)} held-out texts")
    token_ids = client.tokenize(endpoint, s.engine, texts)
    topk = client.prompt_topk(endpoint, s.windows.tolist(), s.options.logprobs, progress)
    progress(f"greedy continuations of {len(s.prompts)} held-out prompts, {s.generation.steps} tokens")
    greedy = client.greedy(endpoint, s.prompts, s.generation.steps)
    bos = getattr(endpoint.tokenizer, "bos_token_id", None)
    load = load_test(client, endpoint, s.windows.tolist(), s.generation.load_steps, s.generation.concurrencies,
                     bos, progress)
    return topk, greedy, load, token_ids


def engine_side(setup: Setup, tokenizer, vocab: int, texts: list[str], log_dir: Path | None,
                progress: Callable[[str], None]) -> EngineSide:
    """The artifact served by its engine and asked (ask); with base_from "engine", the base too."""
    s, served = setup, served_path(setup.artifact, setup.kind)
    with serving(s.engine, served, s.options, log_dir, progress) as (log, url, command):
        endpoint = Endpoint(url, tokenizer, vocab, served)
        with engine_failures(s.engine, log):
            version = s.client.version(endpoint, s.engine)
            answers = EngineSide(version, command, *ask(s, endpoint, texts, progress))
    if s.base_from == "engine":
        answers.base_topk = engine_base_topk(s, tokenizer, vocab, log_dir, progress)
    return answers


def engine_base_topk(setup: Setup, tokenizer, vocab: int, log_dir: Path | None, progress) -> stats.TopK:
    """The base served by the same engine, which must load its kind (llama-server: a .gguf of it)."""
    from quantkit.formats import detect

    s, kind = setup, detect(setup.engine_base).kind
    served = kinds_served(s.client.NAME)
    if kind not in served:
        raise InputError(f"{s.client.LABEL} serves {', '.join(served)} artifacts only: the base must be "
                         f"one to be served ({s.engine_base} is {kind})",
                         hint="give --engine-base the base written in that format, e.g. for llama-server: quantkit "
                              "quantize BASE --method gguf --gguf-type F16 -o BASE-f16, then --engine-base BASE-f16")
    served = served_path(s.engine_base, kind)
    with serving(s.engine, served, s.options, log_dir, progress) as (log, url, _command), \
            engine_failures(s.engine, log):
        return s.client.prompt_topk(Endpoint(url, tokenizer, vocab, served), s.windows.tolist(), s.options.logprobs,
                                    progress)


def serve_check(artifact: Path, base_dir: Path, windows, engine: str = "auto",
                options: ServeOptions | None = None, tolerances: Tolerances | None = None,
                generation: Generation | None = None, base_from: str = "quantkit", engine_base: Path | None = None,
                log_dir: Path | None = None, device: str = "cpu", trust_remote_code: bool = False,
                progress: Callable[[str], None] = lambda message: None, kv_cache: str | None = None,
                gated_kld: float | None = None) -> ServeReport:
    """Serve the artifact in its engine and measure it against quantkit's readings (module docstring).

    windows: int64 (w, L) token ids, the held-out windows (each starting with BOS where the tokenizer
    has one). engine: "auto" (by artifact kind) or a name in quantkit.serve.engines.ENGINES. base_from: "quantkit" (the
    base scored by quantkit, full distributions) or "engine" (`engine_base`, default the base dir,
    served by the same engine). device: where quantkit computes its own readings. kv_cache: one KV type
    (quantkit.eval.kv, e.g. "llama.cpp:q8_0", "vllm:fp8") the engine is started with and quantkit's reading
    simulates at every position (served_kv_type refuses what the served log-probs cannot show). gated_kld: the
    artifact's KLD from the base as its gate measured it (quantkit.json), which caps the reading's allowance. Raises
    UnsupportedError (exit 2) when the engine is missing or cannot serve the artifact here."""
    from quantkit.engines.transformers import load_tokenizer
    from quantkit.io.checkpoint import check_model_dir

    setup = plan(artifact, base_dir, windows, engine, options, generation, base_from, engine_base, device,
                 trust_remote_code, kv_cache)
    tokenizer = load_tokenizer(check_model_dir(setup.base_dir), trust_remote_code)
    texts, token_ids = tokens.reference(tokenizer, setup.windows.tolist())
    ours = quantkit_side(setup, tokenizer.eos_token_id if setup.client.STOPS_AT_EOS else None, progress)
    theirs = engine_side(setup, tokenizer, int(ours.reading.logprobs.shape[1]), texts, log_dir, progress)
    report = build_report(setup, ours, theirs, tolerances or Tolerances(),
                          tokens.compare(token_ids, theirs.token_ids, tokens.piece_decoder(tokenizer)))
    report.gated_kld = gated_kld
    report.checks = verdict(report)
    return report


# ------------------------------------------------------------------ the report


def mean_of(values: np.ndarray, keep: np.ndarray) -> float:
    return float(np.mean(values[keep])) if keep.any() else math.nan


def reading_threshold(report: ServeReport) -> float:
    """max_reading_kld, or quantkit's reading's own KLD from the base where larger (module docstring). Measured
    on Gemma 3 fp8 artifacts in vLLM's CPU build, whose FP8 GEMM multiplies in float32 where compressed-tensors'
    forward rounds both operands to bfloat16: the engine sat 0.4-0.8x the artifact's own KLD from quantkit's
    reading (0.0093 at a KLD of 0.024; docs/serving.md), the family's 16-bit forward 1e-5-3e-4. Without quantkit's
    base (base_from "engine") max_reading_kld alone; never more than the KLD the artifact's gate measured, where
    the report knows it (gated_kld)."""
    own, most = report.reading_vs_base_kld, report.tolerances.max_reading_kld
    if own is None or not math.isfinite(own):
        return most
    return max(most, own if report.gated_kld is None else min(own, report.gated_kld))


def verdict(report: ServeReport) -> list[Check]:
    t = report.tolerances
    drift, most = report.ppl_compared.drift, reading_threshold(report)
    checks = [Check("reading_kld", report.vs_reading.kld_lower_bound, most, "<=",
                    report.vs_reading.kld_lower_bound <= most)]
    if report.logprobs_normalized:
        checks.append(Check("ppl_drift", drift, t.max_ppl_drift, "<=", drift <= t.max_ppl_drift))
    if t.min_reading_top1 is not None:
        checks.append(Check("reading_top1", report.vs_reading.top1, t.min_reading_top1, ">=",
                            report.vs_reading.top1 >= t.min_reading_top1))
    if t.max_base_kld is not None:
        checks.append(Check("base_kld", report.vs_base.kld_lower_bound, t.max_base_kld, "<=",
                            report.vs_base.kld_lower_bound <= t.max_base_kld))
    if report.tokenization is not None:
        checks.append(Check("tokenization", float(report.tokenization.differing), 0.0, "<=",
                            report.tokenization.matches))
    return checks


def failures(report: ServeReport) -> str:
    """The failed checks in one line: each value and what it needed; the tokenization's first difference."""
    parts = []
    for c in report.checks:
        if c.passed:
            continue
        parts.append(f"{c.name} {c.value:.4g} (needs {c.op} {c.threshold:g})")
        if c.name == "tokenization" and report.tokenization.first is not None:
            parts[-1] = (f"tokenization differs in {report.tokenization.differing} of {report.tokenization.texts} "
                         f"held-out texts, first at {report.tokenization.first.describe()}")
    return "; ".join(parts)


def divergence_for(setup: Setup):
    """The KL bound the engine's log-probs allow: coarse, or scale-free where they are not normalized."""
    return stats.coarse_kl if setup.client.NORMALIZED else stats.scale_free_kl


def against_base(setup: Setup, ours: QuantkitSide, theirs: EngineSide, keep: np.ndarray) -> tuple:
    """(engine vs base, quantkit's reading vs base on the engine's cells, the same in full, base ppl)."""
    targets, divergence = ours.reading.targets, divergence_for(setup)
    if ours.base is None:
        return (stats.against_topk(theirs.base_topk, theirs.topk, divergence), None, None,
                stats.perplexity(theirs.base_topk, targets).ppl)
    base = ours.base
    return (stats.against_full(base.logprobs, base.top1, theirs.topk, divergence),
            stats.full_against_full(base.logprobs, ours.reading.logprobs, theirs.topk, divergence),
            stats.full_kl(base.logprobs, ours.reading.logprobs), math.exp(mean_of(base.nll, keep)))


def candidates_asked(setup: Setup) -> int:
    """Candidates per position the engine was asked for (0: all), within what it gives."""
    k, most = setup.options.logprobs, setup.client.MAX_LOGPROBS
    return k if most is None else min(k or most, most)


def engine_record(setup: Setup, theirs: EngineSide) -> dict:
    e = setup.engine
    return {"name": e.name, "version": theirs.version, "executable": str(e.executable), "found_in": e.found_in,
            "device": setup.accelerator.describe(), "command": theirs.command, "queried": setup.client.QUERIED}


def build_report(setup: Setup, ours: QuantkitSide, theirs: EngineSide, tolerances: Tolerances,
                 tokenization: tokens.Tokenization | None = None) -> ServeReport:
    """The report's numbers from both sides' readings (stats module) and the tokenization's comparison."""
    keep = stats.scored(theirs.topk)
    vs_base, reading_vs_base, reading_vs_base_kld, ppl_base = against_base(setup, ours, theirs, keep)
    count, seq_len = setup.windows.shape
    return ServeReport(
        artifact=str(setup.artifact), kind=setup.kind, base=str(setup.base_dir), engine=engine_record(setup, theirs),
        windows={"count": int(count), "seq_len": int(seq_len), "positions": len(keep), "scored": int(keep.sum())},
        base_from=setup.base_from, logprobs=candidates_asked(setup), logprobs_normalized=setup.client.NORMALIZED,
        vs_base=vs_base,
        vs_reading=stats.against_full(ours.reading.logprobs, ours.reading.top1, theirs.topk, divergence_for(setup)),
        reading_vs_base=reading_vs_base, reading_vs_base_kld=reading_vs_base_kld,
        ppl=stats.perplexity(theirs.topk, ours.reading.targets), ppl_base=ppl_base,
        ppl_reading=math.exp(mean_of(ours.reading.nll, keep)),
        ppl_compared=stats.compared_perplexity(theirs.topk, ours.reading.targets, ours.reading.nll),
        greedy=stats.greedy_agreement(ours.greedy, theirs.greedy, setup.generation.steps), load=theirs.load,
        tolerances=tolerances, tokenization=tokenization, kv_cache=kv_record(setup, ours, theirs))


def kv_record(setup: Setup, ours: QuantkitSide, theirs: EngineSide) -> dict | None:
    """The report's kv_cache: the type, its flags, and the engine against quantkit's reading with a 16-bit cache."""
    if setup.kv is None:
        return None
    plain = ours.reading_16bit_cache
    return {"type": setup.kv.name, "serve_flags": list(setup.kv.flag),
            "vs_reading_16bit_cache": stats.against_full(plain.logprobs, plain.top1, theirs.topk,
                                                         divergence_for(setup)).as_dict()}
