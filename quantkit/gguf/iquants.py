"""numpy ports of ggml-quants.c's 4-bit non-linear quantizers IQ4_NL and IQ4_XS, vectorized across blocks.

The reference of quantkit.gguf.iquants_numba (the compiled kernels quants.py uses) and the fallback when
numba is missing; bit-exact with llama.cpp 0c1e570 under the floating point rules listed in
quantkit/gguf/quants.py.

Both types store 4-bit indices into one 16-entry table of int8 values (``kvalues_iq4nl``) and are
made by ``quantize_row_iq4_nl_impl`` with ``ntry = 7``, with or without an imatrix (ggml_quantize_chunk
calls ``quantize_iq4_nl`` / ``quantize_iq4_xs``, never the ``_ref`` rows):

* per 32 values a scale search: d from the signed absmax (max/127), then 15 trial inverse scales
  (itry - 127)/max, each scored by the weighted least-squares fit of the table values
  (weights x^2 without an imatrix, qw * sqrt(sigma2 + x^2) with one, sigma2 = 2*mean(x^2) over the
  super-block);
* IQ4_NL (block 32: d f16 | qs[16]): d = the sub-block's scale, indices re-picked with the float32 d;
* IQ4_XS (block 256: d f16 | scales_h u16 | scales_l[4] | qs[128]): d = -max_scale/32 over the 8
  sub-block scales, each sub-block scale a 6-bit l in -32..31 (stored +32, low nibbles in scales_l,
  high 2 bits in scales_h), indices re-picked with the float32 d*l.

Indices are nibble-packed like Q4_0: qs[16i + j] = L[32i + j] | L[32i + 16 + j] << 4.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT

from quantkit.gguf.kquants_numpy import fp16_bits, nearest_int, seq_sum

F32 = np.float32
QK_K = 256
NTRY = 7
GROUP_MAX_EPS = F32(1e-15)
KVALUES_IQ4NL = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int8)
KVF = KVALUES_IQ4NL.astype(F32)


def best_index(x: np.ndarray) -> np.ndarray:
    """best_index_int8(16, kvalues_iq4nl, x): the nearest table entry, the upper one unless the lower
    is strictly nearer (the binary search of C ends between val[mu-1] <= x < val[mu])."""
    x = np.asarray(x, F32)
    mu = np.clip(np.searchsorted(KVF, x, side="right"), 1, 15)
    lower = (x - KVF[mu - 1]) < (KVF[mu] - x)
    idx = np.where(lower, mu - 1, mu)
    idx = np.where(x <= KVF[0], 0, idx)
    return np.where((x >= KVF[15]) | np.isnan(x), 15, idx)  # NaN: every comparison fails, mu ends at 15


def _fit(x: np.ndarray, w: np.ndarray, iscale: np.ndarray):
    """Indices at inverse scale `iscale` (per sub-block) and the sequential sums of w*q*x and w*q*q."""
    L = best_index(iscale[:, None] * x)
    wq = w * KVF[L]
    return L, seq_sum(wq * x), seq_sum(wq * KVF[L])


def weights(x: np.ndarray, qw: np.ndarray | None, super_block: int) -> np.ndarray:
    """quantize_row_iq4_nl_impl's weights of x (m, super_block): x^2, or qw*sqrt(sigma2 + x^2)."""
    if qw is None:
        return x * x
    sigma2 = seq_sum(x * x) * F32(2.0 / super_block)
    rows = x.shape[0] * super_block // qw.size
    qwb = np.broadcast_to(qw, (rows, qw.size)).reshape(-1, super_block)  # the imatrix tiled over the rows
    return qwb * np.sqrt(sigma2[:, None] + x * x)


