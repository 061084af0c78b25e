"""The gate's forward with the whole model resident on its device, windows batched.

The model is built on the meta device exactly as the streamed forward builds it
(quantkit.eval.stream.build_meta_model, or compressed-tensors' quantized_meta_model for an artifact)
and every parameter is read once from the same WeightSource (a safetensors checkpoint, a .gguf
dequantized, a compressed-tensors checkpoint decompressed a module at a time, an mlx-lm directory),
cast to the parameter's dtype as accelerate's hooks cast it, and placed on the device. The model's
own forward then runs with no hooks: the same modules in the same dtype as the streamed path, so
the numbers are the streamed path's; only the time differs (no weight is read twice, no logits are
spilled to a file). The output head is applied a block of positions at a time (with what the model's forward
does to the logits: quantkit.eval.evaluate.Finish) and its log-softmax a smaller chunk at a time
(quantkit.eval.evaluate.score_hidden), so one block of logits and a chunk of float32 log-probs are the
most ever held beside the model, whatever the vocabulary; scoring (log-softmax, KL, top-1) runs on the device.

Scored in lockstep (quantkit.eval.evaluate.lockstep_baseline: the base beside an artifact, neither's
log-probs kept), the base's resident tensors are lent to the artifact's model (`Shared`): a tensor the
artifact stores with the same values (the embeddings and head a method keeps 16-bit) is held once.

Where the model does not fit, the gate streams it (quantkit.eval.stream). A resident forward that
runs out of memory anyway (the estimate was wrong) does not fail the run: `falling_back` finishes the
windows on the streamed path and says so.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from quantkit.arch.modules import decoder
from quantkit.engines.transformers import tied_groups
from quantkit.eval.evaluate import (
    Buffers,
    Finish,
    ScoredChunk,
    Scorer,
    finish_of,
    head_logits,
    inference_generator,
    iter_batches,
    score_hidden,
)
from quantkit.eval.stream import (
    StreamedModel,
    WeightsMap,
    WeightSource,
    build_meta_model,
    last_hidden,
    score_group,
    source_names,
    streamed_logits,
    windows_per_group,
)
from quantkit.io.memory import release_freed_memory


@dataclass
class Shared:
    """The base's resident parameters by name while its model is alive, lent to an artifact's model built
    beside it (lockstep): a tensor the artifact stores with the same shape, dtype and values is not held twice."""

    tensors: dict = field(default_factory=dict)


TABLES_HELD_BYTES = 256 * 1024 * 1024  # float32 vocabulary tables above this stay in the source (tables_in_source)
# float32 logits of a block of positions computed from a head left in its source: each block reads the head's rows
# once (a 262144 x 640 Q6_K table: about 1 s on this project's CPU machine), and holds 1 MiB per position of such a
# vocabulary, so 128 positions a read
TABLE_LOGITS_BYTES = 128 * 1024 * 1024


@dataclass
class ResidentModel:
    model: object  # transformers CausalLM, every parameter on `device` (but the tables, where `tables` is set)
    device: object
    finish: Finish  # what the model's forward does to the head's logits
    tables: WeightsMap | None = None  # the embedding's and the head's source, where they stay there (decoder_resident)

    @property
    def head(self):
        return self.model.get_output_embeddings()

    def view(self) -> StreamedModel:
        """The model as quantkit.eval.stream reads a head from its source (logits_blocks, score_group)."""
        return StreamedModel(self.model, self.tables, self.device, self.finish)


def materialize(model, source: WeightSource, device, lent: dict | None = None, skip: frozenset = frozenset()) -> None:
    """Every parameter of the meta-device `model` read from `source` once (a tied group shares one
    tensor), cast to the parameter's dtype and placed on `device`; buffers moved there too. Where `lent`
    (parameter name -> tensor) holds the same values under one of the group's names, that tensor is used
    instead (lent_match), the stored one never read whole. A group holding a name of `skip` stays on meta."""
    from accelerate.utils import set_module_tensor_to_device

    weights = WeightsMap(source, source_names(model, source))
    params = dict(model.named_parameters(remove_duplicate=False))
    for group in tied_groups(model):
        if skip.intersection(group):
            continue
        dtype = params[group[0]].dtype
        value = lent_match(weights, group[0], [lent.get(name) for name in group], dtype, device) if lent else None
        if value is None:
            value = weights[group[0]].to(device, non_blocking=True).to(dtype)
        for name in group:
            set_module_tensor_to_device(model, name, device, value=value)
    for name, _ in model.named_buffers():
        set_module_tensor_to_device(model, name, device)
    release_freed_memory()  # what reading and decompressing left in the heap


COMPARE_BYTES = 16 * 1024 * 1024  # a lent tensor is compared with the stored one this many bytes of rows at a time


def lent_match(weights: WeightsMap, name: str, candidates: list, dtype, device):
    """The first candidate with the stored tensor's shape, `dtype`, `device` and values, compared a slice of
    rows at a time (so the stored tensor is never held whole beside it); None where none is, and for a
    tensor the source does not give as stored (a quantized module's weight, decompressed: quantkit.eval.
    compressed.CompressedWeights.reads)."""
    import numpy as np
    import torch

    shape = tuple(weights.source.shape(weights.names[name]))
    reads = getattr(weights.source, "reads", None)  # a source that says what it reads (compressed-tensors)
    if reads is None or reads(weights.names[name]) != [weights.names[name]]:
        return None  # decompressed or dequantized (or not said): never the base's values as stored
    for other in candidates:
        if other is None or tuple(other.shape) != shape or other.dtype != dtype or other.device != torch.device(device):
            continue
        rows = max(1, COMPARE_BYTES // max(1, other[:1].numel() * other.element_size()))
        if all(torch.equal(weights.rows(name, np.arange(start, min(shape[0], start + rows))).to(device, dtype),
                           other[start : start + rows]) for start in range(0, shape[0], rows)):
            return other.data
    return None


def resident_built(model, config, source: WeightSource, device, lent: dict | None = None) -> ResidentModel:
    """A model built on the meta device (build_meta_model, perhaps with more done to it) with all its
    weights read from `source` onto `device` (those equal to a tensor of `lent` shared with it); a float32
    one's large vocabulary tables left in `source` (tables_in_source)."""
    if tables_in_source(model):
        return decoder_resident(model, config, source, device)
    materialize(model, source, device, lent)
    return ResidentModel(model.eval(), device, finish_of(config.get_text_config()))


