"""Layer-streamed forwards: evaluate a model whose weights are never all in memory at once.

The transformers model is built on the meta device (parameters only; buffers such as rotary
frequencies and Gemma's embedding scale are computed as usual). Every streamed unit (each module
of the decoder with parameters of its own: each projection, each norm) carries accelerate's AlignDevicesHook with
`offload=True` and a lazy `weights_map`: just before the unit runs, its weights are read from a
WeightSource (a safetensors checkpoint or a .gguf, one tensor at a time; a compressed-tensors
checkpoint one module's weight at a time, quantkit.eval.compressed), cast to the compute dtype and
placed on the execution device; right after, they go back to meta and are freed. The
model's own forward runs unchanged (masks, rotary, sliding windows, Gemma's scaling and attention
softcaps) for every architecture transformers has.

The token embedding is not loaded whole: its hook reads only the rows of the ids in the batch.
The windows go through in groups (all at once when the activations fit ACTIVATION_BYTES), so each
layer is read once per group, not once per window. The base model stops at the last hidden states;
the output head is applied a slice of its vocabulary rows at a time (with the config's logits_scaling
and final_logit_softcapping, as the model's forward applies them: evaluate.Finish), the group's float32
logits kept in memory where the run's placement has room for them, else written to a file in the run's
work directory, and read back a chunk of positions at a time: each chunk's log-probs are handed to the evaluator as a
ScoredChunk and dropped. Peak memory with the logits in a file: one weight matrix + one group's
activations + one slice of the head, whatever the model's size or its vocabulary.

Numerics equal the in-memory path's: the same modules run in the same dtype (the stored dtype
for a checkpoint, as `quantkit.engines.transformers.load_model` loads it; float32 for a .gguf, as
`quantkit.eval.artifacts.load_gguf_into_base` builds it), and logits are cast to float32 only after
the head (and its Finish), as `evaluate.model_logits_fn` does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Protocol

from quantkit.arch.modules import decoder
from quantkit.engines.transformers import tied_groups
from quantkit.errors import ModelError
from quantkit.eval.evaluate import (Finish, ScoredChunk, Scorer, chunk_rows, finish_of, inference_generator,
                                    iter_batches)
from quantkit.io.memory import release_freed_memory

ACTIVATION_BYTES = 512 * 1024 * 1024  # working set of one group of windows inside one decoder layer


HEAD_SLICE_BYTES = 64 * 1024 * 1024  # one slice of the output head's rows, and of the logits for it
BLOCK_BYTES = 32 * 1024 * 1024  # float32 logits of a block of positions at least: the head's rows are read once
# per block (logits_blocks)


class WeightSource(Protocol):
    """Weights by Hugging Face tensor name, each produced on demand (nothing is kept)."""

    def keys(self) -> Iterable[str]: ...

    def get(self, name: str) -> "torch.Tensor": ...  # noqa: F821

    def shape(self, name: str) -> tuple[int, ...]: ...  # the tensor's Hugging Face shape, without reading it

    def rows(self, name: str, index) -> "torch.Tensor": ...  # noqa: F821  rows `index` (sorted, unique) of dim 0


@dataclass(frozen=True)
class Reading:
    """A model quantkit reads itself, tensor by tensor: `open()` builds it on the meta device and gives
    the source of its weights (checking the artifact as it does)."""

    config: object  # transformers config
    open: Callable[[], tuple[object, WeightSource]]


class WeightsMap(Mapping):
    """A WeightSource as the lazy Mapping accelerate's hooks read, by the model's parameter names.

    A tied parameter (lm_head.weight = model.embed_tokens.weight) is read under whichever of its
    names the source has."""

    def __init__(self, source: WeightSource, names: dict[str, str]):
        self.source = source
        self.names = names  # model parameter name -> source name

    def __getitem__(self, name: str):
        return self.source.get(self.names[name])

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def rows(self, name: str, index):
        return self.source.rows(self.names[name], index)


class PrefetchingSource:
    """A WeightSource that reads decoder layer i+1's tensors in a background thread as soon as a tensor of
    layer i is asked for, so the device computes layer i while the disk (or a .gguf's dequantization)
    produces the next: the first layer of each pass is read when it is asked for. Memory holds one layer
    more; each tensor is still read once per pass. `pin`: the tensors read ahead go to page-locked memory,
    from which a GPU copies fastest."""

    def __init__(self, source: WeightSource, layer_of: dict[str, int], pin: bool = False):
        from concurrent.futures import ThreadPoolExecutor

        self.source, self.layer_of, self.pin = source, layer_of, pin
        self.by_layer: dict[int, list[str]] = {}
        for name, layer in layer_of.items():
            self.by_layer.setdefault(layer, []).append(name)
        self.pending: dict[int, object] = {}  # layer -> Future of {name: tensor}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="quantkit-prefetch")

    def keys(self):
        return self.source.keys()

    def shape(self, name: str):
        return self.source.shape(name)

    def rows(self, name: str, index):
        return self.source.rows(name, index)

    def read_layer(self, layer: int) -> dict:
        tensors = {name: self.source.get(name) for name in self.by_layer[layer]}
        return {name: t.pin_memory() for name, t in tensors.items()} if self.pin else tensors

    def get(self, name: str):
        layer = self.layer_of.get(name)
        if layer is None:
            return self.source.get(name)
        if layer + 1 in self.by_layer and layer + 1 not in self.pending:
            self.pending[layer + 1] = self.pool.submit(self.read_layer, layer + 1)
        ready = self.pending[layer].result() if layer in self.pending else {}
        if name not in ready:
            return self.source.get(name)
        tensor = ready.pop(name)
        if not ready:
            del self.pending[layer]
        return tensor

    def close(self) -> None:
        self.pool.shutdown(wait=True, cancel_futures=True)
        self.pending.clear()


def layer_numbers(names: dict[str, str]) -> dict[str, int]:
    """Source tensor name -> the index of the decoder layer its parameter belongs to (others left out)."""
    from quantkit.io.checkpoint import LAYER_PREFIX

    found = {}
    for param, source_name in names.items():
        match = LAYER_PREFIX.match(param)
        if match:
            found[source_name] = int(match.group(1).rsplit(".", 1)[1])
    return found


def source_names(model, source: WeightSource) -> dict[str, str]:
    """Every parameter of the model -> the source tensor holding it; ModelError for any missing."""
    available = set(source.keys())
    names, missing = {}, []
    for group in tied_groups(model):
        found = [n for n in group if n in available]
        if not found:
            missing += group
        names.update({n: found[0] for n in group} if found else {})
    if missing:
        raise ModelError(f"the weights lack tensors that config.json calls for: {sorted(missing)[:3]} "
                         f"(and {max(0, len(missing) - 3)} more)",
                         hint="config.json and the weights do not belong together, or a file is missing")
    check_shapes(model, source, names)
    return names


def check_shapes(model, source: WeightSource, names: dict[str, str]) -> None:
    """ModelError when a stored tensor's shape is not the one the config gives its parameter."""
    params = dict(model.named_parameters(remove_duplicate=False))
    wrong = [f"{source_name} (stored {list(source.shape(source_name))}, config.json {list(params[name].shape)})"
             for name, source_name in names.items() if tuple(source.shape(source_name)) != tuple(params[name].shape)]
    if wrong:
        more = f" and {len(wrong) - 3} more" if len(wrong) > 3 else ""
        raise ModelError(f"{len(wrong)} shapes disagree with config.json: {', '.join(sorted(wrong)[:3])}{more}",
                         hint="config.json and the weights do not belong together, or a file is damaged")


def windows_per_group(config, seq_len: int, budget: int = ACTIVATION_BYTES) -> int:
    """Windows run through a layer together so one layer's float32 working set stays near budget:
    per token a few hidden-size vectors, the MLP's intermediate activations (gate, up, product)
    and one row of attention scores per head."""
    heads = config.num_attention_heads
    per_token = 8 * config.hidden_size + 3 * config.intermediate_size + 2 * heads * seq_len
    return max(1, budget // (4 * per_token * seq_len))


def build_meta_model(config, dtype):
    """The CausalLM of this config, parameters on the meta device, buffers real."""
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()  # not done under init_empty_weights; tied_groups relies on it
    return model.eval()


def streamed_units(decoder) -> Iterator[tuple[str, object]]:
    """(name, module) of each unit loaded at a time: every module of the decoder holding
    parameters of its own (each linear projection, each norm, the embedding, a fused experts
    block), so at most one weight matrix is materialized at any moment, not a whole layer."""
    for name, module in decoder.named_modules():
        if any(True for _ in module.parameters(recurse=False)):
            yield name, module


def offload_hook(weights: WeightsMap, prefix: str, device):
    """accelerate's offloading hook over the unit's slice of the weights, trimming the heap after."""
    from accelerate.hooks import AlignDevicesHook
    from accelerate.utils import PrefixedDataset

    class StreamingHook(AlignDevicesHook):
        def post_forward(self, module, output):
            output = super().post_forward(module, output)
            release_freed_memory()
            return output

    return StreamingHook(execution_device=device, offload=True, weights_map=PrefixedDataset(weights, prefix),
                         place_submodules=False)


def module_prefixes(model) -> dict[int, str]:
    return {id(module): f"{name}." if name else "" for name, module in model.named_modules()}


def gather_hook(weights: WeightsMap, name: str, device, body=None):
    """A hook that gives the token embedding only the rows of the ids it is called with.

    Before the call the embedding's weight becomes those rows (read from the source) and the ids
    are renumbered into them; after it the weight goes back to meta. A 128k-row vocabulary then
    costs a batch's distinct ids, not the whole matrix. The module's own forward still runs (Gemma's
    scaled embedding included); padding_idx, which only matters for gradients, is lifted for the
    call since the compact weight may have fewer rows than it. With `body` (the decoder holding the
    embedding), the ids the decoder is called with are kept for the embedding's call: transformers'
    Llama 4 moves them to the embedding weight's device (meta between calls) before it."""
    import torch
    from accelerate.hooks import ModelHook

    class GatherRowsHook(ModelHook):
        ids = None  # the decoder's input_ids of the current call (with `body`)

        def pre_forward(self, module, ids, *args, **kwargs):
            if ids.device.type == "meta" and self.ids is not None:
                ids = self.ids
            unique, compact = torch.unique(ids, sorted=True, return_inverse=True)
            rows = weights.rows(name, unique.cpu().numpy()).to(device, module.weight.dtype)
            self.meta_weight, self.padding_idx = module.weight, module.padding_idx
            module.weight, module.padding_idx = torch.nn.Parameter(rows, requires_grad=False), None
            return (compact.to(device), *args), kwargs

        def post_forward(self, module, output):
            module.weight, module.padding_idx = self.meta_weight, self.padding_idx
            release_freed_memory()
            return output

    hook = GatherRowsHook()
    if body is not None:
        def keep(_module, args, kwargs):
            hook.ids = kwargs.get("input_ids", args[0] if args else None)

        body.register_forward_pre_hook(keep, with_kwargs=True)
    return hook


def unit_hook(model, unit, weights: WeightsMap, prefix: str, device):
    """The token embedding gathers the rows it needs; every other unit loads whole while it runs."""
    import torch

    if unit is model.get_input_embeddings() and isinstance(unit, torch.nn.Embedding):
        return gather_hook(weights, f"{prefix}weight", device, decoder(model))
    return offload_hook(weights, prefix, device)


def attach_streaming(model, weights: WeightsMap, device) -> None:
    """Hook every streamed unit of the decoder so its weights live only while it runs."""
    from accelerate.hooks import add_hook_to_module
    from accelerate.utils import set_module_tensor_to_device

    prefixes = module_prefixes(model)
    for _, unit in streamed_units(decoder(model)):
        add_hook_to_module(unit, unit_hook(model, unit, weights, prefixes[id(unit)], device))
    for name, _ in model.named_buffers():
        set_module_tensor_to_device(model, name, device)


@dataclass
class StreamedModel:
    model: object  # transformers CausalLM on the meta device, streamed units hooked
    weights: WeightsMap
    device: object
    finish: Finish  # what the model's forward does to the head's logits (Granite's divisor, Gemma's softcap)

    @property
    def head(self):
        return self.model.get_output_embeddings()

    def close(self) -> None:
        """Stop reading ahead (a PrefetchingSource's thread); the model is not streamed further."""
        if isinstance(self.weights.source, PrefetchingSource):
            self.weights.source.close()


def stream_model(config, source: WeightSource, dtype, device="cpu") -> StreamedModel:
    """A meta-device model of `config` whose weights come from `source` unit by unit."""
    return stream_built(build_meta_model(config, dtype), config, source, device)


def prefetches(device) -> bool:
    """Whether a streamed forward reads the next layer ahead: on a GPU, where it would otherwise wait on
    every read. On a CPU the reads are a small part of the time and the layer read ahead would count in
    the RAM the streamed path keeps low."""
    import torch

    return torch.device(device).type == "cuda"


def stream_built(model, config, source: WeightSource, device="cpu", prefetch: bool | None = None) -> StreamedModel:
    """A model already built on the meta device (build_meta_model, perhaps with more done to it)
    streamed from `source` unit by unit, the next decoder layer read ahead where `prefetch` (default:
    prefetches(device))."""
    names = source_names(model, source)
    if prefetches(device) if prefetch is None else prefetch:
        source = PrefetchingSource(source, layer_numbers(names), pin=prefetches(device))
    weights = WeightsMap(source, names)
    attach_streaming(model, weights, device)
    return StreamedModel(model, weights, device, finish_of(config.get_text_config()))


def last_hidden(streamed: StreamedModel, ids):
    """Hidden states after the final norm for predictions 0..L-2, flattened to (positions, hidden)."""
    hidden = decoder(streamed.model)(input_ids=ids.to(streamed.device), use_cache=False).last_hidden_state
    return hidden[:, :-1].reshape(-1, hidden.shape[-1])


def head_slice_rows(positions: int, hidden: int) -> int:
    """Vocabulary rows per slice of the head: its float32 weight rows and the float32 logits of
    every position for them both stay near HEAD_SLICE_BYTES."""
    return max(1, min(HEAD_SLICE_BYTES // (4 * max(1, hidden)), HEAD_SLICE_BYTES // (4 * max(1, positions))))


def head_block(streamed: StreamedModel, prefix: str, hidden, index):
    """Logits of every position for vocabulary rows `index` (the head's rows, under parameter
    prefix `prefix`, read for them only), finished as the model's own forward does (Finish), in float32."""
    import torch

    head = streamed.head
    weight = streamed.weights.rows(f"{prefix}weight", index).to(streamed.device, head.weight.dtype)
    bias = None
    if head.bias is not None:
        bias = streamed.weights.rows(f"{prefix}bias", index).to(streamed.device, head.bias.dtype)
    logits = streamed.finish(torch.nn.functional.linear(hidden, weight, bias))
    return logits.float().cpu().numpy()


def block_positions(vocab: int, room: int = 0) -> int:
    """Positions per block of float32 logits (logits_blocks): as many as `room` bytes hold, at least BLOCK_BYTES'
    worth."""
    return max(1, BLOCK_BYTES // (4 * vocab), room // (4 * vocab))


def logits_blocks(streamed: StreamedModel, hidden, room: int = 0) -> Iterator:
    """float32 logits (positions, vocab) of a group's hidden states, a block of positions at a time, in memory:
    block_positions at a time; each block's head applied a slice of the vocabulary at a time (head_block).

    Our own loop for the head: the CausalLM's forward would make all the logits at once with the
    whole head materialized (a 128k x 4096 matrix is 2 GB in float32); here one slice of the head, one
    slice of logits and the block are in memory. The head's rows are read once per block: once per group
    where the room holds the group's logits, else again for each block (nothing goes to disk)."""
    import numpy as np

    vocab, prefix = streamed.head.out_features, module_prefixes(streamed.model)[id(streamed.head)]
    block = block_positions(vocab, room)
    for first in range(0, hidden.shape[0], block):
        part = hidden[first : first + block]
        logits = np.empty((part.shape[0], vocab), np.float32)
        step = head_slice_rows(part.shape[0], part.shape[1])
        for start in range(0, vocab, step):
            index = np.arange(start, min(vocab, start + step))
            logits[:, start : start + len(index)] = head_block(streamed, prefix, part, index)
            release_freed_memory()
        yield logits
        del logits


def score_group(streamed: StreamedModel, ids, room: int = 0) -> Iterator[ScoredChunk]:
    """Run one group of windows through the streamed layers, then score it a chunk of positions at a
    time from its logits, computed a block of positions at a time within `room` bytes (logits_blocks)."""
    import torch

    hidden = last_hidden(streamed, ids)
    targets = ids[:, 1:].reshape(-1)
    offset = 0
    for logits in logits_blocks(streamed, hidden, room):
        step = chunk_rows(logits.shape[1])
        for start in range(0, len(logits), step):
            rows = torch.from_numpy(logits[start : start + step])
            first = offset + start
            yield ScoredChunk(torch.log_softmax(rows, dim=-1), targets[first : first + rows.shape[0]])
        offset += len(logits)
        release_freed_memory()  # the consumer's copies of the block's chunks are gone by now


def streamed_scorer(config, source: WeightSource, dtype, device="cpu", activation_bytes: int = ACTIVATION_BYTES,
                    room: int = 0) -> Scorer:
    """A Scorer (evaluate.compute_baseline / compare) running `config`'s model layer by layer
    from `source`, in `dtype` on `device`, its logits a block of positions at a time within `room` bytes."""
    return group_scorer(lambda: stream_model(config, source, dtype, device), config.get_text_config(),
                        activation_bytes, room)


def group_scorer(make: Callable[[], StreamedModel], text_config, activation_bytes: int = ACTIVATION_BYTES,
                 room: int = 0) -> Scorer:
    """A Scorer over the streamed model `make` builds when scoring starts: the windows go through it
    in groups sized for `text_config`'s activations, each group's logits in memory within `room` bytes."""

    @inference_generator
    def scorer(windows) -> Iterator[ScoredChunk]:
        streamed = make()
        group = windows_per_group(text_config, windows.shape[1], activation_bytes)
        try:
            for ids in iter_batches(windows, group):
                yield from score_group(streamed, ids, room)
        finally:
            streamed.close()

    return scorer


def decoder_layers(model) -> list:
    """The decoder's stack of layers, in the order its forward runs them."""
    return list(decoder(model).layers)


@contextmanager
def recording_layer_inputs(model, starts, record: dict[int, list]) -> Iterator[None]:
    """While inside, each forward appends to record[L] the input of decoder layer L (the output of
    layer L-1, as that layer returns it) for every L of `starts` from 1 to the layer count."""
    layers = decoder_layers(model)

    def hook(start: int):
        def keep(_module, _args, output):
            record.setdefault(start, []).append(output)
        return keep

    handles = [layers[start - 1].register_forward_hook(hook(start)) for start in sorted(set(starts))
               if 0 < start <= len(layers)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def passthrough(*args, **kwargs):
    """A decoder layer that gives back its hidden states unchanged."""
    return args[0] if args else kwargs["hidden_states"]


@contextmanager
def starting_at(model, start: int, recorded) -> Iterator[None]:
    """While inside, the decoder's forward computes layers `start` onwards only: the layers before
    start-1 pass their input through and layer start-1 returns `recorded` (its output on the same
    windows, from recording_layer_inputs). Their weights are never read. start 0: the whole forward."""
    layers = decoder_layers(model)[:start]
    for layer in layers[:-1]:
        layer.forward = passthrough
    if layers:
        layers[-1].forward = lambda *args, **kwargs: recorded
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def recording_scorer(streamed: StreamedModel, text_config, starts, record: dict[int, list],
                     activation_bytes: int = ACTIVATION_BYTES) -> Scorer:
    """The streamed model's Scorer that also records, group by group, the inputs of the layers
    `starts` names (recording_layer_inputs), for start_scorer to resume from."""

    def scorer(windows) -> Iterator[ScoredChunk]:
        import torch

        group = windows_per_group(text_config, windows.shape[1], activation_bytes)
        with torch.inference_mode(), recording_layer_inputs(streamed.model, starts, record):
            for ids in iter_batches(windows, group):
                yield from score_group(streamed, ids)

    return scorer


def start_scorer(streamed: StreamedModel, text_config, start: int, record: dict[int, list],
                 activation_bytes: int = ACTIVATION_BYTES) -> Scorer:
    """The streamed model's Scorer computing from decoder layer `start` on, each group of windows
    resuming from the input recording_scorer recorded for it (the same windows, in the same groups)."""

    @inference_generator
    def scorer(windows) -> Iterator[ScoredChunk]:
        group = windows_per_group(text_config, windows.shape[1], activation_bytes)
        for index, ids in enumerate(iter_batches(windows, group)):
            with starting_at(streamed.model, start, record[start][index] if start else None):
                yield from score_group(streamed, ids)

    return scorer


def streamable(config: dict, names=None) -> bool:
    """Whether the streamed forward applies: a full-precision text decoder whose checkpoint names
    are its module names (not a VLM, whose towers and forward differ; not a quantized checkpoint,
    whose weights need its engine's modules, quantkit.eval.compressed.streamable says which compressed-tensors
    ones stream; not a model transformers converts while loading, such as Mixtral's and Qwen3-MoE's
    per-expert tensors fused into one). Given the checkpoint's tensor `names`, a model type whose loading
    conversion changes none of them streams (the dense Granite 4 hybrids: the conversion renames only the MoE
    variant's experts)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    from quantkit.arch.vlm import is_vlm

    rows = get_checkpoint_conversion_mapping(config.get("model_type", "")) or []
    converts = bool(rows) if names is None else any(row.rename_source_key(n)[1] is not None
                                                     for row in rows for n in names)
    return not is_vlm(config) and "quantization_config" not in config and not converts


def streamed_logits(streamed: StreamedModel, ids, room: int = 0):
    """float32 logits (b, L, vocab) of every position of `ids`, the streamed model's forward
    (evaluate.LogitsFn: what lm-eval's model and greedy generation read, quantkit.eval.tasks);
    the head is applied a block of positions and a vocabulary slice at a time as score_group does."""
    import numpy as np
    import torch

    with torch.inference_mode():
        hidden = decoder(streamed.model)(input_ids=ids.to(streamed.device), use_cache=False).last_hidden_state
        rows = np.concatenate(list(logits_blocks(streamed, hidden.reshape(-1, hidden.shape[-1]), room)))
        return torch.from_numpy(rows).reshape(ids.shape[0], ids.shape[1], -1)
