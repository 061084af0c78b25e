"""Several ranks under torchrun: llm-compressor's data-parallel calibration, the gate scored data-parallel,
and rank 0 the only rank that writes and publishes.

torchrun starts one quantkit per rank (one per GPU, or CPU processes on gloo; on one node or several).
Every rank checks the same inputs, sees rank 0's staging directory (see_from_every_rank: on several
nodes OUT must be on storage they all mount), loads the model, scores its share of the held-out windows
with the base, takes its own share of the calibration windows and runs the same oneshot, then scores its
share of the held-out windows with the artifact rank 0 staged. The gate's per-position values are
gathered on every rank (gather_positions), so its metrics are the one-process metrics. Rank 0 alone
writes the report, gates and publishes; the other ranks write nothing beside a private work directory
and exit 0.

Which methods run here is each method's `ranks` (quantkit.methods.OnRanks): every method that calibrates through
llm-compressor. The statistics are reduced over the ranks: GPTQ's Hessians (summed onto the rank that quantizes
each Linear: the one-process Hessians up to summation order, so the rounding differs in some int4 values, as between
one-process runs with another thread count), the activation observers' minimum and maximum (nvfp4, fp8-static and
the FP8 KV cache: MIN/MAX), AWQ's activation sums and grid-search losses, SmoothQuant's per-channel ranges
(MIN/MAX), AutoRound's loss and gradients (quantkit.engines.llmcompressor.autoround_ranks). A weight the ranks share
(one copy per node on a CPU) is written once, by rank 0: the smoothing and the rotations
(quantkit.engines.llmcompressor.one_writer), AutoRound's tuned layers. What calibrates nothing (fp8-dynamic,
fp8-block, mxfp4) is written by rank 0. The guide (auto-precision, fallback) measures its sensitivity data-parallel
(quantkit.mixed.layers) and rank 0 decides each step, which the other ranks follow (quantkit.run.follow). --resume
keeps each rank's hidden states and rank 0's layers (quantkit.engines.llmcompressor.layer_resume). The one-process
engines (nf4, gguf, mlx) are refused, each saying why (its OnRanks).

quantkit gives each rank its share itself. llm-compressor 0.14.0.1 splits a dataset that is the same
on every rank on its own, but it builds the sampler on the split and the DataLoader on the whole set
(`llmcompressor.datasets.utils._make_sampler`), so every rank calibrates on the first share:
`scripts/check_distributed_gptq.py` shows it, and that quantkit's split gives the one-process result.

llm-compressor 0.14.0.1 does not hand a rank's quantized weights (GPTQ) or weight scales
(QuantizationModifier) to the others when the module runs on the CPU
(`broadcast_qparams_and_cleanup(skip_cpu=True)`: CPU weights are shared between the ranks), and nothing
waits for the owning rank to finish writing them, so the next layer's inputs were computed from
half-written weights in some runs (on gloo: top-1 agreement 5% instead of 61% on the toy model, one run
in three). `synchronized()` adds a barrier after both.

Refused before any work: the run-wide options in ONE_PROCESS_FLAGS. With --offload-dir each rank keeps its own
disk copy, and the weights a rank quantizes never reach the others' copies: on gloo the toy model's second layer
came out different (70-92% of its int4 values).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

from quantkit.errors import InputError, RankStoppedError, UnsupportedError

# run-wide options that need one process: flag -> (why, what to do instead)
ONE_PROCESS_FLAGS = {
    "--lora": ("the adapters are merged into a checkpoint that rank 0 alone would write",
               "merge first (`quantkit merge BASE --lora ADAPTER -o MERGED`), then launch on the merged checkpoint"),
    "--offload-dir": ("each rank would keep its own disk copy, and llm-compressor does not hand the weights a "
                      "rank quantizes to the others' copies: they would calibrate the next layer on stale weights",
                      "drop --offload-dir (each rank holds the model in RAM), or run one process with it"),
    "--skip-existing": ("rank 0 alone would decide which targets run", "name the targets to run with --only"),
    "--partial": ("rank 0 alone would go on past a target that fails", "drop --partial"),
}
TIMEOUT_HOURS = 6  # the other ranks wait at the first collective while rank 0 scores the baseline


@dataclass(frozen=True)
class Ranks:
    """Where this process stands in a torchrun launch; Ranks() is a plain single process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def share(self, count: int) -> slice:
        """This rank's contiguous share of `count` items: floor boundaries, as llm-compressor splits."""
        return slice(count * self.rank // self.world_size, count * (self.rank + 1) // self.world_size)


def ranks_from(env: Mapping[str, str]) -> Ranks:
    """The launcher's RANK / WORLD_SIZE / LOCAL_RANK; a plain single process without them."""
    try:
        world = int(env.get("WORLD_SIZE", "1"))
        rank, local = int(env.get("RANK", "0")), int(env.get("LOCAL_RANK", env.get("RANK", "0")))
    except ValueError as exc:
        raise InputError(f"cannot read the torchrun environment: {exc}",
                         hint="launch with `torchrun --nproc-per-node N quantkit quantize ...`, or without torchrun")
    if world < 1 or not 0 <= rank < world:
        raise InputError(f"RANK={rank} is not one of WORLD_SIZE={world} ranks", hint="launch with torchrun")
    return Ranks(rank, world, local)


def check_launch(ranks: Ranks, targets: list[tuple[str, str, bool, object, str | None]], num_samples: int,
                 flags: list[str], eval_windows: int = 0) -> None:
    """Refuse, before work, what cannot run on several ranks. `targets` are (name, method, whether the
    method runs on several ranks, options, why these options do not: None where they do); `flags` the
    run-wide options given (names as in ONE_PROCESS_FLAGS)."""
    if not ranks.distributed:
        return
    launch = f"this is one of {ranks.world_size} torchrun ranks"
    for name, method, distributed, _options, why in targets:
        if not distributed or why:
            because = f" ({why})" if why else ""
            raise UnsupportedError(f"target '{name}': {method} runs in one process only{because}, but {launch}",
                                   hint="launch the targets whose method runs on several ranks with torchrun "
                                   "(--only), the others without it")
    if flags:  # the first one given is named
        why, hint = ONE_PROCESS_FLAGS[flags[0]]
        raise UnsupportedError(f"{flags[0]} runs in one process only ({why}), but {launch}", hint=hint)
    if 0 < num_samples < ranks.world_size:  # a method that calibrates nothing (fp8-dynamic) needs no windows
        raise InputError(f"{num_samples} calibration windows cannot be shared by {ranks.world_size} ranks",
                         hint=f"raise --num-samples to at least {ranks.world_size}")
    if 0 < eval_windows < ranks.world_size:
        raise InputError(f"{eval_windows} held-out windows cannot be shared by {ranks.world_size} ranks (each scores "
                         "its share of the gate's windows)", hint=f"raise --eval-windows to at least "
                                                                  f"{ranks.world_size}")


@contextmanager
def process_group(ranks: Ranks, device: str) -> Iterator[None]:
    """Join the process group torchrun set up (NCCL with one GPU per rank, gloo on CPU) while inside;
    nothing for a single process."""
    if not ranks.distributed:
        yield
        return
    import datetime

    import torch
    import torch.distributed as dist

    cuda = device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(ranks.local_rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=ranks.rank, world_size=ranks.world_size,
                            timeout=datetime.timedelta(hours=TIMEOUT_HOURS))
    try:
        yield
    except RuntimeError as exc:
        if not peer_lost(exc):
            raise
        raise RankStoppedError(f"rank {ranks.rank} of {ranks.world_size}: another rank stopped ({first_line(exc)})",
                               hint="torchrun names the rank that failed first and its exit code; with --resume its "
                                    "finished layers are kept for the next launch") from exc
    finally:
        dist.destroy_process_group()


def peer_lost(exc: RuntimeError) -> bool:
    """Whether a collective failed because another rank is gone: torch's distributed errors, or gloo's lost
    connection."""
    import torch.distributed as dist

    text = str(exc)
    return isinstance(exc, dist.DistError) or ("gloo" in text and "peer" in text)


def first_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[0][:200]


def broadcast_then_wait(*args, **kwargs) -> None:
    """llm-compressor's broadcast_qparams_and_cleanup, then every rank waits for the others: the
    CPU modules it skips are written in place by their owning rank."""
    import torch.distributed as dist
    from llmcompressor.utils.dist import broadcast_qparams_and_cleanup

    broadcast_qparams_and_cleanup(*args, **kwargs)
    dist.barrier()


RANK_PATCHES = ("gptq.broadcast_qparams_and_cleanup", "quantization.broadcast_qparams_and_cleanup",
                "awq.apply_smoothing", "awq.update_offload_parameter", "awq.allreduce_data_sum",
                "smoothquant.apply_smoothing", "smoothquant.update_offload_parameter",
                "spinquant.rotation_once", "quip.rotation_once", "transform.update_offload_parameter",
                "fuse.update_offload_parameter")


@contextmanager
def synchronized(ranks: Ranks) -> Iterator[None]:
    """llm-compressor's hand-overs between ranks made safe while inside (several ranks only): a barrier
    after GPTQ's and QuantizationModifier's broadcasts."""
    if not ranks.distributed:
        yield
        return
    from quantkit.engines.patches import patched

    with patched(*RANK_PATCHES):
        yield


def rank_zero_alone(ranks: Ranks):
    """While inside, what rank 0 does alone (the KV-cache measurement, flips, tasks, the serving check) loads
    compressed-tensors artifacts without a collective: compressed-tensors 0.19 decompresses a model on all the ranks
    of a process group together (replace_module_parallel), which the other ranks never join (a crash or a hang).
    Nothing in one process."""
    from contextlib import nullcontext

    if not ranks.distributed:
        return nullcontext()
    from compressed_tensors.offload import as_single_threaded

    return as_single_threaded()


def gather_positions(values):
    """Every rank's per-position values (a numpy array each), concatenated in rank order, on every rank:
    the ranks score contiguous shares of the windows in order, so this is the one-process array."""
    import numpy as np
    import torch.distributed as dist

    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, values)
    return np.concatenate(parts)