def resident_model(config, source: WeightSource, dtype, device="cpu") -> ResidentModel:
    """The CausalLM of `config` in `dtype`, its weights from `source`, whole on `device`."""
    return resident_built(build_meta_model(config, dtype), config, source, device)


def table_names(model) -> frozenset:
    """Names of the token embedding's weight and the output head's (a tied one's both) where the embedding is a
    torch Embedding: what a method's own forward (forward_model) leaves on meta."""
    import torch

    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    if not isinstance(embedding, torch.nn.Embedding):
        return frozenset()
    tables = {id(embedding.weight)} | ({id(head.weight)} if head is not None else set())
    return frozenset(name for name, param in model.named_parameters(remove_duplicate=False) if id(param) in tables)


def tables_in_source(model) -> bool:
    """Whether a reading's vocabulary tables stay in its source while its decoder is resident: a float32 reading
    (a .gguf, dequantized as llama.cpp computes) whose tables exceed TABLES_HELD_BYTES. A 262144 x 640 embedding
    is 640 MiB in float32, more than the decoder of a 270M model, and its rows are few per batch: the embedding
    gathers them, the head is applied a slice of its rows at a time (quantkit.eval.stream.logits_blocks)."""
    import torch

    tables = table_names(model)
    return (bool(tables) and next(iter(model.parameters())).dtype == torch.float32
            and weight_bytes(model) - weight_bytes(model, tables) > TABLES_HELD_BYTES)


def decoder_resident(model, config, source: WeightSource, device) -> ResidentModel:
    """A model built on the meta device with every weight read from `source` onto `device` but the token
    embedding's and the output head's (table_names): the embedding gathers the rows of each call's ids from
    `source` (quantkit.eval.stream.gather_hook, as the streamed forward does) and the head stays on meta, so
    a large vocabulary's table is never held whole (262144 x 640 in float32: 640 MiB). For forwards that run the
    decoder only (last_hidden: an imatrix, column importances), and for scoring, the head's rows read from `tables`
    a slice at a time (score_batch, resident_logits)."""
    from accelerate.hooks import add_hook_to_module

    from quantkit.eval.stream import gather_hook

    tables = table_names(model)
    materialize(model, source, device, skip=tables)
    weights = WeightsMap(source, source_names(model, source))
    if tables:
        name = next(n for n, m in model.named_modules() if m is model.get_input_embeddings())
        add_hook_to_module(model.get_input_embeddings(), gather_hook(weights, f"{name}.weight", device, decoder(model)))
    return ResidentModel(model.eval(), device, finish_of(config.get_text_config()), weights)


