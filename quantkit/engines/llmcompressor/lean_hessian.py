"""llm-compressor's GPTQ with one copy of each Hessian instead of three, and one of each weight.

GPTQ keeps a float32 Hessian per Linear (in² × 4 B: 256 MiB for an 8192-wide `down_proj`, 3 GiB
for Llama-3-70B's 28672-wide one). llm-compressor 0.14.0.1 makes a whole second Hessian each time
it adds a batch of inputs, and copies the one being quantized twice over, so a layer's peak is three
times the widest Hessian:
- `helpers.accumulate_hessian` computes a batch's X Xᵀ as a new in × in matrix before adding it, and
  scales the float32 copy of the inputs into another copy;
- `helpers.prepare_batch` divides it by the sample count into a new tensor and stacks that into a
  third, while the popped original is still referenced;
- `helpers.apply_activation_ordering` (act-order) gathers it twice, the original alive beside both;
- `helpers.factorize_hessian` calls cholesky / cholesky_inverse / cholesky with `out=` a row-major
  matrix; LAPACK works on column-major data, so torch computes in a column-major temporary.

Around the Hessian, the quantization itself holds more float32 copies of the weight than it needs:
- `gptq_quantize.quantize_weight` subtracts each block's error from the columns to its right as one
  rows × columns product, and makes the next block's product before the last one is dropped (two
  weight-sized temporaries), and undoes act-order's permutation into a second weight;
- `GPTQModifier.compress_module_list` keeps a module's stacked weights and quantized result in its
  loop variables while it quantizes the next module.

The functions here do the same arithmetic in place: X Xᵀ added a block of rows at a time (each
block's product is bit-identical to the same rows of the whole product) from inputs scaled in
place; and, on a batch of one module (the only batch size on a CPU, where
`batched_quantization="auto"` gives one), the division in place and the stack as a view, the
permutation by row chunks and block transposes, the factorization on the column-major view of the
transposed matrix; the block error and the inverse permutation a slab of rows at a time; and
compress_module_list called once per batch, so a batch's tensors are freed with its call. Results are
bit-identical to llm-compressor's on this project's CPU torch
(tests/methods/test_lean_hessian.py); a batch of several modules (GPU batching) goes to
llm-compressor's own functions unchanged.

`lean_hessians()` swaps them into llm-compressor's modules while GPTQ runs and restores them after;
the sites are entries of quantkit.engines.patches, checked by the test suite.
"""

from __future__ import annotations

BLOCK = 1024  # rows (and block width) of the temporaries the in-place steps use
ERROR_SLAB = 1 << 22  # elements (16 MiB in float32) of each slab of the block error and permutations
SLAB_ROWS = 256  # but at least this many rows per slab: BLAS takes other paths for a few rows


def transpose_in_place(matrix) -> None:
    """Transpose a square matrix in its own storage, a block pair at a time."""
    n = matrix.shape[0]
    for i in range(0, n, BLOCK):
        diagonal = matrix[i:i + BLOCK, i:i + BLOCK]
        diagonal.copy_(diagonal.t().clone())
        for j in range(i + BLOCK, n, BLOCK):
            upper, lower = matrix[i:i + BLOCK, j:j + BLOCK], matrix[j:j + BLOCK, i:i + BLOCK]
            saved = upper.clone()
            upper.copy_(lower.t())
            lower.copy_(saved.t())


def block_rows(width: int) -> int:
    """Rows per block of the in-place loops over a `width`-wide float32 matrix: BLOCK, fewer for wide
    matrices so a block stays within a slab (ERROR_SLAB)."""
    return min(BLOCK, slab_rows(width))


def permute_columns_in_place(matrix, perm) -> None:
    import torch

    rows = block_rows(matrix.shape[1])
    permuted = matrix.new_empty((min(rows, matrix.shape[0]), matrix.shape[1]))
    for i in range(0, matrix.shape[0], rows):
        block = matrix[i:i + rows]
        out = permuted[:block.shape[0]]
        torch.index_select(block, 1, perm, out=out)
        block.copy_(out)


def permute_square_in_place(matrix, perm) -> None:
    """matrix <- matrix[:, perm][perm, :], the rows permuted as columns of the transpose."""
    permute_columns_in_place(matrix, perm)
    transpose_in_place(matrix)
    permute_columns_in_place(matrix, perm)
    transpose_in_place(matrix)


