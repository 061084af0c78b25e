"""mlx-lm's quantized KV cache (``--kv-bits N --kv-group-size G``: mlx_lm/models/cache.py QuantizedKVCache).

Keys and values (after RoPE) are stored by ``mx.quantize(x, group_size, bits)`` along head_dim: affine groups, the
scale and bias in the activation dtype; attention reads them through ``mx.quantized_matmul`` (the same values as
``mx.dequantize``); queries stay unquantized. mlx's affine rule (mlx/ops.cpp affine_quantize), per group:
scale = max((max - min) / (2^bits - 1), 1e-7), signed toward the edge of larger magnitude; that edge is made
exactly representable (q0 = round(edge / scale), scale = edge / q0 when q0 != 0); bias = edge (0 when q0 == 0);
q = clip(round((x - bias) / scale), 0, 2^bits - 1); x̂ = q·scale + bias, computed in the activation dtype.
Sliding-window (rotating) caches are not quantized by mlx-lm.
"""

from __future__ import annotations

from quantkit.errors import UnsupportedError

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
DEFAULT_GROUP = 64


def check(bits: int, group_size: int, head_dim: int) -> None:
    if bits not in BITS:
        raise UnsupportedError(f"mlx-lm --kv-bits {bits}: mx.quantize takes {', '.join(map(str, BITS))}",
                               hint="e.g. --kv-cache mlx:4")
    if group_size not in GROUP_SIZES:
        raise UnsupportedError(f"mlx-lm --kv-group-size {group_size}: mx.quantize takes "
                               f"{', '.join(map(str, GROUP_SIZES))}", hint="e.g. --kv-cache mlx:4g64")
    if head_dim % group_size:
        raise UnsupportedError(f"mlx-lm --kv-group-size {group_size} does not tile this model's head dimension "
                               f"{head_dim}", hint="choose a group size that divides the head dimension")


def affine_params(groups, bits: int):
    """(scale, bias) float32 per group of `groups` (..., n_groups, group_size), mlx's affine_quantize rule."""
    import torch

    n_bins = float(2 ** bits - 1)
    g = groups.float()
    w_max = g.amax(dim=-1, keepdim=True)
    w_min = g.amin(dim=-1, keepdim=True)
    mask = w_min.abs() > w_max.abs()
    scale = torch.clamp((w_max - w_min) / n_bins, min=1e-7)
    scale = torch.where(mask, scale, -scale)
    edge = torch.where(mask, w_min, w_max)
    q0 = torch.round(edge / scale)
    scale = torch.where(q0 != 0, edge / q0, scale)
    bias = torch.where(q0 == 0, torch.zeros_like(edge), edge)
    return scale, bias


def round_trip(x, bits: int, group_size: int = DEFAULT_GROUP):
    """x (..., head_dim) stored by mx.quantize and read back by mx.dequantize, in x's dtype."""
    import torch

    groups = x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size)
    scale, bias = affine_params(groups, bits)
    q = torch.clamp(torch.round((groups.float() - bias) / scale), 0, 2 ** bits - 1)
    scale_d, bias_d = scale.to(x.dtype), bias.to(x.dtype)
    return (q.to(x.dtype) * scale_d + bias_d).reshape(x.shape)


def bytes_per_value(bits: int, group_size: int, dtype_bytes: int = 2) -> float:
    """Stored bytes per key or value element: the packed codes plus a scale and a bias per group."""
    return bits / 8 + 2 * dtype_bytes / group_size
