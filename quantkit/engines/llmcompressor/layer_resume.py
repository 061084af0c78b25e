"""--resume for the methods llm-compressor calibrates layer by layer: its sequential pipeline, saving
each finished layer.

llm-compressor's SequentialPipeline splits the model into subgraphs (a decoder layer each; the first
one holds the embeddings, the last the final norm and the head), and for each one runs the
calibration windows through it, lets the modifiers quantize it (GPTQ's step, AWQ's smoothing) and
runs the windows through the quantized subgraph again to get the next one's inputs. A --resume run
replaces that loop (`sequential.resume` in quantkit.engines.patches) with `run_sequential`, the same
loop with two additions:

- after each subgraph but the last, its modules' parameters and buffers (the quantized weights and
  their scales, zero points, group indices; the norms AWQ scaled) go to `layer-NNNNN.safetensors`,
  the hidden states the later subgraphs need and the random number generators' states to
  `activations-NNNNN.pt`, and then `layers.json` records both files' sha256 (fsynced, written last,
  so a recorded file is complete); the previous activations file is removed after it;
- after llm-compressor's calibration start (observers attached, scales initialised), a run with
  saved progress puts every finished layer's tensors back into the model, takes the saved hidden
  states and generators' states, and goes on with the next subgraph.

A resumed run computes the same numbers from the same inputs as an uninterrupted one, and writes
the same bytes. What the saved progress is checked against: the staging directory's identity
(quantkit.run.resume: version, inputs, recipe), and here the partition into subgraphs (their count
and input names) and each file's sha256; saved progress that does not match or verify is set aside
with a warning and the run starts from the first layer.

Under torchrun (N ranks, quantkit.engines.llmcompressor.distributed) each rank's hidden states are those of its
own share of the windows: every rank saves its own `activations-NNNNN-rankR.pt` (with its generators' states), the
ranks gather their files' sha256 on rank 0 (so all of them have written), rank 0 alone writes the layer's tensors
(the weights the ranks share) and then the record, with the launch's world size, and only after a barrier does each
rank remove its previous file. Resuming, every rank checks what it reads (rank 0 the layers, each rank its hidden
states), the ranks agree (any rank's reason sets the progress aside on all of them), rank 0 alone puts the saved
tensors back (one writer, then a barrier) and each rank takes its own hidden states. Progress saved by another
number of ranks is refused before any work (quantkit.run.resume: exit 2 naming both).

Disk: the finished layers' tensors (up to the model's bytes) and one or, while the next is written,
two copies of the calibration windows' hidden states (`saved_bytes`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from quantkit.engines.llmcompressor.distributed import Ranks
from quantkit.engines.llmcompressor.model_free import file_sha256
from quantkit.errors import InternalError
from quantkit.io.export import replace_json

STATE_FILE = "layers.json"
STATE_VERSION = 1


@dataclass(frozen=True)
class LayerCheckpoints:
    """Where a --resume run keeps its finished layers, and how it says what it does."""

    directory: Path
    progress: Callable[[str], None]
    ranks: Ranks = Ranks()  # under torchrun: each rank saves its own hidden states, rank 0 the rest


def resumable_pipeline(original: Callable, checkpoints: LayerCheckpoints | None = None):
    """The replacement of SequentialPipeline.__call__ (a staticmethod): the same loop, saving and resuming
    layers in `checkpoints` (quantkit.engines.patches builds it with the run's checkpoints bound)."""
    from llmcompressor.pipelines.sequential.helpers import handle_sequential_oom

    @handle_sequential_oom
    def call(model, dataloader, dataset_args):
        return run_sequential(model, dataloader, dataset_args, checkpoints)

    return staticmethod(call)


def run_sequential(model, dataloader, dataset_args, checkpoints: LayerCheckpoints | None) -> None:
    """llm-compressor 0.14.0.1's SequentialPipeline.__call__, with the two additions of the module docstring
    (marked "quantkit:"). Kept line for line otherwise: the patch inventory pins the version it copies."""
    import torch
    from compressed_tensors.offload import disable_offloading, set_onload_device
    from llmcompressor.core import LifecycleCallbacks, active_session
    from llmcompressor.modifiers.utils.hooks import HooksMixin
    from llmcompressor.pipelines.cache import IntermediatesCache
    from llmcompressor.pipelines.sequential.helpers import trace_subgraphs
    from llmcompressor.pipelines.sequential.pipeline import _get_batches
    from llmcompressor.utils.dev import get_main_device
    from llmcompressor.utils.helpers import DisableQuantization, calibration_forward_context
    from llmcompressor.utils.pytorch.module import infer_sequential_targets

    session = active_session()
    onload_device = get_main_device()
    offload_device = torch.device(dataset_args.sequential_offload_device)
    set_onload_device(model, onload_device)
    modifiers = session.lifecycle.recipe.modifiers
    if any(type(m).__name__ == "AutoRoundModifier" for m in modifiers):
        dataset_args.propagate_error = False
    sequential_targets = infer_sequential_targets(model, dataset_args.sequential_targets)
    sample_input = next(iter(dataloader))
    subgraphs = trace_subgraphs(model, sample_input, sequential_targets, dataset_args.tracing_ignore,
                                dataset_args.sequential_targets_per_subgraph)
    num_subgraphs = len(subgraphs)

    LifecycleCallbacks.calibration_start()

    with contextlib.ExitStack() as stack:
        stack.enter_context(calibration_forward_context(model))
        stack.enter_context(DisableQuantization(model))
        activations = IntermediatesCache.from_dataloader(dataloader, onload_device, offload_device)
        if getattr(dataset_args, "use_loss_mask", False):
            session.state.loss_masks = [activations.fetch(batch_idx, ["loss_mask"]).get("loss_mask")
                                        for batch_idx in range(len(dataloader))]
        else:
            session.state.loss_masks = None
        # quantkit: the finished layers put back, their hidden states taken
        first, activations = resume_point(checkpoints, model, subgraphs, activations)
        sequential_prefetch = getattr(dataset_args, "sequential_prefetch", False)
        session.state.sequential_prefetch = sequential_prefetch

        for subgraph_index, subgraph in enumerate(subgraphs):
            if subgraph_index < first:  # quantkit: finished by the interrupted run
                continue
            calib_desc = f"({subgraph_index + 1}/{num_subgraphs}): Calibrating"
            prop_desc = f"({subgraph_index + 1}/{num_subgraphs}): Propagating"
            num_batches = len(dataloader)
            with disable_offloading():
                for batch_idx, inputs in _get_batches(activations, num_batches, subgraph.input_names, calib_desc,
                                                      sequential_prefetch):
                    session.state.current_batch_idx = batch_idx
                    outputs = subgraph.forward(model, **inputs)
                    if not dataset_args.propagate_error:
                        if subgraph_index < num_subgraphs - 1:
                            activations.update(batch_idx, outputs)
                            activations.delete(batch_idx, subgraph.consumed_names)

                LifecycleCallbacks.sequential_epoch_end(subgraph.submodules(model))

                if dataset_args.propagate_error:
                    with HooksMixin.disable_hooks():
                        for batch_idx, inputs in _get_batches(activations, num_batches, subgraph.input_names,
                                                              prop_desc, sequential_prefetch):
                            output = subgraph.forward(model, **inputs)
                            if subgraph_index < num_subgraphs - 1:
                                activations.update(batch_idx, output)
                                activations.delete(batch_idx, subgraph.consumed_names)
                # quantkit: the finished layer saved with the hidden states the next one needs
                if checkpoints is not None and subgraph_index < num_subgraphs - 1:
                    save_layer(checkpoints, model, subgraphs, subgraph_index, activations)

        LifecycleCallbacks.calibration_end()


def partition(subgraphs) -> list[list[str]]:
    """What identifies the split into subgraphs: each one's input names, in order."""
    return [sorted(s.input_names) for s in subgraphs]


def layer_tensors(model, subgraph) -> dict[str, Any]:
    """Every parameter and buffer of the subgraph's modules, by its name in the model, copied to the CPU."""
    names = {id(module): name for name, module in model.named_modules()}
    tensors = {}
    for module in subgraph.submodules(model):
        prefix = names[id(module)]
        for attr, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            if tensor is not None:
                key = f"{prefix}.{attr}" if prefix else attr
                tensors[key] = tensor.detach().to("cpu", copy=True).contiguous()
    return tensors


def write_durably(path: Path, write: Callable[[Path], None]) -> str:
    """`write(tmp)` then fsync and rename into `path`; its sha256."""
    tmp = path.with_name(path.name + ".tmp")
    write(tmp)
    with open(tmp, "rb") as fh:
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return file_sha256(path)


def layer_file(index: int) -> str:
    return f"layer-{index:05d}.safetensors"


def activations_file(index: int, ranks: Ranks = Ranks()) -> str:
    """The hidden states after layer `index`: one file per rank under torchrun."""
    return f"activations-{index:05d}-rank{ranks.rank}.pt" if ranks.distributed else f"activations-{index:05d}.pt"


def rng_states() -> dict[str, Any]:
    import torch

    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    import torch

    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])


