"""The Scorer of each thing the gate measures, from how it is read: the full-precision base, and the
Readings quantkit builds of artifacts (each format says which: quantkit.formats).

A `Reading` is a model quantkit reads itself, tensor by tensor (a .gguf, an mlx-lm directory, a
full-precision text decoder, a compressed-tensors text decoder, quantkit.eval.compressed, or MoE decoder,
quantkit.eval.experts): with a resident Placement the whole model goes onto the device once and windows run
in batches (quantkit.eval.resident), otherwise it is streamed layer by layer (quantkit.eval.stream). Both
give the same numbers. What a format loads whole (bitsandbytes, a VLM, custom model code) is scored through
transformers (quantkit.formats.gate).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from quantkit.eval.evaluate import (
    LogitsFn,
    Scorer,
    model_logits_fn,
    model_scorer,
)
from quantkit.eval import stream
from quantkit.eval.stream import ACTIVATION_BYTES, Reading, group_scorer, stream_built, streamable
from quantkit.io.checkpoint import SafetensorsWeights

Progress = Callable[[str], None]


def ignore(_message: str) -> None:
    """A progress callback that says nothing."""


@dataclass(frozen=True)
class Placement:
    """Where a run's models go (chosen once per run by quantkit.run.preflight.gate_placement): the gate's
    forwards with the whole model resident on the device, windows batched within `activation_bytes`, or
    streamed a layer at a time (`why` says what the choice was weighed against, with the numbers); on a GPU
    run, `onload`: a method's model stays in RAM (or on disk with --offload-dir) and llm-compressor's
    sequential pipeline onloads one layer at a time to the GPU, because the model does not fit the GPU whole.
    What the run keeps of the base: `lockstep`, nothing (the base is scored again beside each artifact, both
    resident, tensors the artifact stores unchanged held once); else its log-probs, in memory or with `spill`
    in a file. `tables_on_disk`: a method's model is loaded with its embeddings and head on disk (they do
    not fit beside the rest). `room`: bytes a method's own forwards (imatrix, column importances) may hold
    resident beside what the run holds anyway; 0: they stream."""

    resident: bool
    device: str = "cpu"
    activation_bytes: int = ACTIVATION_BYTES
    why: str = ""
    onload: bool = False
    spill: bool = True  # the baseline's float16 log-probs go to a file above evaluate.SPILL_THRESHOLD (else: memory)
    lockstep: bool = False  # the base scored beside each artifact: no log-probs of it kept
    tables_on_disk: bool = True  # a method's model: embeddings and head on disk (quantkit.run.pipeline.offload_plan)
    room: int = 0  # bytes a method's own forwards may take resident (quantkit.eval.scorers.forward_model)


STREAMED = Placement(False)


def checkpoint_reading(model_dir: Path, dtype: str = "auto") -> Reading:
    """A full-precision checkpoint from its safetensors, in `dtype` ('auto': the stored dtype, as
    quantkit.engines.transformers.load_model and from_pretrained load it)."""
    from quantkit.engines.transformers import hf_config, torch_dtype
    from quantkit.io.checkpoint import check_model_dir

    info = check_model_dir(Path(model_dir))
    config = hf_config(model_dir)  # read by quantkit only without trust_remote_code
    return Reading(config, lambda: (stream.build_meta_model(config, torch_dtype(dtype, info)), SafetensorsWeights(model_dir)))


def gguf_reading(path: Path, base_dir: Path) -> Reading:
    """A .gguf in the base's architecture, dequantized a tensor at a time, computed in float32 (as
    artifacts.load_gguf_into_base does)."""
    import torch

    from quantkit.engines.transformers import hf_config
    from quantkit.gguf.convert import reading_config
    from quantkit.gguf.loader import GGUFTensors

    config = hf_config(base_dir)
    return Reading(config, lambda: (stream.build_meta_model(config, torch.float32),
                                    GGUFTensors(path, reading_config(base_dir, config.to_dict()))))


def mlx_reading(path: Path) -> Reading:
    """An mlx-lm directory in its transformers architecture (a mixture of experts with linear experts:
    quantkit.eval.experts.mlx_open), each quantized weight dequantized exactly as mlx.core.dequantize does,
    computed in the dtype its scales are stored in (as mlx-lm computes)."""
    import torch

    from quantkit.eval.experts import mlx_open
    from quantkit.mlx.checkpoint import MLXWeights

    weights = MLXWeights(path)
    config = weights.transformers_config()
    return Reading(config, lambda: mlx_open(weights, config, getattr(torch, weights.stored_dtype())))


def load_mlx(path: Path, device: str = "cpu"):
    """An mlx-lm directory dequantized (as mlx.core.dequantize does) into its transformers architecture
    (a mixture of experts with linear experts: quantkit.eval.experts.mlx_open), in the dtype its scales are
    stored in."""
    import torch

    from quantkit.engines.transformers import device_map
    from quantkit.errors import ModelError
    from quantkit.eval.artifacts import materialize_buffers
    from quantkit.eval.experts import mlx_open
    from quantkit.mlx.checkpoint import MLXWeights

    weights = MLXWeights(path)
    config = weights.transformers_config()
    model, source = mlx_open(weights, config, getattr(torch, weights.stored_dtype()))
    state = {name: source.get(name) for name in source.keys()}  # noqa: SIM118  (a WeightSource, not a dict)
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ModelError(f"{path.name} lacks tensors for {missing[:3]} (and {max(0, len(missing) - 3)} more)",
                         hint="the artifact is incomplete or for another model: write it again with quantkit quantize")
    return materialize_buffers(model, config).to(device_map(device)).eval()


def compressed_reading(path: Path) -> Reading:
    """A compressed-tensors text decoder, each quantized module decompressed by compressed-tensors'
    own compressor, in its stored dtype (quantkit.eval.compressed)."""
    from quantkit.engines.transformers import hf_config, torch_dtype
    from quantkit.eval.compressed import compressed_open
    from quantkit.io.checkpoint import check_model_dir

    config = hf_config(path)
    dtype = torch_dtype("auto", check_model_dir(path))
    return Reading(config, lambda: compressed_open(path, config, dtype))


def base_reading(info, dtype: str = "auto", trust_remote_code: bool = False) -> Reading | None:
    """The full-precision base read by quantkit (a text decoder; an MoE one with an expert layout row,
    quantkit.eval.experts), None when it loads whole (a VLM, remote code)."""
    from quantkit.eval import experts

    if streamable(info.config) and not trust_remote_code:
        return checkpoint_reading(info.path, dtype)
    if experts.reads_base(info.config) and not trust_remote_code:
        return experts.base_reading(info.path, dtype)
    return None


# ------------------------------------------------------------------ scorers


def streamed_reading(reading: Reading, device):
    """The Reading's model streamed a unit at a time on `device` (quantkit.eval.stream.StreamedModel)."""
    model, source = reading.open()
    return stream_built(model, reading.config, source, device)


