"""quantkit.engines.llmcompressor.one_writer: on 2 gloo processes whose CPU weights are compressed-tensors' shared
copies, a smoothing written as llm-compressor 0.14.0.1 writes it (the smooth layer divided in place, the balance
layer scaled) is applied once with smoothing_once and write_once, and once per rank without them; a rotation is
folded once with rotation_once and write_by_source."""

import torch
import torch.multiprocessing as mp

from quantkit.engines.llmcompressor.one_writer import private_copy, same_storage

WORLD = 2
NORM = torch.arange(1.0, 9.0)
WEIGHT = torch.arange(32.0).reshape(4, 8) / 10
SCALES = torch.full((8,), 2.0)


def on_rank(rank: int, store: str, out: str) -> None:
    """One rank: the smoothing with one writer, then without, each rank's view of the shared values saved."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    torch.save({**{once: smooth(once) for once in (True, False)}, "rotated": rotate()}, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


def smooth(once: bool) -> dict:
    """Two modules offloaded to the shared CPU copy, the smoothing applied; the values this rank sees after it."""
    import torch.distributed as dist
    from compressed_tensors.offload import offload_module, update_offload_parameter

    from quantkit.engines.llmcompressor.one_writer import smoothing_once, write_once

    norm, linear = torch.nn.LayerNorm(8, bias=False), torch.nn.Linear(8, 4, bias=False)
    with torch.no_grad():
        norm.weight.copy_(NORM)
        linear.weight.copy_(WEIGHT)
    for module in (norm, linear):
        offload_module(module, "cpu", "cpu")  # DistributedCPUCache: rank 0's tensors in shared memory
    write = write_once if once else update_offload_parameter

    @torch.no_grad()
    def apply_smoothing(self, model):  # as AWQ's _smooth writes
        write(linear, "weight", linear.weight * SCALES.view(1, -1))
        write(norm, "weight", norm.weight.div_(SCALES))

    (smoothing_once(apply_smoothing, lambda modifier: [norm, linear]) if once else apply_smoothing)(None, None)
    dist.barrier()
    return {"norm": norm.weight.detach().clone(), "linear": linear.weight.detach().clone()}


def rotate():
    """A weight offloaded to the shared CPU copy, rotated as compressed-tensors folds a transform (read, transformed,
    written) by a transform modifier's on_calibration_start; the value this rank sees after it."""
    from compressed_tensors.offload import offload_module

    from quantkit.engines.llmcompressor.one_writer import rotation_once, write_by_source

    linear = torch.nn.Linear(8, 4, bias=False)
    with torch.no_grad():
        linear.weight.copy_(WEIGHT)
    offload_module(linear, "cpu", "cpu")

    @torch.no_grad()
    def on_calibration_start(self, state, event):
        write_by_source(linear, "weight", linear.weight.flip(-1) * 3)

    rotation_once(on_calibration_start)(None, None, None)
    return linear.weight.detach().clone()


def test_the_smoothing_of_shared_cpu_weights_is_written_once(tmp_path):
    import compressed_tensors.offload  # noqa: F401 - imported once, before the ranks are forked

    mp.start_processes(on_rank, args=(str(tmp_path / "store"), str(tmp_path / "seen")), nprocs=WORLD,
                       start_method="fork")
    ranks = [torch.load(tmp_path / f"seen.{rank}") for rank in range(WORLD)]
    for rank in ranks:
        assert rank[True]["norm"].equal(NORM / 2) and rank[True]["linear"].equal(WEIGHT * 2)
    # the control: without one writer every rank divides the one shared norm in place
    assert all(rank[False]["norm"].equal(NORM / 4) for rank in ranks)
    # a rotation folded by rank 0 alone, seen by both after the barrier
    assert all(rank["rotated"].equal(WEIGHT.flip(-1) * 3) for rank in ranks)


def test_a_private_copy_keeps_the_class_and_attributes_but_not_the_storage():
    weight = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    weight.marker = "kept"
    copy = private_copy(weight)
    assert type(copy) is torch.nn.Parameter and copy.marker == "kept" and copy.equal(weight)
    assert not same_storage(copy, weight) and same_storage(weight, weight)