def save_layer(checkpoints: LayerCheckpoints, model, subgraphs, index: int, activations) -> None:
    """Layer `index` finished: the hidden states after it (each rank its own), then on rank 0 its tensors and the
    record naming them all; then the previous hidden states go."""
    import torch

    directory, ranks = checkpoints.directory, checkpoints.ranks
    directory.mkdir(parents=True, exist_ok=True)
    state = read_state(directory) if index else None
    layers = list(state["layers"]) if state else []
    if len(layers) != index:
        raise InternalError(f"--resume: layer {index} finished with {len(layers)} layers recorded before it",
                            hint="report this as a bug; run without --resume")
    saved = {"batches": activations.batch_intermediates, "offload_device": activations.offload_device,
             "rng": rng_states()}
    hidden = gathered(write_durably(directory / activations_file(index, ranks), lambda p: torch.save(saved, p)),
                      ranks)  # every rank's file written
    if ranks.is_main:
        layers.append(save_tensors(directory / layer_file(index), layer_tensors(model, subgraphs[index])))
        replace_json(directory / STATE_FILE, {"version": STATE_VERSION, "partition": partition(subgraphs),
                                              "layers": layers, "activations": hidden,
                                              **({"world_size": ranks.world_size} if ranks.distributed else {})})
    if ranks.distributed:
        barrier()  # the record names the new files before any rank removes its previous one
    if index:
        (directory / activations_file(index - 1, ranks)).unlink(missing_ok=True)
    checkpoints.progress(f"layer {index + 1}/{len(subgraphs) - 1} saved for --resume")  # the head's is never saved


