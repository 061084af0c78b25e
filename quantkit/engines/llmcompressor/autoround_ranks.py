"""AutoRound on torchrun ranks: one loss for every rank, gradients averaged, each layer's weights written once.

llm-compressor 0.14.0.1 tunes each decoder layer with auto-round (0.15.1), whose data-parallel path wraps the layer
in DistributedDataParallel (auto_round/utils/distributed.py, "experimental"). Three things kept it off ranks:
- each rank kept the iteration with its own lowest loss, and stopped early on its own loss: ranks could end on
  different weights, or one could wait in a gradient all-reduce the other never joined;
- DistributedDataParallel refuses a CPU module with device_ids=["cpu"] (ValueError on gloo);
- every rank wrote its tuned weights into the weights the ranks of a node share on a CPU, each computed from
  weights another rank may already have overwritten.

What quantkit does instead, while a layer is tuned on several ranks:
- `loss_over_ranks`: each batch's loss as the ranks' mean (weighted by their elements), so `total_loss`, the best
  iteration and the early stop are the same on every rank; the gradient stays the rank's own (the reduced part is
  detached), and `gradients_averaged` averages it over the ranks before every step (SUM / world size, which gloo
  and NCCL both have), as auto-round does for a rank with several GPUs. The trainable offsets start equal and take
  equal steps, so every rank holds the same ones.
- `own_copies`: the layer's tensors onloaded as this rank's own copies while AutoRound tunes and writes them; when
  llm-compressor offloads the layer again, compressed-tensors' DistributedCPUCache shares the source rank's
  (rank 0's) tensors with the others: one writer.
Each rank's batch is its share of the one-process batch (`rank_batch_size`), so one step sees as many windows as
one process's step does.
"""

from __future__ import annotations

from collections.abc import Callable


def rank_batch_size(batch_size: int, world_size: int) -> int:
    """Each rank's AutoRound batch: its share of the one-process batch, at least one window."""
    return max(1, batch_size // world_size)


def distributed() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def loss_over_ranks(original: Callable) -> Callable:
    """auto-round's SignRoundQuantizer._get_loss whose value is the ranks' mean loss, its gradient this rank's."""

    def get_loss(self, pred_output, ref_output, *args, **kwargs):
        loss = original(self, pred_output, ref_output, *args, **kwargs)
        if not distributed():
            return loss
        # the value exactly the mean on every rank (x - x is 0), the gradient the rank's own loss's
        return mean_over_ranks(loss.detach(), ref_output.numel()) + (loss - loss.detach())

    return get_loss


def mean_over_ranks(value, count: int):
    """The ranks' mean of a per-rank mean `value` over `count` elements each: sum(value * count) / sum(count)."""
    import torch
    import torch.distributed as dist

    pair = torch.stack([value.double() * count, torch.tensor(float(count), dtype=torch.float64, device=value.device)])
    dist.all_reduce(pair, op=dist.ReduceOp.SUM)
    return (pair[0] / pair[1]).to(value.dtype)


def gradients_averaged(original: Callable) -> Callable:
    """auto-round's setup_ddp_if_needed_: on several ranks the block left as it is, and its gradients averaged over
    the ranks before each step (the hook auto-round calls there); in one process, the original."""

    def setup_ddp_if_needed_(ar, block, device_list):
        if not distributed():
            return original(ar, block, device_list)
        return block, lambda: average_gradients(block)

    return setup_ddp_if_needed_


def average_gradients(module) -> None:
    """Every parameter's gradient summed over the ranks and divided by their number."""
    import torch.distributed as dist

    world = dist.get_world_size()
    for param in module.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
            param.grad.div_(world)


def own_copies(module) -> None:
    """The module's tensors in CPU memory the ranks share (DistributedCPUCache's) replaced by this rank's own copies,
    once its offloading is removed (a GPU's onloaded tensors are its own already)."""
    from quantkit.engines.llmcompressor.one_writer import private_copy

    for store in (module._parameters, module._buffers):
        for key, tensor in list(store.items()):
            if tensor is not None and tensor.device.type == "cpu" and tensor.is_shared():
                store[key] = private_copy(tensor)
