"""MLX's affine quantization, the math: w = scale * q + bias per group of `group_size` input columns.

Layout (mlx.core.quantize, mode "affine"): q holds unsigned `bits`-bit integers 0 .. 2^bits - 1,
written as one little-endian bit stream per row (value i at bits i*b .. i*b+b-1, the lowest bit
first) and stored as uint32 words, so a row of n values takes n*bits/32 words; this holds for the
3- and 6-bit packings too. `scales` and `biases` (rows, n / group_size) are stored in the model's
float dtype, and mlx.core.dequantize computes scale * q + bias in that dtype (the product rounded,
then the sum), which `dequantize` reproduces bit for bit.

An affine group is an asymmetric integer group with a zero point: bias = -scale * zero.

`quantize` is quantkit's calibrated quantizer: per group, the (scale, bias) minimizing the
importance-weighted squared error sum_j imp_j (w_j - scale*q_j - bias)^2, searched over a grid of
ranges (each q fitted by weighted least squares, as llama.cpp's make_qkx2_quants does for k-quants)
and refined; a group keeps plain min/max rounding where that is better. `imp` is the mean squared
input activation of each column on the calibration windows (None: every column alike).
"""

from __future__ import annotations

import numpy as np

BITS = (2, 3, 4, 6, 8)
GROUP_SIZES = (32, 64, 128)
GRID_STEPS = 20  # ranges tried per group: (levels + RANGE_LOW + RANGE_STEP * k) / (max - min), k = 0..GRID_STEPS
RANGE_LOW, RANGE_STEP = -1.0, 0.1
REFINE_ROUNDS = 2  # re-rounding and re-fitting after the search
SLAB_VALUES = 1 << 22  # weights quantized at once (bounds the search's temporaries)


def pack(q: np.ndarray, bits: int) -> np.ndarray:
    """uint32 words (rows, cols * bits / 32) of unsigned `bits`-bit values q (rows, cols)."""
    rows, cols = q.shape
    stream = np.unpackbits(q.astype(np.uint8)[..., None], axis=-1, bitorder="little")[..., :bits]
    packed = np.packbits(stream.reshape(rows, cols * bits), axis=-1, bitorder="little")
    return np.ascontiguousarray(packed).view("<u4")


def unpack(words: np.ndarray, bits: int) -> np.ndarray:
    """The uint8 values (rows, words * 32 / bits) packed in uint32 `words` (rows, words)."""
    rows = words.shape[0]
    stream = np.unpackbits(np.ascontiguousarray(words, dtype="<u4").view(np.uint8), axis=-1, bitorder="little")
    values = stream.reshape(rows, -1, bits)
    return np.packbits(values, axis=-1, bitorder="little")[..., 0]