def save_tensors(path: Path, tensors: dict[str, Any]) -> str:
    from safetensors.torch import save_file

    return write_durably(path, lambda p: save_file(tensors, str(p)))


def gathered(value, ranks: Ranks):
    """`value` in one process; every rank's value, in rank order, under torchrun (on every rank)."""
    if not ranks.distributed:
        return value
    import torch.distributed as dist

    values: list = [None] * ranks.world_size
    dist.all_gather_object(values, value)
    return values


def barrier() -> None:
    import torch.distributed as dist

    dist.barrier()


def read_state(directory: Path) -> dict | None:
    import json

    try:
        state = json.loads((directory / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None
    return state if isinstance(state, dict) and state.get("version") == STATE_VERSION else None


def unusable(directory: Path, state: dict, subgraphs, ranks: Ranks = Ranks()) -> str | None:
    """Why saved progress cannot be resumed from on this rank (it does not match this run or what this rank reads
    does not verify: rank 0 the layers, every rank its hidden states); None if it can."""
    saved_world = state.get("world_size", 1)
    if saved_world != ranks.world_size:
        return f"it was saved by {saved_world} ranks, and this launch has {ranks.world_size}"
    if state["partition"] != partition(subgraphs):
        return "the model splits into other subgraphs than the saved progress's"
    done = len(state["layers"])
    if not 0 < done < len(subgraphs):
        return f"{done} saved layers for {len(subgraphs)} subgraphs"
    hidden = state["activations"][ranks.rank] if ranks.distributed else state["activations"]
    files = [(layer_file(i), digest) for i, digest in enumerate(state["layers"])] if ranks.is_main else []
    for name, digest in [*files, (activations_file(done - 1, ranks), hidden)]:
        if file_sha256(directory / name) != digest:  # None: missing or unreadable
            return f"{name} does not verify (sha256)"
    return None


def agreed_reason(directory: Path, state: dict | None, subgraphs, ranks: Ranks) -> str | None:
    """Why the saved progress is not used, the same on every rank: no state (None, said by nobody), or the first
    rank's reason that it cannot be used."""
    why = "" if state is None else unusable(directory, state, subgraphs, ranks)
    reasons = gathered(why, ranks) if ranks.distributed else [why]
    if any(reason == "" for reason in reasons):
        return ""
    return next((f"rank {rank}: {reason}" if ranks.distributed else reason
                 for rank, reason in enumerate(reasons) if reason), None)


def resume_point(checkpoints: LayerCheckpoints | None, model, subgraphs, activations):
    """The first subgraph to run and the hidden states it reads: 0 and `activations` without saved progress;
    else after the saved layers, put back into the model, with the hidden states saved after them."""
    if checkpoints is None:
        return 0, activations
    ranks = checkpoints.ranks
    state = read_state(checkpoints.directory)
    why = agreed_reason(checkpoints.directory, state, subgraphs, ranks)
    if why == "":  # nothing saved
        return 0, activations
    if why is not None:
        checkpoints.progress(f"warning: --resume: the saved layers are not used ({why}); starting from the first")
        return 0, activations
    done = len(state["layers"])
    if ranks.is_main:
        for index in range(done):
            restore_tensors(model, checkpoints.directory / layer_file(index))
    if ranks.distributed:
        barrier()  # rank 0 has put the shared tensors back
    cache = load_activations(checkpoints.directory / activations_file(done - 1, ranks), type(activations))
    checkpoints.progress(f"resuming after {done} of {len(subgraphs) - 1} layers (verified by sha256)")
    return done, cache


def restore_tensors(model, path: Path) -> None:
    """A saved layer's tensors written into the model's (offloaded or not) parameters and buffers."""
    from compressed_tensors.offload import update_offload_parameter
    from safetensors.torch import load_file

    for name, tensor in load_file(str(path)).items():
        module_name, _, attr = name.rpartition(".")
        module = model.get_submodule(module_name)
        if attr not in module._parameters and attr not in module._buffers:
            raise InternalError(f"--resume: {name} was saved but the model has no such tensor",
                                hint="report this as a bug; run without --resume")
        update_offload_parameter(module, attr, tensor)


def load_activations(path: Path, cache_type):
    """The hidden states saved after a layer, as llm-compressor's IntermediatesCache; the generators' states set."""
    import torch

    saved = torch.load(path, weights_only=False)  # our own file, verified by its sha256 (unusable)
    set_rng_states(saved["rng"])
    return cache_type(saved["batches"], saved["offload_device"])


UNIT = "the last finished decoder layer"


def resume_fields(calibrates: Callable[[Any], bool] = lambda options: True) -> dict[str, Any]:
    """A sequential method's --resume record (quantkit.methods.Resume: unit, refused, bytes), as keywords;
    `calibrates(options)`: whether these options run the layer-by-layer calibration (a data-free scheme
    has no layers to save)."""
    def why(info, options) -> str | None:
        if not calibrates(options):
            return "this scheme calibrates nothing, so no layer-by-layer progress is saved"
        return refused(options)

    return dict(unit=UNIT, refused=why,
                bytes=lambda info, options, calibration: saved_bytes(info, calibration.num_samples, calibration.seq_len))


def refused(options) -> str | None:
    """Why a sequential method's target with these options does not resume (quantkit.methods.Resume.refused): the
    searches quantize the model again for each candidate, a rotation is not verified; None: it resumes."""
    if getattr(options, "auto_precision", None) is not None or getattr(options, "fallback", None) is not None:
        return "--auto-precision and --fallback quantize again for each step of their search"
    if getattr(options, "rotate", "none") not in (None, "none"):
        return "a resumed run with a rotation is not verified byte-identical"
    return None


# torch.save's records beside the tensors' bytes: each window's five tensors and their wrappers (measured: ~2 KiB
# a window), and the generators' states (CPU: 5 KiB)
SAVE_OVERHEAD_PER_WINDOW = 4096
SAVE_OVERHEAD = 65536


def saved_bytes(info, samples: int, seq_len: int) -> int:
    """Disk the saved progress of a model's run takes at most (preflight): every layer's tensors (the model's
    bytes, a bound: the last subgraph is never saved), and two copies (the next one is written before the
    previous one is removed) of what the next layer reads for each of `samples` calibration windows of `seq_len`
    tokens: its hidden states and rotary tables in the model's dtype, the int64 position ids, and the causal
    mask (seq_len x seq_len in the model's dtype; llm-compressor's IntermediatesCache keeps it per window)."""
    from quantkit.io.safetensors import DTYPE_BYTES

    text = info.config.get("text_config") or info.config
    hidden = int(text.get("hidden_size") or 0)
    head_dim = int(text.get("head_dim") or hidden // max(1, int(text.get("num_attention_heads") or 1)))
    width = DTYPE_BYTES.get(info.dtype, 4) if isinstance(info.dtype, str) else 4
    layers = sum(DTYPE_BYTES.get(dtype, 4) * prod(shape) for dtype, shape in info.tensors.values())
    per_window = seq_len * ((hidden + 2 * head_dim + seq_len) * width + 8) + SAVE_OVERHEAD_PER_WINDOW
    return layers + (2 * (samples * per_window + SAVE_OVERHEAD) if samples else 0)


def prod(shape) -> int:
    total = 1
    for size in shape:
        total *= int(size)
    return total