def measured_share(windows, ranks: Ranks):
    """This rank's share of `windows` for a data-parallel measurement (the guide's sensitivity), and whether the
    ranks split them (then what they measure is reduced or gathered): all of them on every rank when there are
    fewer windows than ranks."""
    if not ranks.distributed or len(windows) < ranks.world_size:
        return windows, False
    return windows[ranks.share(len(windows))], True


def reduce_sums(tensors: list) -> None:
    """Each tensor replaced in place by its sum over the ranks (every rank passes the same list, in order)."""
    import torch.distributed as dist

    for tensor in tensors:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)


def share_object(value, ranks: Ranks):
    """Rank 0's `value` on every rank (a path, a flag): also where the other ranks wait for rank 0."""
    import torch.distributed as dist

    box = [value if ranks.is_main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_for(ranks: Ranks):
    """quantkit.eval.evaluate's Gather for this launch: gather_positions on several ranks, None in one process."""
    return gather_positions if ranks.distributed else None


MARKER = ".quantkit-ranks"  # written by rank 0 into its staging directory, read by every rank


def blind_ranks(views: list[tuple[bool, str]]) -> list[str]:
    """The ranks (with their hosts) whose view of rank 0's staging directory (seen?, hostname) is blind."""
    return [f"rank {rank} on {host}" for rank, (seen, host) in enumerate(views) if not seen]


def see_from_every_rank(staging: Path | None, ranks: Ranks) -> Path:
    """Rank 0 passes the staging directory it made (`staging`; None on the other ranks) and every rank checks
    that it sees it: the other ranks score their share of the gate's windows with the artifact rank 0 stages
    there, so on several nodes OUT must be on storage every node mounts at the same path. Rank 0 writes a
    marker with a random token, every rank reads it, and all ranks refuse together (exit 2) when one cannot.
    Returns the staging directory."""
    import secrets
    import socket

    import torch.distributed as dist

    token = secrets.token_hex(8)
    if ranks.is_main:
        (staging / MARKER).write_text(token)
    where, token = share_object((str(staging), token), ranks)
    marker = Path(where) / MARKER
    seen = marker.is_file() and marker.read_text() == token
    views: list = [None] * ranks.world_size
    dist.all_gather_object(views, (seen, socket.gethostname()))
    if ranks.is_main:
        marker.unlink()
    blind = blind_ranks(views)
    if blind:
        raise UnsupportedError(
            f"{', '.join(blind)} cannot see the staging directory {where} that rank 0 made beside OUT: every rank "
            "reads the staged artifact to score its share of the gate's windows",
            hint="put -o on storage every node mounts at the same path (NFS, Lustre, ...), or run on one node")
    return Path(where)