def resident_reading(reading: Reading, device, lent: dict | None = None):
    """The Reading's model whole on `device` (quantkit.eval.resident.ResidentModel), sharing the tensors of
    `lent` it stores unchanged."""
    from quantkit.eval.resident import resident_built

    model, source = reading.open()
    return resident_built(model, reading.config, source, device, lent)


def reading_scorer(reading: Reading, device: str = "cpu", placement: Placement = STREAMED,
                   workdir: Path | None = None, progress: Progress = ignore, lends=None, borrows=None) -> Scorer:
    """The Scorer of a Reading: resident on the device when the placement says so (finishing streamed
    if it runs out of memory), else streamed layer by layer, its logits a block of positions at a time
    within the placement's room (nothing is written to `workdir`, kept for the callers). Resident,
    its model lends its tensors to `lends` or takes those `borrows` holds (quantkit.eval.resident.Shared)."""
    from quantkit.engines.transformers import device_map
    from quantkit.eval import resident

    target = device_map(device)
    text_config = reading.config.get_text_config()
    room = 0 if placement.resident else placement.room  # falling back out of memory, the logits go to a file
    streamed = group_scorer(lambda: streamed_reading(reading, target), text_config, ACTIVATION_BYTES, room)
    if not placement.resident:
        return streamed
    whole = resident.resident_scorer(lambda: resident_reading(reading, target, borrows.tensors if borrows else None),
                                     text_config, placement.activation_bytes, lends)
    return resident.falling_back(whole, streamed, progress)


class HeldReading:
    """A Reading scored several times on one resident model, built when first scored and kept until this object
    goes (reading_scorer builds its model afresh for every scoring, the artifact read and dequantized each time):
    for readings of one artifact that differ only in what `prepare` sets on the model before each scoring (the
    KV-cache types' attention). Where the placement streams it, each scoring streams as reading_scorer does."""

    def __init__(self, reading: Reading, device: str = "cpu", placement: Placement = STREAMED,
                 progress: Progress = ignore):
        self.reading, self.device, self.placement, self.progress = reading, device, placement, progress
        self.resident = None

    def model(self):
        if self.resident is None:
            self.resident = resident_reading(self.reading, self._target())
        return self.resident

    def _target(self):
        from quantkit.engines.transformers import device_map

        return device_map(self.device)

    def scorer(self, reading: Reading, prepare: Callable) -> Scorer:
        """The held model after `prepare(model)`; `reading` (the held one as this scoring reads it) where it is
        streamed, or finishes streamed out of memory."""
        from quantkit.eval import resident

        if not self.placement.resident:
            return reading_scorer(reading, self.device, self.placement)

        def make():
            held = self.model()
            prepare(held.model)
            return held

        text_config = reading.config.get_text_config()
        whole = resident.resident_scorer(make, text_config, self.placement.activation_bytes, drops=False)
        streamed = group_scorer(lambda: streamed_reading(reading, self._target()), text_config, ACTIVATION_BYTES)
        return resident.falling_back(whole, streamed, self.progress)


