"""How the gate reads any artifact back from disk: its format (quantkit.formats.detect) says how, and the
same reading serves every measurement (the gate's metrics, lm-eval's tasks, greedy generations, serve-check's
comparison): read by quantkit tensor by tensor (the format's `reading`), resident or streamed as the run's
Placement says, or loaded whole through the format's `load` for the duration of the scoring.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from quantkit.eval.evaluate import Baseline, Gather, Keeper, LogitsFn, Metrics, ScoredChunk, Scorer, compare, model_logits_fn, model_scorer
from quantkit.eval.scorers import STREAMED, HeldReading, Placement, Progress, ignore, reading_logits, reading_scorer
from quantkit.eval.stream import Reading
from quantkit.formats import detect


def artifact_reading(path: Path, base_dir: Path | None = None, trust_remote_code: bool = False) -> Reading | None:
    """How quantkit reads the artifact itself (its format's `reading`); None for what loads whole."""
    return detect(Path(path)).reading(Path(path), base_dir, trust_remote_code)


def load_artifact(path: Path, base_dir: Path | None = None, device: str = "cpu", trust_remote_code: bool = False):
    """The artifact loaded whole (its format's `load`): a model whose forward gives logits. Custom model
    code (an `auto_map` in config.json) runs only with trust_remote_code, as for the base."""
    return detect(Path(path)).load(Path(path), base_dir, device, trust_remote_code)


def loaded_scorer(path: Path, base_dir: Path | None, device: str = "cpu", trust_remote_code: bool = False) -> Scorer:
    """The artifact loaded whole when scoring starts and dropped when it ends (evaluate.model_scorer)."""

    def scorer(windows) -> Iterator[ScoredChunk]:
        yield from model_scorer(load_artifact(path, base_dir, device, trust_remote_code))(windows)

    return scorer


def artifact_scorer(path: Path, base_dir: Path | None = None, device: str = "cpu", trust_remote_code: bool = False,
                    workdir: Path | None = None, placement: Placement = STREAMED,
                    progress: Progress = ignore, shared=None) -> Scorer:
    """A Scorer for any artifact quantkit evaluates: read by quantkit (artifact_reading), resident or
    streamed as `placement` says (resident beside the base, with the tensors the base's model lends in
    `shared`), or loaded whole through its format's `load`."""
    reading = artifact_reading(path, base_dir, trust_remote_code)
    if reading is None:
        return loaded_scorer(path, base_dir, device, trust_remote_code)
    return reading_scorer(reading, device, placement, workdir, progress, borrows=shared)


def evaluate_artifact(artifact: Path, base_dir: Path, windows, baseline: Baseline, device: str = "cpu",
                      trust_remote_code: bool = False, workdir: Path | None = None,
                      placement: Placement = STREAMED, progress: Progress = ignore,
                      gather: Gather | None = None, keep: Keeper | None = None,
                      held: HeldReading | None = None) -> Metrics:
    """Read an artifact back from disk the way a user would and measure it against the baseline: the
    one measuring step shared by the pipeline's gate and `quantkit eval` (artifact_scorer; beside the base
    for a lockstep baseline). Under torchrun `windows` and `baseline` are this rank's share and `gather`
    collects the positions (evaluate.compare); `keep` keeps the artifact's own reading as it is measured, and
    `held` (held_artifact) its resident model, for what reads it again (the KV-cache types)."""
    if held is not None:
        scorer = held.scorer(held.reading, lambda _model: None)
    else:
        scorer = artifact_scorer(artifact, base_dir, device, trust_remote_code, workdir, placement, progress,
                                 baseline.shared)
    return compare(scorer, windows, baseline, gather, keep)


def holds_artifact(gate) -> bool:
    """Whether the gate's resident model can wait for the KV-cache types (held_artifact) as far as the gate goes:
    no flips or tasks read the artifact in between with a model of their own (a caller adds what else it runs
    in between)."""
    return not gate.flip_prompts and not gate.tasks


def held_artifact(artifact: Path, base_dir: Path | None, device: str, placement: Placement,
                  trust_remote_code: bool = False, progress: Progress = ignore) -> HeldReading | None:
    """The artifact's reading to be held resident from the gate's measurement to the KV-cache types' (scorers.
    HeldReading: read and dequantized once), where the placement holds it resident on its own (not in lockstep
    beside the base, whose tensors it would borrow) and quantkit reads it; else None."""
    if not placement.resident or placement.lockstep:
        return None
    reading = artifact_reading(artifact, base_dir, trust_remote_code)
    return HeldReading(reading, device, placement, progress) if reading is not None else None


def artifact_logits(path: Path, base_dir: Path | None = None, device: str = "cpu", trust_remote_code: bool = False,
                    workdir: Path | None = None, placement: Placement = STREAMED) -> LogitsFn:
    """The artifact's forward as a logits function, built the way artifact_scorer reads it (the same
    model): for lm-eval's tasks and greedy generations (quantkit.eval.tasks, quantkit.eval.generate)."""
    reading = artifact_reading(path, base_dir, trust_remote_code)
    if reading is None:
        return model_logits_fn(load_artifact(path, base_dir, device, trust_remote_code))
    return reading_logits(reading, device, placement, workdir)


def kv_only_metrics(artifact: Path, windows, device: str = "cpu", trust_remote_code: bool = False) -> Metrics:
    """The KV-cache quantization's own damage: the artifact loaded whole, measured against itself with the KV
    quantization switched off (the same weights and activations). The keys and values are fake-quantized by
    compressed-tensors' own forward (QuantizedKVCache with the stored k_scale / v_scale), as vLLM's fp8 KV
    cache stores them (quantkit.eval.scorers.kv_attention_modules)."""
    from quantkit.errors import InternalError
    from quantkit.eval.evaluate import compute_baseline
    from quantkit.eval.scorers import kv_attention_modules

    model = load_artifact(artifact, None, device, trust_remote_code)
    attention = kv_attention_modules(model)
    if not attention:
        raise InternalError(f"{artifact}: a kv_cache_scheme but no attention module with k_scale/v_scale")
    for module in attention:
        module.quantization_enabled = False
    without = compute_baseline(model_scorer(model), windows)
    for module in attention:
        module.quantization_enabled = True
    return compare(model_scorer(model), windows, without)


@contextmanager
def kv_readers(artifact: Path, base_dir: Path, kind, device: str = "cpu",
               trust_remote_code: bool = False) -> Iterator[tuple[Scorer, LogitsFn]]:
    """(scorer, logits function) of the artifact with every attention layer reading its keys and values through
    the KV type `kind` (quantkit.eval.kv.KvType) at every position, as an engine started with that cache computes
    a prompt: what serve-check compares the engine's log-probs with under --kv-cache."""
    from quantkit.eval.kv.attention import registered
    from quantkit.eval.kv.measure import implementation_of, kv_reading, restore, set_attention

    reading, model = opened_for_kv(artifact, base_dir, device, trust_remote_code)
    config = reading.config if reading is not None else model.config
    implementation = implementation_of(config)
    with registered(kind, implementation) as name:
        try:
            if reading is not None:
                served = kv_reading(reading, name)
                yield reading_scorer(served, device), reading_logits(served, device)
            else:
                set_attention(model, name)
                yield model_scorer(model), model_logits_fn(model)
        finally:
            restore(model, config, implementation)


def opened_for_kv(artifact: Path, base_dir: Path, device: str, trust_remote_code: bool = False):
    """(reading, None) of an artifact the gate reads itself, else (None, the transformers model it loads as): what
    the KV-cache measurement runs its types on (quantkit.eval.kv.measure.measure_types)."""
    reading = artifact_reading(artifact, base_dir, trust_remote_code)
    model = None if reading is not None else load_artifact(artifact, base_dir, device, trust_remote_code)
    return reading, model
