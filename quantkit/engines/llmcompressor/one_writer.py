"""Weights the ranks share, written once: llm-compressor's smoothing (AWQ, SmoothQuant) and rotations (SpinQuant,
QuIP) under torchrun.

On a CPU, compressed-tensors' DistributedCPUCache keeps one copy of every weight in shared memory for all the
ranks of a node, and onloading a weight to the CPU hands back that very tensor: a rank's in-place change is a
change for every rank. llm-compressor 0.14.0.1 computes the smoothing on every rank (from statistics it reduces
over the ranks: every rank finds the same scales) and every rank writes it: AWQ divides the smooth layer in place
(`module.weight.div_(scales)`) and SmoothQuant reads each weight back after another rank may have written it, so
the smoothing was applied once per rank. On GPUs each rank onloads its own copy, but every rank writes the one
host copy, with nothing ordering those writes against the other ranks' reads.

`smoothing_once` wraps a modifier's `_apply_smoothing` (one writer and a barrier; no rank holds a second copy of
the model):
1. every rank takes a private copy of each tensor of the modules the smoothing touches (the smooth and balance
   layers of the mappings smoothed now: about one decoder layer) and holds it as the onloaded value
   (compressed-tensors' keep_onloaded_values); then the ranks meet at a barrier, so no copy sees another rank's
   write;
2. the smoothing runs on those copies: AWQ's trial weights and every scaled weight stay private, and every rank
   computes the same scales;
3. `update_offload_parameter` (`write_once`) updates every rank's private copy, and the shared copy on the source
   rank alone (rank 0);
4. a barrier (the source rank has written), then the private copies are dropped: every rank reads the shared copy
   the source rank wrote (on a GPU, each rank's onloaded copy is refreshed from it).

The rotations (`rotation_once`) are computed from the weights alone, once, when calibration starts: every rank runs
llm-compressor's transform modifier (the transform submodules and hooks it adds are each rank's own, and its random
Hadamard matrices come from the same default generator on every rank), but only the source rank writes the rotated
weights (`write_by_source`; the others' results are dropped), and the ranks meet at a barrier before the first
calibration forward reads them.

AWQ's statistics are reduced by `_allreduce_data_sum`, which 0.14.0.1 runs on the current accelerator only; on a
CPU (gloo) `sum_over_ranks` reduces them where they are. SmoothQuant reduces its per-channel minimum and maximum
with MIN/MAX, exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import contextmanager
from typing import Any, Iterator

from quantkit.errors import InternalError


def modules_awq_smooths(modifier) -> list:
    """The smooth and balance layers of the AWQ mappings with statistics now (those _apply_smoothing smooths)."""
    stats = modifier._smooth_activation_stats
    return [module for mapping in modifier._resolved_mappings if mapping.smooth_name in stats
            for module in (mapping.smooth_layer, *mapping.balance_layers)]


def modules_smoothquant_smooths(modifier) -> list:
    """The smooth and balance layers of the SmoothQuant mappings with statistics now."""
    return [module for mapping in modifier.resolved_mappings_ if mapping.smooth_name in modifier.scales_
            for module in (mapping.smooth_layer, *mapping.balance_layers)]


def smoothing_once(original: Callable, modules_of: Callable[[Any], list]) -> Callable:
    """A modifier's _apply_smoothing run on private copies, the shared weights written by one rank (module
    docstring); in one process, the original."""

    def apply_smoothing(self, model):
        from compressed_tensors.distributed import is_distributed

        if not is_distributed():
            return original(self, model)
        with private_copies(modules_of(self)):
            return original(self, model)

    return apply_smoothing


def awq_smoothing_once(original: Callable) -> Callable:
    return smoothing_once(original, modules_awq_smooths)


def smoothquant_smoothing_once(original: Callable) -> Callable:
    return smoothing_once(original, modules_smoothquant_smooths)


@contextmanager
def private_copies(modules: Iterable) -> Iterator[None]:
    """Steps 1 and 4 of the module docstring around the body: every offloaded tensor of `modules` onloaded as a
    private copy while inside; on the way out, after a barrier, the shared copy read again."""
    import torch.distributed as dist
    from compressed_tensors.offload import disable_offloading

    with disable_offloading():  # the onloaded values are held while inside (a no-op inside the pipeline's)
        held = hold_private(modules)
        dist.barrier()  # every rank holds its copies before any rank writes
        try:
            yield
        finally:
            dist.barrier()  # the source rank has written the shared copies
            release(held)


def offload_caches(module) -> list:
    """The module's compressed-tensors offload caches (parameters, buffers); none for a module not offloaded."""
    from compressed_tensors.offload.cache.base import OffloadCache

    return [cache for cache in (module._parameters, module._buffers) if isinstance(cache, OffloadCache)]