def sub_block_scales(xs: np.ndarray, ws: np.ndarray) -> np.ndarray:
    """The scale search of quantize_row_iq4_nl_impl for each 32-value sub-block (rows of xs): float32 d,
    0 where the sub-block's absmax is below GROUP_MAX_EPS."""
    amax_idx = np.abs(xs).argmax(axis=1)
    vmax = xs[np.arange(xs.shape[0]), amax_idx]
    zero = np.abs(vmax) < GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        d = (-vmax) / F32(KVALUES_IQ4NL[0])
        _, sumqx, sumq2 = _fit(xs, ws, F32(1) / d)
        d = np.where(sumq2 > 0, sumqx / sumq2, F32(0)).astype(F32)
        best = d * sumqx
        for itry in range(-NTRY, NTRY + 1):
            _, sumqx, sumq2 = _fit(xs, ws, F32(itry + int(KVALUES_IQ4NL[0])) / vmax)
            better = (sumq2 > 0) & (sumqx * sumqx > best * sumq2)
            d = np.where(better, sumqx / sumq2, d).astype(F32)
            best = np.where(better, d * sumqx, best).astype(F32)
    return np.where(zero, F32(0), d).astype(F32)


def pack_nibbles(L: np.ndarray) -> np.ndarray:
    """qs[16i + j] = L[32i + j] | L[32i + 16 + j] << 4, over rows of 32-multiples."""
    q = L.astype(np.uint8).reshape(L.shape[0], -1, 2, 16)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(L.shape[0], -1)


def _inverse(v: np.ndarray) -> np.ndarray:
    """C's `v ? 1/v : 0` in float32."""
    with np.errstate(divide="ignore"):
        return np.where(v != 0, F32(1) / v, F32(0)).astype(F32)


def iq4_nl(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """quantize_iq4_nl over rows x (rows, n_per_row), n_per_row % 32 == 0 -> (blocks, 18) uint8."""
    xs = np.ascontiguousarray(x, F32).reshape(-1, 32)
    d = sub_block_scales(xs, weights(xs, qw, 32))
    with np.errstate(over="ignore", invalid="ignore"):
        L = best_index(_inverse(d)[:, None] * xs)
    return np.concatenate([fp16_bits(d), pack_nibbles(L)], axis=1)


def iq4_xs(x: np.ndarray, qw: np.ndarray | None = None) -> np.ndarray:
    """quantize_iq4_xs over rows x (rows, n_per_row), n_per_row % 256 == 0 -> (blocks, 136) uint8."""
    xb = np.ascontiguousarray(x, F32).reshape(-1, QK_K)
    nb = xb.shape[0]
    ws = weights(xb, qw, QK_K).reshape(-1, 32)
    scales = sub_block_scales(xb.reshape(-1, 32), ws).reshape(nb, 8)
    abs_d = np.abs(scales)
    abs_d[np.isnan(abs_d)] = 0  # C's `fabsf(d) > amax_scale` is false for NaN
    idx = abs_d.argmax(axis=1)  # the first largest |d|; none above 0: max_scale = 0
    max_scale = np.where(abs_d[np.arange(nb), idx] > 0, scales[np.arange(nb), idx], F32(0))
    with np.errstate(over="ignore", invalid="ignore"):
        d = (-max_scale) / F32(32)  # -0.0 when every scale is 0, as in C
        l = np.clip(nearest_int(_inverse(d)[:, None] * scales), -32, 31)
        dl = d[:, None] * l.astype(F32)
        L = best_index(_inverse(dl).reshape(-1, 1) * xb.reshape(-1, 32)).reshape(nb, QK_K)
    u = (l + 32).astype(np.uint16)
    scales_l = ((u[:, 0::2] & 0xF) | ((u[:, 1::2] & 0xF) << 4)).astype(np.uint8)
    scales_h = np.bitwise_or.reduce((u >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=1).astype("<u2")
    return np.concatenate([fp16_bits(d), scales_h.view(np.uint8).reshape(nb, 2), scales_l, pack_nibbles(L)],
                          axis=1)


# kernel(x (rows, n_per_row) float32, qw (n_per_row,) or None) -> (blocks, block_bytes) uint8
KERNELS = {QT.IQ4_NL: iq4_nl, QT.IQ4_XS: iq4_xs}