def slab_rows(width: int) -> int:
    """Rows per slab of a row-slab loop over a `width`-wide float32 matrix."""
    return max(SLAB_ROWS, ERROR_SLAB // max(1, width))


def propagate_block_error(W, err, hinv_right, i2: int) -> None:
    """W[:, :, i2:] -= err @ hinv_right, a slab of rows at a time (each slab's product is the same rows
    of the whole product, bit for bit)."""
    import torch

    rows = slab_rows(W.shape[-1] - i2)
    for r in range(0, W.shape[-2], rows):
        W[:, r:r + rows, i2:] -= torch.bmm(err[:, r:r + rows], hinv_right)


def gather_columns_in_place(W, index) -> None:
    """W <- torch.gather(W, -1, index expanded over the rows), a slab of rows at a time: for a
    permutation `index`, the same values without a second weight."""
    import torch

    rows = slab_rows(W.shape[-1])
    for r in range(0, W.shape[-2], rows):
        slab = W[:, r:r + rows]
        slab.copy_(torch.gather(slab, -1, index.unsqueeze(-2).expand(-1, slab.shape[-2], -1)))


def accumulate_hessian(inp, module, hessian, num_samples):
    """llm-compressor's accumulate_hessian for a Linear: hessian += 2 X Xᵀ a block of rows at a time."""
    import math

    import torch
    from llmcompressor.modifiers.gptq import helpers

    if type(module) is not torch.nn.Linear:
        return helpers.accumulate_hessian(inp, module, hessian, num_samples)
    inp = inp.to(device=hessian.device)
    batch = 1 if inp.dim() == 2 else inp.shape[0]
    inp = inp.reshape(-1, inp.shape[-1])
    scaled = inp.to(dtype=helpers.GPTQ_PRECISION)
    if scaled.data_ptr() == inp.data_ptr():
        scaled = math.sqrt(2) * scaled  # the caller's tensor: scale a copy
    else:
        scaled.mul_(math.sqrt(2))
    columns = scaled.t()
    rows = block_rows(columns.shape[0])
    product = hessian.new_empty((min(rows, columns.shape[0]), columns.shape[0]))
    for i in range(0, columns.shape[0], rows):
        out = product[:columns[i:i + rows].shape[0]]
        torch.matmul(columns[i:i + rows], columns.t(), out=out)
        hessian[i:i + rows] += out
    num_samples += batch
    return hessian, num_samples


def prepare_batch(batch, batch_qparams, hessians_by_module, num_samples_by_module):
    """llm-compressor's prepare_batch; for one module the Hessian is normalized in place and stacked as a view."""
    import torch
    from llmcompressor.modifiers.gptq import helpers

    if len(batch) != 1:
        return helpers.prepare_batch(batch, batch_qparams, hessians_by_module, num_samples_by_module)
    module, qparams = batch[0], batch_qparams[0]
    hessian = hessians_by_module.pop(module)
    hessian.div_(num_samples_by_module.pop(module).to(device=hessian.device))
    weights = torch.empty((1, *module.weight.shape), device=module.weight.device, dtype=helpers.GPTQ_PRECISION)
    torch.stack([module.weight], out=weights)
    global_scale = qparams["global_scale"]
    global_scales = None if global_scale is None else torch.stack([global_scale.reshape(-1)[0]])
    return (weights, hessian.unsqueeze(0), torch.stack([qparams["scale"]]), torch.stack([qparams["zero_point"]]),
            global_scales)


def apply_activation_ordering(weights, hessians, actorder):
    """llm-compressor's apply_activation_ordering, the Hessian and the weight permuted in place (one module)."""
    import torch
    from compressed_tensors.quantization import ActivationOrdering
    from llmcompressor.modifiers.gptq import helpers

    if hessians.shape[0] != 1 or actorder not in (ActivationOrdering.WEIGHT, ActivationOrdering.STATIC):
        return helpers.apply_activation_ordering(weights, hessians, actorder)  # no order, several, or its error
    perm = torch.argsort(torch.diagonal(hessians, dim1=-2, dim2=-1), dim=-1, descending=True)
    permute_square_in_place(hessians[0], perm[0].to(device=hessians.device))
    weight_perm = perm.to(device=weights.device)
    gather_columns_in_place(weights, weight_perm)
    return weights, hessians, weight_perm


def factorize_hessian(weights, hessians, percdamp, used_rtn_fallback):
    """llm-compressor's factorize_hessian for one module, on the column-major view of the transposed
    storage (no temporary), transposed back after: the same LAPACK calls on the same values."""
    import torch
    from llmcompressor.modifiers.gptq import helpers

    if hessians.shape[0] != 1:
        return helpers.factorize_hessian(weights, hessians, percdamp, used_rtn_fallback)
    matrix = hessians[0]
    diag = torch.diagonal(matrix)
    dead = diag == 0
    if dead.any():
        diag.masked_fill_(dead, 1.0)
        weights.masked_fill_(dead.view(1, 1, -1), 0)
    diag.add_(percdamp * torch.mean(torch.diag(matrix)))
    transpose_in_place(matrix)
    column_major = matrix.mT
    info = torch.empty((), dtype=torch.int32, device=matrix.device)
    torch.linalg.cholesky_ex(column_major, check_errors=False, out=(column_major, info))
    if info.item() == 0:
        torch.cholesky_inverse(column_major, out=column_major)
        torch.linalg.cholesky(column_major, upper=True, out=column_major)
        transpose_in_place(matrix)
    else:
        matrix.copy_(torch.eye(matrix.shape[0], dtype=matrix.dtype, device=matrix.device))
        used_rtn_fallback[0] = True
    return hessians


def quantize_weight(weights, hessians, scale, zero_point, global_scale, quant_args, blocksize=128, percdamp=0.01):
    """llm-compressor's gptq_quantize.quantize_weight for one module, with the block error propagated
    and the act-order permutation undone a slab of rows at a time; several modules go upstream."""
    import torch
    from compressed_tensors.quantization import ActivationOrdering, QuantizationStrategy
    from llmcompressor.modifiers.gptq import gptq_quantize, helpers

    if weights.ndim != 3 or hessians.ndim != 3 or weights.shape[0] != 1 or hessians.shape[0] != 1:
        return gptq_quantize.quantize_weight(weights, hessians, scale, zero_point, global_scale, quant_args,
                                             blocksize=blocksize, percdamp=percdamp)
    _, num_rows, num_columns = weights.shape
    final_dtype, device = weights.dtype, weights.device
    W = weights.to(device=device, dtype=helpers.GPTQ_PRECISION)
    H = hessians.to(device=device, dtype=helpers.GPTQ_PRECISION)
    del weights, hessians
    scale, zero_point = scale.to(device=device), zero_point.to(device=device)
    global_scale = None if global_scale is None else global_scale.to(device=device)
    W, H, perm = apply_activation_ordering(W, H, quant_args.actorder)
    g_idx = None
    if quant_args.strategy in (QuantizationStrategy.GROUP, QuantizationStrategy.TENSOR_GROUP,
                               QuantizationStrategy.BLOCK):
        divisor = (quant_args.group_size if quant_args.strategy != QuantizationStrategy.BLOCK
                   else quant_args.block_structure[1])
        g_idx = torch.arange(num_columns, device=device, dtype=torch.int) // divisor
        if quant_args.actorder == ActivationOrdering.WEIGHT:
            g_idx = torch.gather(g_idx.unsqueeze(0).expand(1, -1), 1, perm)
    losses = torch.zeros(1, num_rows, device=device)
    used_rtn_fallback = torch.zeros(1, dtype=torch.bool, device=device)
    Hinv = factorize_hessian(W, H, percdamp, used_rtn_fallback)
    for i1 in range(0, num_columns, blocksize):
        i2 = min(i1 + blocksize, num_columns)
        W1 = W[:, :, i1:i2].clone()
        Q1, Err1, losses1 = torch.zeros_like(W1), torch.zeros_like(W1), torch.zeros_like(W1)
        gptq_quantize.gptq_block_update(W1, Hinv[:, i1:i2, i1:i2], Q1, Err1, losses1, scale=scale,
                                        zero_point=zero_point, global_scale=global_scale, g_idx=g_idx,
                                        quant_args=quant_args, i1=i1)
        W[:, :, i1:i2] = Q1
        losses += torch.sum(losses1, 2) / 2
        propagate_block_error(W, Err1, Hinv[:, i1:i2, i2:], i2)
    release_storage(Hinv)
    if perm is not None:
        gather_columns_in_place(W, torch.argsort(perm, dim=-1))  # back to the original column order
    return W.to(final_dtype), losses.sum(dim=1), used_rtn_fallback


def release_storage(hinv) -> None:
    """Free the factorized Hessian's memory once the last block is done. compress_module_list keeps
    its `hessians` variable (this very storage, stacked as a view by prepare_batch) while it writes
    the quantized weight back, a disk write with --offload-dir, and reads it no more: without this,
    the widest Hessian (256 MiB for an 8192-wide down_proj) stayed resident through that write."""
    hinv.untyped_storage().resize_(0)


def one_batch_per_call(compress_module_list):
    """GPTQModifier.compress_module_list called once per batch of modules: its loop keeps a batch's
    float32 weights and quantized result in its variables while the next batch is quantized; a call
    per batch frees them when it returns, and the C heap hands their free pages back before the
    next batch (quantkit.io.memory.release_freed_memory)."""
    def compress_batch_by_batch(self, module_list):
        from llmcompressor.modifiers.gptq import helpers

        from quantkit.io.memory import release_freed_memory

        for batch in helpers.assign_batches(module_list, self.batched_quantization, self.block_size):
            compress_module_list(self, batch)
            release_freed_memory()
    return compress_batch_by_batch


def lean_hessians():
    """Route llm-compressor's GPTQ through the functions above while inside; restored on exit
    (quantkit.engines.patches.LEAN_GPTQ)."""
    from quantkit.engines.patches import LEAN_GPTQ, patched

    return patched(*LEAN_GPTQ)