def same_storage(one, other) -> bool:
    return one.device == other.device and one.data_ptr() == other.data_ptr()


def private_copy(tensor):
    """A copy of `tensor` of the same class and attributes (as compressed-tensors' send_tensors makes one)."""
    copy = tensor.detach().clone()
    copy.__class__ = tensor.__class__
    copy.__dict__ = tensor.__dict__.copy()
    return copy


def hold_private(modules: Iterable) -> list[tuple[Any, Any, Any]]:
    """Each offloaded tensor of `modules` held onloaded as this rank's own tensor: the onloaded copy where it is
    one already (a GPU's), else a private copy (a CPU's onloaded tensor is the shared one). Returns (cache,
    offloaded, what was held before) for `release`."""
    from compressed_tensors.offload.cache.base import OffloadCache

    kept, held, seen = OffloadCache.keep_onloaded_values, [], set()
    for module in modules:
        if id(module) in seen:
            continue
        seen.add(id(module))
        for cache in offload_caches(module):
            for offloaded in cache.offloaded_values.values():
                if offloaded is None:
                    continue
                before = kept.get(offloaded)
                onloaded = before if before is not None else cache.onload(offloaded)
                if same_storage(onloaded, offloaded):
                    onloaded = private_copy(offloaded)
                held.append((cache, offloaded, before))
                kept[offloaded] = onloaded
    return held


def release(held: list[tuple[Any, Any, Any]]) -> None:
    """The shared copies read again: a private CPU copy dropped (what was held before back), a GPU's onloaded
    copy refreshed from the shared one the source rank wrote."""
    import torch
    from compressed_tensors.offload.cache.base import OffloadCache

    kept = OffloadCache.keep_onloaded_values
    for cache, offloaded, before in held:
        if before is not None and not same_storage(before, offloaded):
            with torch.no_grad():
                before.copy_(cache.onload(offloaded).to(before.device))
            kept[offloaded] = before
        elif before is None:
            kept.pop(offloaded, None)
        else:
            kept[offloaded] = before


def write_once(module, name: str, data) -> None:
    """compressed-tensors' update_offload_parameter with one writer: the source rank updates the shared copy (and
    its onloaded copy); another rank updates only the private copy it holds (private_copies)."""
    import torch
    from compressed_tensors.distributed import is_source_process
    from compressed_tensors.offload import update_offload_parameter
    from compressed_tensors.offload.cache.base import OffloadCache

    cache = module._parameters if name in module._parameters else module._buffers
    if is_source_process() or not isinstance(cache, OffloadCache):
        update_offload_parameter(module, name, data)
        return
    offloaded = cache.offloaded_values[name]
    onloaded = OffloadCache.keep_onloaded_values.get(offloaded)
    if onloaded is None or same_storage(onloaded, offloaded):
        raise InternalError(f"a rank other than the source was about to write the shared {name} of "
                            f"{type(module).__name__} outside its private copies", hint="report this as a bug")
    with torch.no_grad():
        onloaded.copy_(data)


def write_by_source(module, name: str, data) -> None:
    """compressed-tensors' update_offload_parameter where the source rank alone writes an offloaded tensor (the
    shared copy); another rank's offloaded tensors are left for it (a module not offloaded is the rank's own)."""
    from compressed_tensors.distributed import is_source_process
    from compressed_tensors.offload import update_offload_parameter
    from compressed_tensors.offload.cache.base import OffloadCache

    cache = module._parameters if name in module._parameters else module._buffers
    if is_source_process() or not isinstance(cache, OffloadCache):
        update_offload_parameter(module, name, data)


def rotation_once(original: Callable) -> Callable:
    """A transform modifier's on_calibration_start followed by a barrier on several ranks: the source rank has
    written every rotated weight before any rank reads one."""

    def on_calibration_start(self, state, event, **kwargs):
        import torch.distributed as dist
        from compressed_tensors.distributed import is_distributed

        result = original(self, state, event, **kwargs)
        if is_distributed():
            dist.barrier()
        return result

    return on_calibration_start


def sum_over_ranks(original: Callable) -> Callable:
    """AWQ's _allreduce_data_sum, on the tensors' own device where there is no accelerator (gloo on a CPU; 0.14.0.1
    moves them to the current accelerator, which raises there). The tensors are copied first: the originals stay
    this rank's sums."""

    def allreduce_data_sum(data: list) -> list:
        import torch
        import torch.distributed as dist
        from compressed_tensors.offload.dist_utils import as_broadcastable

        if torch.accelerator.is_available():
            return original(data)
        data = [datum.clone() for datum in data]
        pending = [dist.all_reduce(as_broadcastable(datum), op=dist.ReduceOp.SUM, async_op=True) for datum in data]
        for work in pending:
            work.wait()
        return data

    return allreduce_data_sum
