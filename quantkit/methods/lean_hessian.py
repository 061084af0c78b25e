"""llm-compressor's GPTQ with one copy of each Hessian instead of three.

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

The functions here do the same arithmetic in place: X Xᵀ added a block of rows at a time (each
block's product is bit-identical to the same rows of the whole product) from inputs scaled in
place; and, on a batch of one module (the only batch size on a CPU, where
`batched_quantization="auto"` gives one), the division in place and the stack as a view, the
permutation by row chunks and block transposes, the factorization on the column-major view of the
transposed matrix. Results are bit-identical to llm-compressor's on this project's CPU torch
(tests/methods/test_lean_hessian.py); a batch of several modules (GPU batching) goes to
llm-compressor's own functions unchanged.

`lean_hessians()` swaps them into llm-compressor's modules while GPTQ runs and restores them after.
The sites are checked by the test suite, so an llm-compressor upgrade that moves them fails there.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

# (module, function) pairs whose global name GPTQ calls through.
SITES = (
    ("llmcompressor.modifiers.gptq.base", "accumulate_hessian"),
    ("llmcompressor.modifiers.gptq.base", "prepare_batch"),
    ("llmcompressor.modifiers.gptq.gptq_quantize", "apply_activation_ordering"),
    ("llmcompressor.modifiers.gptq.gptq_quantize", "factorize_hessian"),
)
BLOCK = 1024  # rows (and block width) of the temporaries the in-place steps use


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


def permute_columns_in_place(matrix, perm) -> None:
    for i in range(0, matrix.shape[0], BLOCK):
        rows = matrix[i:i + BLOCK]
        rows.copy_(rows[:, perm])


def permute_square_in_place(matrix, perm) -> None:
    """matrix <- matrix[:, perm][perm, :], the rows permuted as columns of the transpose."""
    permute_columns_in_place(matrix, perm)
    transpose_in_place(matrix)
    permute_columns_in_place(matrix, perm)
    transpose_in_place(matrix)


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
    for i in range(0, columns.shape[0], BLOCK):
        hessian[i:i + BLOCK] += columns[i:i + BLOCK].matmul(columns.t())
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
    """llm-compressor's apply_activation_ordering, the Hessian permuted in place (one module)."""
    import torch
    from compressed_tensors.quantization import ActivationOrdering
    from llmcompressor.modifiers.gptq import helpers

    if hessians.shape[0] != 1 or actorder not in (ActivationOrdering.WEIGHT, ActivationOrdering.STATIC):
        return helpers.apply_activation_ordering(weights, hessians, actorder)  # no order, several, or its error
    num_rows = weights.shape[-2]
    perm = torch.argsort(torch.diagonal(hessians, dim1=-2, dim2=-1), dim=-1, descending=True)
    permute_square_in_place(hessians[0], perm[0].to(device=hessians.device))
    weight_perm = perm.to(device=weights.device)
    weights.copy_(torch.gather(weights, -1, weight_perm.unsqueeze(-2).expand(-1, num_rows, -1)))
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


@contextmanager
def lean_hessians() -> Iterator[None]:
    """Route llm-compressor's GPTQ through the functions above while inside; restored on exit."""
    from quantkit.patching import swapped

    lean = {"accumulate_hessian": accumulate_hessian, "prepare_batch": prepare_batch,
            "apply_activation_ordering": apply_activation_ordering, "factorize_hessian": factorize_hessian}
    with swapped({site: lean[site[1]] for site in SITES}):
        yield