def weight_bytes(model, skip: frozenset = frozenset()) -> int:
    """Bytes of the parameters of the meta-device `model` in their dtypes (a tied group once), those of
    `skip` left out."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return sum(params[group[0]].numel() * params[group[0]].element_size()
               for group in tied_groups(model) if not skip.intersection(group))


def forward_model(config, source: WeightSource, dtype, device, room: int, model=None):
    """The CausalLM of `config` for a method's own forwards of the decoder (imatrix, column importances): its
    decoder whole on `device` (decoder_resident: the embedding's rows gathered, the head on meta) when those
    weights in `dtype` and a batch's activations fit `room` (the run's placement: quantkit.eval.scorers.
    Placement.room), else streamed a layer at a time (quantkit.eval.stream.stream_built). Either has `.model`,
    `.device` and `.head`. `model`: one built on the meta device already (build_meta_model, perhaps changed)."""
    from quantkit.eval.stream import ACTIVATION_BYTES, build_meta_model, stream_built

    model = model if model is not None else build_meta_model(config, dtype)
    if room and weight_bytes(model, table_names(model)) + ACTIVATION_BYTES <= room:
        return decoder_resident(model, config, source, device)
    return stream_built(model, config, source, device)


def score_batch(resident: ResidentModel, ids, buffers: Buffers | None = None) -> Iterator[ScoredChunk]:
    """Log-probs of predictions 0..L-2 of each window of `ids`, a chunk of positions at a time, on the device
    (evaluate.score_hidden)."""
    if resident.tables is not None:
        return score_group(resident.view(), ids, TABLE_LOGITS_BYTES)
    targets = ids[:, 1:].reshape(-1).to(resident.device)
    hidden = last_hidden(resident, ids)
    release_freed_memory()  # the decoder's freed activations go back before the head's logits are taken
    return score_hidden(hidden, targets, resident.head, resident.finish, buffers)


COLLECTED_BYTES = 64 * 1024 * 1024  # a dropped model this large is collected at once (a collection: about 0.25 s)


def resident_scorer(make: Callable[[], ResidentModel], text_config, activation_bytes: int,
                    lends: Shared | None = None, drops: bool = True) -> Scorer:
    """A Scorer over the resident model `make` builds when scoring starts (and drops when it ends, its memory
    collected and handed back then where it is COLLECTED_BYTES or more: a transformers model's reference cycles
    would hold it until the collector next runs, into the next step; `drops` False: `make` hands out a model
    held elsewhere, kept): windows go through it in batches sized for `text_config`'s activations within
    activation_bytes. With `lends`, its parameters are lent (Shared) while it scores."""

    @inference_generator
    def scorer(windows) -> Iterator[ScoredChunk]:
        resident = make()
        if lends is not None:
            lends.tensors = dict(resident.model.named_parameters(remove_duplicate=False))
        batch = windows_per_group(text_config, windows.shape[1], activation_bytes)
        buffers = Buffers()
        try:
            for ids in iter_batches(windows, batch):
                yield from score_batch(resident, ids, buffers)
                release_freed_memory()  # the batch's freed activations go back: the peak does not creep
        finally:
            if lends is not None:
                lends.tensors = {}
            worth = drops and weight_bytes(resident.model) >= COLLECTED_BYTES
            del buffers, resident
            if worth:
                free_device_memory()
                release_freed_memory()

    return scorer


def resident_logits(resident: ResidentModel, ids) -> "torch.Tensor":  # noqa: F821
    """float32 logits (b, L, vocab) of every position of `ids` (evaluate.LogitsFn: lm-eval's tasks and
    greedy generations read it), on the CPU."""
    import torch

    if resident.tables is not None:
        return streamed_logits(resident.view(), ids, TABLE_LOGITS_BYTES)
    with torch.inference_mode():
        hidden = decoder(resident.model)(input_ids=ids.to(resident.device), use_cache=False).last_hidden_state
        return head_logits(resident.head, resident.finish, hidden).float().cpu()


# ------------------------------------------------------------------ out of memory: finish streamed


def out_of_memory(exc: BaseException) -> bool:
    """A failed allocation on a GPU (torch.OutOfMemoryError) or in RAM (torch's CPU allocator, MemoryError)."""
    import torch

    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(exc, RuntimeError) and ("out of memory" in str(exc) or "can't allocate memory" in str(exc))


def free_device_memory() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def falling_back(resident: Scorer, streamed: Scorer, notify: Callable[[str], None]) -> Scorer:
    """`resident`, unless it runs out of memory: then `streamed` scores the positions not yet given
    (from the window the failure was in), and `notify` says so. The chunks come in position order
    either way, so the consumer never sees the switch."""

    def scorer(windows) -> Iterator[ScoredChunk]:
        done = 0
        try:
            for chunk in resident(windows):
                done += chunk.logprobs.shape[0]
                yield chunk
            return
        except Exception as exc:  # noqa: BLE001 - only an allocation failure is handled; anything else re-raised
            if not out_of_memory(exc):
                raise
            said = (str(exc).splitlines() or [type(exc).__name__])[0][:120]  # a MemoryError often says nothing
            notify(f"gate: the resident model ran out of memory ({said}); streaming the rest a layer at a time")
        free_device_memory()
        per_window = windows.shape[1] - 1
        first, skip = divmod(done, per_window)
        for chunk in streamed(windows[first:]):
            if skip >= chunk.logprobs.shape[0]:
                skip -= chunk.logprobs.shape[0]
                continue
            yield ScoredChunk(chunk.logprobs[skip:], chunk.targets[skip:]) if skip else chunk
            skip = 0

    return scorer
