"""quantkit.engines.llmcompressor.autoround_ranks on 2 gloo processes: each rank's loss on its own windows comes out as
the ranks' mean (so both keep the same best iteration) with the rank's own gradient, the gradients are averaged
before the step, and a tensor in the memory the ranks share is replaced by the rank's own copy."""

import pytest
import torch
import torch.multiprocessing as mp

from quantkit.engines.llmcompressor.autoround_ranks import rank_batch_size

WORLD = 2


def on_rank(rank: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from quantkit.engines.llmcompressor.autoround_ranks import average_gradients, loss_over_ranks, own_copies

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    layer = torch.nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        layer.weight.fill_(1.0)
    windows = 1 + rank  # rank 0 has one window of 3 elements, rank 1 two
    target = torch.full((windows, 3, 1), float(rank + 1))
    inputs = torch.ones(windows, 3, 2)

    def mse(self, pred, ref):  # auto-round's loss: a mean over the rank's elements
        return torch.nn.functional.mse_loss(pred, ref)

    loss = loss_over_ranks(mse)(None, layer(inputs), target)
    loss.backward()
    own = layer.weight.grad.clone()
    average_gradients(layer)
    shared = torch.zeros(4).share_memory_()
    module = torch.nn.Module()
    module.register_buffer("table", shared)
    own_copies(module)
    torch.save({"loss": loss.item(), "own_grad": own, "grad": layer.weight.grad.clone(),
                "private": not module.table.is_shared() and module.table.equal(shared)}, f"{out}.{rank}")
    dist.barrier()
    dist.destroy_process_group()


def test_one_loss_for_every_rank_with_each_ranks_gradient_averaged(tmp_path):
    mp.start_processes(on_rank, args=(str(tmp_path / "store"), str(tmp_path / "seen")), nprocs=WORLD,
                       start_method="fork")
    ranks = [torch.load(tmp_path / f"seen.{rank}") for rank in range(WORLD)]
    # predictions are 2 everywhere: rank 0's 3 elements miss by 1, rank 1's 6 are exact
    assert ranks[0]["loss"] == ranks[1]["loss"] == pytest.approx((3 * 1.0 + 6 * 0.0) / 9)  # the same float on both
    assert ranks[0]["own_grad"].equal(torch.full((1, 2), 2.0)) and ranks[1]["own_grad"].equal(torch.zeros(1, 2))
    assert all(rank["grad"].equal(torch.full((1, 2), 1.0)) for rank in ranks)
    assert all(rank["private"] for rank in ranks)


def test_each_rank_takes_its_share_of_the_batch():
    assert [rank_batch_size(8, world) for world in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
