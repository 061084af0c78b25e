"""numba ports of ggml-quants.c's IQ4_NL / IQ4_XS quantizers: compiled scalar loops that mirror the C.

One compiled pass per type (``_iq4_rows``: the scale searches of quantize_row_iq4_nl_impl, the
re-picked indices and the nibble/scale packing, written straight into the block bytes) and one numpy
step, the fp16 rounding of the float32 super-block scale d into the first two bytes (numpy's float16
cast is GGML_FP32_TO_FP16). Unlike the k-quants, llama.cpp re-picks the indices from the float32 d,
not the fp16-rounded one, so nothing needs a second compiled pass. quantkit.gguf.iquants holds the
numpy reference these are tested against; the floating point rules are in quantkit/gguf/quants.py.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT

from quantkit.gguf.iquants import KVF, NTRY
from quantkit.gguf.kquants_numba import jit, nint
from quantkit.gguf.kquants_numpy import fp16_bits

F32 = np.float32
QK_K = 256


@jit
def best_index(kv, x):
    """best_index_int8(16, kvalues, x), line for line."""
    if x <= kv[0]:
        return 0
    if x >= kv[15]:
        return 15
    ml, mu = 0, 15
    while mu - ml > 1:
        mav = (ml + mu) // 2
        if x < kv[mav]:
            mu = mav
        else:
            ml = mav
    return mu - 1 if x - kv[mu - 1] < kv[mu] - x else mu


@jit
def _fit(kv, xb, w, iscale):
    """(sum w*q*x, sum w*q*q) of one 32-value sub-block at inverse scale iscale."""
    sumqx, sumq2 = F32(0), F32(0)
    for j in range(32):
        q = kv[best_index(kv, iscale * xb[j])]
        sumqx += w[j] * q * xb[j]
        sumq2 += w[j] * q * q
    return sumqx, sumq2


@jit
def scale_search(kv, xb, w):
    """The per-sub-block scale of quantize_row_iq4_nl_impl (ntry = 7); 0 below GROUP_MAX_EPS."""
    amax, vmax = F32(0), F32(0)
    for j in range(32):
        ax = abs(xb[j])
        if ax > amax:
            amax = ax
            vmax = xb[j]
    if amax < F32(1e-15):
        return F32(0)
    d = -vmax / kv[0]
    sumqx, sumq2 = _fit(kv, xb, w, F32(1) / d)
    d = sumqx / sumq2 if sumq2 > 0 else F32(0)
    best = d * sumqx
    for itry in range(-NTRY, NTRY + 1):
        sumqx, sumq2 = _fit(kv, xb, w, (F32(itry) + kv[0]) / vmax)
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            d = sumqx / sumq2
            best = d * sumqx
    return d


@jit
def _weights(xb, qw, off, super_block, w):
    """The weights of super-block xb's 32 values at offset off: x^2, or qw*sqrt(sigma2 + x^2)."""
    if qw.shape[0] == 0:
        for j in range(super_block):
            w[j] = xb[j] * xb[j]
        return
    sigma2 = F32(0)
    for j in range(super_block):
        sigma2 += xb[j] * xb[j]
    sigma2 *= F32(2.0 / super_block)
    for j in range(super_block):
        w[j] = qw[off + j] * np.sqrt(sigma2 + xb[j] * xb[j])


@jit
def _pack(kv, xb, inv, ob, start):
    """Indices of 32 values at inverse scale inv, nibble-packed into ob[start:start + 16]."""
    for j in range(16):
        lo = best_index(kv, inv * xb[j])
        hi = best_index(kv, inv * xb[16 + j])
        ob[start + j] = lo | (hi << 4)


@jit
def _iq4_nl_rows(kv, x, qw, d, out):
    """quantize_iq4_nl: per 32 values, the scale search, then indices from the float32 d."""
    w = np.empty(32, F32)
    nblock = x.shape[1] // 32
    for r in range(x.shape[0]):
        for ib in range(nblock):
            xb = x[r, 32 * ib:32 * ib + 32]
            _weights(xb, qw, 32 * ib, 32, w)
            s = scale_search(kv, xb, w)
            b = r * nblock + ib
            d[b] = s
            _pack(kv, xb, F32(1) / s if s != 0 else F32(0), out[b], 2)


@jit
def _iq4_xs_rows(kv, x, qw, d, out):
    """quantize_iq4_xs: 8 sub-block scale searches, d = -max_scale/32, 6-bit sub-block scales,
    indices from the float32 d*l."""
    w = np.empty(QK_K, F32)
    scales = np.empty(8, F32)
    nblock = x.shape[1] // QK_K
    for r in range(x.shape[0]):
        for ibl in range(nblock):
            xs = x[r, QK_K * ibl:QK_K * ibl + QK_K]
            _weights(xs, qw, QK_K * ibl, QK_K, w)
            max_scale, amax_scale = F32(0), F32(0)
            for ib in range(8):
                s = scale_search(kv, xs[32 * ib:32 * ib + 32], w[32 * ib:32 * ib + 32])
                scales[ib] = s
                if abs(s) > amax_scale:
                    amax_scale = abs(s)
                    max_scale = s
            b = r * nblock + ibl
            ob = out[b]
            db = -max_scale / F32(32)
            d[b] = db
            inv = F32(1) / db if db != 0 else F32(0)
            scales_h = 0
            for ib in range(8):
                l = max(-32, min(31, nint(inv * scales[ib])))
                dl = db * F32(l)
                _pack(kv, xs[32 * ib:32 * ib + 32], F32(1) / dl if dl != 0 else F32(0), ob, 8 + 16 * ib)
                l += 32
                if ib % 2 == 0:
                    ob[4 + ib // 2] = l & 0xF
                else:
                    ob[4 + ib // 2] |= (l & 0xF) << 4
                scales_h |= (l >> 4) << (2 * ib)
            ob[2] = scales_h & 0xFF
            ob[3] = scales_h >> 8


def _run(rows_kernel, x, qw, block, type_size):
    x = np.ascontiguousarray(x, F32)
    nb = x.size // block
    out = np.empty((nb, type_size), np.uint8)
    d = np.empty(nb, F32)
    rows_kernel(KVF, x.reshape(-1, x.shape[-1]), np.empty(0, F32) if qw is None else qw, d, out)
    out[:, 0:2] = fp16_bits(d)
    return out


def iq4_nl(x, qw=None):
    """Rows (rows, n_per_row), n_per_row % 32 == 0 -> (blocks, 18): d f16 | qs[16]."""
    return _run(_iq4_nl_rows, x, qw, 32, 18)


def iq4_xs(x, qw=None):
    """Rows (rows, n_per_row), n_per_row % 256 == 0 -> (blocks, 136): d f16 | scales_h u16 | scales_l[4] | qs[128]."""
    return _run(_iq4_xs_rows, x, qw, QK_K, 136)


# kernel(x (rows, n_per_row) float32, qw (n_per_row,) or None) -> (blocks, block_bytes) uint8
KERNELS = {QT.IQ4_NL: iq4_nl, QT.IQ4_XS: iq4_xs}