def checkpoint_scorer(model_dir: Path, dtype: str = "auto", device: str = "cpu",
                      activation_bytes: int = ACTIVATION_BYTES, workdir: Path | None = None) -> Scorer:
    """A full-precision checkpoint streamed from its safetensors, in `dtype`."""
    from quantkit.engines.transformers import device_map

    reading = checkpoint_reading(model_dir, dtype)
    return group_scorer(lambda: streamed_reading(reading, device_map(device)),
                        reading.config.get_text_config(), activation_bytes)


def base_baseline(info, windows, dtype: str = "auto", device: str = "cpu", trust_remote_code: bool = False,
                  workdir: Path | None = None, placement: Placement = STREAMED, progress: Progress = ignore):
    """The base's Baseline on `windows` as `placement` says: a lockstep one (nothing scored now; the base scored
    beside each artifact, lending it the tensors they share), or its log-probs kept, in memory or spilled."""
    from quantkit.eval import evaluate
    from quantkit.eval.resident import Shared

    if placement.lockstep:
        shared = Shared()
        scorer = base_scorer(info, dtype, device, trust_remote_code, workdir, placement, progress, shared)
        return evaluate.lockstep_baseline(scorer, windows, shared)
    scorer = base_scorer(info, dtype, device, trust_remote_code, workdir, placement, progress)
    return evaluate.compute_baseline(scorer, windows, workdir=workdir, spill=placement.spill)


def gguf_scorer(path: Path, base_dir: Path, device: str = "cpu", workdir: Path | None = None) -> Scorer:
    """A .gguf streamed in the base's architecture, in float32."""
    return reading_scorer(gguf_reading(path, base_dir), device, STREAMED, workdir)


def base_scorer(info, dtype: str = "auto", device: str = "cpu", trust_remote_code: bool = False,
                workdir: Path | None = None, placement: Placement = STREAMED, progress: Progress = ignore,
                shared=None) -> Scorer:
    """The full-precision base: read by quantkit where it can (a text decoder; resident or streamed as
    `placement` says, lending its resident tensors through `shared`), else loaded whole for the duration
    of the scoring (a VLM, remote code)."""
    reading = base_reading(info, dtype, trust_remote_code)
    if reading is not None:
        return reading_scorer(reading, device, placement, workdir, progress, lends=shared)

    def scorer(windows):
        from quantkit.engines.transformers import load_model

        yield from model_scorer(load_model(info, dtype, device, trust_remote_code))(windows)

    return scorer


# ------------------------------------------------------------------ logits functions (tasks, generation)


def reading_logits(reading: Reading, device: str = "cpu", placement: Placement = STREAMED,
                   workdir: Path | None = None) -> LogitsFn:
    """A Reading's forward as a logits function (b, L, vocab): the model resident on the device, or
    streamed with the head applied a vocabulary slice at a time."""
    from quantkit.engines.transformers import device_map
    from quantkit.eval import resident
    from quantkit.eval.stream import streamed_logits

    target = device_map(device)
    if placement.resident:
        whole = resident_reading(reading, target)
        return lambda ids: resident.resident_logits(whole, ids)
    streamed = streamed_reading(reading, target)
    return lambda ids: streamed_logits(streamed, ids, placement.room)


def base_logits(info, dtype: str = "auto", device: str = "cpu", trust_remote_code: bool = False,
                workdir: Path | None = None, placement: Placement = STREAMED) -> LogitsFn:
    """The full-precision base's forward as a logits function, built the way base_scorer reads it."""
    from quantkit.engines.transformers import load_model

    reading = base_reading(info, dtype, trust_remote_code)
    if reading is None:
        return model_logits_fn(load_model(info, dtype, device, trust_remote_code))
    return reading_logits(reading, device, placement, workdir)


# ------------------------------------------------------------------ the KV cache's own damage


def kv_cache_scheme(artifact: Path) -> dict | None:
    """The compressed-tensors kv_cache_scheme of an artifact's config.json, None without one."""
    import json

    config_file = Path(artifact) / "config.json"
    if not config_file.is_file():
        return None
    return (json.loads(config_file.read_text()).get("quantization_config") or {}).get("kv_cache_scheme")


def kv_attention_modules(model) -> list:
    """The attention modules whose keys and values compressed-tensors quantizes (they hold k_scale)."""
    return [module for module in model.modules() if hasattr(module, "k_scale") and hasattr(module, "v_scale")]