def dequantize(words, scales, biases, bits: int, group_size: int):
    """The weight (rows, cols) in the scales' torch dtype, exactly as mlx.core.dequantize computes it: a slab of
    SLAB_VALUES weights at a time into the one output, so the unpacked integers and the products are never
    whole beside it (a 262144 x 640 embedding: 320 MiB in 16 bits, each temporary as big)."""
    import torch

    words = np.asarray(words)
    rows, cols = words.shape[0], words.shape[1] * 32 // bits
    out = torch.empty((rows, cols), dtype=scales.dtype)
    step = max(1, SLAB_VALUES // max(1, cols))
    for start in range(0, rows, step):
        end = min(rows, start + step)
        q = torch.from_numpy(unpack(words[start:end], bits)).to(scales.dtype)
        grouped = q.reshape(end - start, -1, group_size) * scales[start:end, :, None] + biases[start:end, :, None]
        out[start:end] = grouped.reshape(end - start, -1)
    return out


def round_to_nearest(w, bits: int, group_size: int):
    """(scale, bias) per group from its min and max: plain rounding, the start of the search."""
    levels = 2 ** bits - 1
    groups = w.reshape(w.shape[0], -1, group_size)
    low, high = groups.amin(-1), groups.amax(-1)
    return ((high - low) / levels).clamp_min(1e-12), low


def fit(groups, weights, q):
    """Weighted least squares (scale, bias) of groups ≈ scale * q + bias, per group; None where q is
    constant in a group (the fit is undetermined there)."""
    sw, swq = weights.sum(-1), (weights * q).sum(-1)
    swq2, swx, swqx = (weights * q * q).sum(-1), (weights * groups).sum(-1), (weights * q * groups).sum(-1)
    det = sw * swq2 - swq * swq
    ok = det > 1e-12 * sw * swq2.clamp_min(1e-30)
    safe = det.where(ok, 1.0)
    return (sw * swqx - swq * swx) / safe, (swq2 * swx - swq * swqx) / safe, ok


def rounded(groups, scale, bias, levels: int):
    return ((groups - bias[..., None]) / scale[..., None]).round().clamp(0, levels)


def error(groups, weights, scale, bias, levels: int):
    """Weighted squared error of each group with q rounded to the nearest level of (scale, bias)."""
    q = rounded(groups, scale, bias, levels)
    return (weights * (scale[..., None] * q + bias[..., None] - groups) ** 2).sum(-1)


def keep_better(best, candidate, groups, weights, levels: int):
    """(scale, bias, error) per group: the candidate's where it is valid and lower."""
    scale, bias, ok = candidate
    valid = ok & (scale > 0)
    scale, bias = scale.where(valid, best[0]), bias.where(valid, best[1])
    err = error(groups, weights, scale, bias, levels)
    better = err < best[2]
    return scale.where(better, best[0]), bias.where(better, best[1]), err.where(better, best[2])


def search(groups, weights, levels: int):
    """The grid of ranges, each rounded and fitted, then REFINE_ROUNDS of re-rounding and re-fitting."""
    low, high = groups.amin(-1), groups.amax(-1)
    scale, bias = ((high - low) / levels).clamp_min(1e-12), low
    best = (scale, bias, error(groups, weights, scale, bias, levels))
    span = (high - low).clamp_min(1e-12)
    for k in range(GRID_STEPS + 1):
        inverse = (levels + RANGE_LOW + RANGE_STEP * k) / span
        q = ((groups - low[..., None]) * inverse[..., None]).round().clamp(0, levels)
        best = keep_better(best, fit(groups, weights, q), groups, weights, levels)
    for _ in range(REFINE_ROUNDS):
        best = keep_better(best, fit(groups, weights, rounded(groups, best[0], best[1], levels)), groups, weights,
                           levels)
    return best[0], best[1]


def quantize(w, bits: int, group_size: int, imp=None, dtype=None):
    """(uint32 words, scales, biases) of a float weight (rows, cols): scales and biases in `dtype` (the
    weight's own by default), the integers rounded against those stored values. `imp` (cols,): the
    importance of each input column (None: plain rounding of each group's min..max)."""
    import torch

    dtype = dtype or w.dtype
    levels = 2 ** bits - 1
    rows_per_slab = max(1, SLAB_VALUES // w.shape[1])
    words, scales, biases = [], [], []
    for start in range(0, w.shape[0], rows_per_slab):
        slab = w[start:start + rows_per_slab].to(torch.float32)
        groups = slab.reshape(slab.shape[0], -1, group_size)
        if imp is None:
            scale, bias = round_to_nearest(slab, bits, group_size)
        else:
            weights = importance_floor(imp.to(torch.float32)).reshape(1, -1, group_size).expand_as(groups)
            scale, bias = search(groups, weights, levels)
        scale, bias = scale.to(dtype), bias.to(dtype)
        q = rounded(groups, scale.to(torch.float32), bias.to(torch.float32), levels)
        words.append(pack(q.reshape(slab.shape).to(torch.uint8).numpy(), bits))
        scales.append(scale)
        biases.append(bias)
    return np.concatenate(words), torch.cat(scales), torch.cat(biases)


def importance_floor(imp):
    """Column weights with a floor (a column no calibration token excited still counts a little)."""
    return imp.clamp_min(0) + 1e-3 * float(imp.clamp_min(0).mean()) + 1e-12


def stored_bits(bits: int, group_size: int, scale_bytes: int = 2) -> float:
    """Bits per weight stored: the packed integers and a scale and a bias per group."""
    return bits + 2 * 8 * scale_bytes / group_size


def quantize_stacked(w, bits: int, group_size: int, imp=None, dtype=None):
    """(uint32 words [experts, rows, cols * bits / 32], scales, biases [experts, rows, cols / group_size]) of stacked
    expert weights (experts, rows, cols), each expert quantized on its own along its last axis (`quantize`; `imp`
    (experts, cols): each expert's column importances, None: plain rounding), as mlx-lm's QuantizedSwitchLinear
    stores them."""
    import torch

    parts = [quantize(w[e], bits, group_size, None if imp is None else imp[e], dtype) for e in range(w.shape[0])]
    return (np.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]),
            torch.stack([p[2] for p in parts]))
