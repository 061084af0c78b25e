"""numpy ports of ggml-quants.c's reference quantizers, vectorized across blocks.

The fallback when numba is missing, and the cross-check of quantkit.gguf.kquants_numba in the
tests. Every function mirrors one C function of ggml/src/ggml-quants.c (llama.cpp 0c1e570) and is
bit-exact with it; the floating point rules are listed in quantkit/gguf/quants.py.

Layout of this module:
* helpers: nearest_int, sequential sums, fp16 rounding;
* the scale searches make_qx/q3/qkx/qp_quants (vectorized over sub-blocks);
* bit packing of each block format;
* one kernel per type, ``qX(x, qw, s)`` -> (blocks, block_bytes) uint8. ``s`` is the set of
  searches to use (``SEARCH`` here, or kquants_numba.SEARCH: same results, compiled).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

F32 = np.float32
QK_K = 256
GROUP_MAX_EPS = F32(1e-15)
_MAGIC = F32(12582912.0)  # 1.5 * 2**23


# ----------------------------------------------------------------------------- helpers

def nearest_int(f: np.ndarray) -> np.ndarray:
    """ggml-quants.c nearest_int: f + 1.5*2^23 in float32, low mantissa bits (ties to even)."""
    bits = (np.asarray(f, dtype=F32) + _MAGIC).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def seq_sum(a: np.ndarray) -> np.ndarray:
    """Left-to-right float32 sum over the last axis (a C `for` loop with `s += a[i]`)."""
    return np.cumsum(a, axis=-1, dtype=F32)[..., -1]


def fp16_bits(v: np.ndarray) -> np.ndarray:
    """GGML_FP32_TO_FP16 (round to nearest even), as raw little-endian bytes (..., 2)."""
    h = np.asarray(v, dtype=F32).astype(np.float16)
    return h.view(np.uint8).reshape(*h.shape, 2)


def fp16_round(v: np.ndarray) -> np.ndarray:
    """GGML_FP16_TO_FP32(GGML_FP32_TO_FP16(v))."""
    return np.asarray(v, dtype=F32).astype(np.float16).astype(F32)


def abs_argmax_value(x: np.ndarray) -> np.ndarray:
    """Signed value with the largest |x| along the last axis; the first one on ties."""
    idx = np.abs(x).argmax(axis=-1)[..., None]
    return np.take_along_axis(x, idx, axis=-1)[..., 0]


def as_f(a: np.ndarray) -> np.ndarray:
    return a.astype(F32)


# ---------------------------------------------------------------- scale/quant searches
# numpy versions of the four searches; see kquants_numba for the compiled ones.

def make_qx_quants(x: np.ndarray, w: np.ndarray | None, nmax: int):
    """make_qx_quants(n, nmax, x, L, rmse_type=1, qw): symmetric scale search.

    x, w: (m, n). w=None means w = x*x. Returns (scale (m,), L (m, n) int in 0..2*nmax-1).
    """
    if w is None:
        w = x * x
    vmax = abs_argmax_value(x)
    zero = np.abs(vmax) < GROUP_MAX_EPS
    wx = w * x

    def try_scale(iscale):
        l = np.clip(nearest_int(iscale[:, None] * x), -nmax, nmax - 1)
        lf = as_f(l)
        return l, seq_sum(wx * lf), seq_sum(w * lf * lf)

    with np.errstate(divide="ignore", invalid="ignore"):
        L, sumlx, suml2 = try_scale(F32(-nmax) / vmax)
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0)).astype(F32)
        best = scale * sumlx
        for i in range(-9, 10):
            if i == 0:
                continue
            l, slx, sl2 = try_scale(-(F32(nmax) + F32(0.1) * F32(i)) / vmax)
            better = (sl2 > 0) & (slx * slx > best * sl2)
            L = np.where(better[:, None], l, L)
            scale = np.where(better, slx / sl2, scale)
            best = np.where(better, scale * slx, best)
    L = np.where(zero[:, None], 0, L + nmax)
    return np.where(zero, F32(0), scale), L


def make_q3_quants(x: np.ndarray, nmax: int):
    """make_q3_quants(n, nmax, x, L, do_rmse=true): w = x*x, then coordinate descent.

    Returns (scale (m,), L (m, n) int in 0..2*nmax-1).
    """
    w = x * x
    wx = w * x
    vmax = abs_argmax_value(x)
    zero = np.abs(vmax) < GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore"):
        L = np.clip(nearest_int((F32(-nmax) / vmax)[:, None] * x), -nmax, nmax - 1)
        sumlx = seq_sum(wx * as_f(L))
        suml2 = seq_sum(w * as_f(L) * as_f(L))
        for _ in range(5):
            changed = False
            for i in range(x.shape[1]):
                sumlx, suml2, c = _q3_refine_one(x[:, i], w[:, i], wx[:, i], L, i, sumlx, suml2, nmax)
                changed |= c
            if not changed:  # per sub-block: a pass without change leaves the state unchanged
                break
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0)).astype(F32)
    L = np.where(zero[:, None], 0, L + nmax)
    return np.where(zero, F32(0), scale), L


def _q3_refine_one(xi, wi, wxi, L, i, sumlx, suml2, nmax):
    """One step of make_q3_quants' inner loop for element i of every sub-block (in place on L)."""
    li = as_f(L[:, i])
    slx = sumlx - wxi * li
    sl2 = suml2 - wi * li * li
    new_l = np.clip(nearest_int(xi * sl2 / slx), -nmax, nmax - 1)
    nl = as_f(new_l)
    slx2 = slx + wxi * nl
    sl22 = sl2 + wi * nl * nl
    ok = (slx > 0) & (new_l != L[:, i]) & (sl22 > 0) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
    L[:, i] = np.where(ok, new_l, L[:, i])
    return np.where(ok, slx2, sumlx), np.where(ok, sl22, suml2), bool(ok.any())


def make_qkx_quants(x, w, nmax, rmin, rdelta, nstep, use_mad):
    """make_qkx2_quants / make_qkx3_quants (identical when weights are given): scale + min.

    x, w: (m, n). Returns (scale (m,), the_min (m,) >= 0, L (m, n) int in 0..nmax).
    """
    xmin = np.minimum(x.min(axis=1), F32(0))
    xmax = x.max(axis=1)
    flat = xmax == xmin
    sum_w = seq_sum(w)
    sum_x = seq_sum(w * x)

    def error(scale, vmin, L):
        diff = scale[:, None] * as_f(L) + vmin[:, None] - x
        return seq_sum(w * (np.abs(diff) if use_mad else diff * diff))

    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = F32(nmax) / (xmax - xmin)
        L = np.clip(nearest_int(iscale[:, None] * (x - xmin[:, None])), 0, nmax)
        scale = F32(1) / iscale
        vmin = xmin
        best = error(scale, vmin, L)
        for i in range(nstep + 1):
            # C keeps updating `min` in place: later steps measure from the best min so far
            iscale = (F32(rmin) + F32(rdelta) * F32(i) + F32(nmax)) / (xmax - vmin)
            laux = np.clip(nearest_int(iscale[:, None] * (x - vmin[:, None])), 0, nmax)
            this_scale, this_min, ok = _qkx_lsq(x, w, laux, sum_w, sum_x)
            cur = error(this_scale, this_min, laux)
            better = ok & (cur < best)
            L = np.where(better[:, None], laux, L)
            best = np.where(better, cur, best)
            scale = np.where(better, this_scale, scale)
            vmin = np.where(better, this_min, vmin)
    L = np.where(flat[:, None], 0, L)
    return np.where(flat, F32(0), scale), -np.where(flat, xmin, vmin), L


def _qkx_lsq(x, w, laux, sum_w, sum_x):
    """Weighted least squares for (scale, min) given quants, as in make_qkx2_quants."""
    lf = as_f(laux)
    wl = w * lf
    sum_l = seq_sum(wl)
    sum_l2 = seq_sum(wl * lf)
    sum_xl = seq_sum(wl * x)
    D = sum_w * sum_l2 - sum_l * sum_l
    this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
    this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
    pos = this_min > 0
    this_min = np.where(pos, F32(0), this_min)
    this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
    return this_scale, this_min, D > 0


def make_qp_quants(x: np.ndarray, w: np.ndarray, nmax: int):
    """make_qp_quants(n, nmax, x, L, quant_weights): positive scale for the sub-block scales.

    Returns (scale (m,), L (m, n) uint8 - C stores the quants in uint8_t and wraps).
    """
    vmax = np.maximum(x.max(axis=1), F32(0))
    zero = vmax < GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = F32(nmax) / vmax
        L8 = (nearest_int(iscale[:, None] * x) & 0xFF).astype(np.uint8)
        diff = x - (F32(1) / iscale)[:, None] * as_f(L8)
        best = seq_sum(w * diff * diff)
        for i in range(-4, 5):
            if i == 0:
                continue
            iscale_is = (F32(0.1) * F32(i) + F32(nmax)) / vmax
            l = np.minimum(nmax, nearest_int(iscale_is[:, None] * x))
            diff = x - (F32(1) / iscale_is)[:, None] * as_f(l)
            mse = seq_sum(w * diff * diff)
            better = mse < best
            best = np.where(better, mse, best)
            iscale = np.where(better, iscale_is, iscale)
        l = np.minimum(nmax, nearest_int(iscale[:, None] * x))
        wx = w * x
        sumlx = seq_sum(wx * as_f(l))
        suml2 = seq_sum(w * as_f(l) * as_f(l))
        L = l & 0xFF
        for _ in range(5):
            changed = False
            for i in range(x.shape[1]):
                sumlx, suml2, c = _qp_refine_one(x[:, i], w[:, i], wx[:, i], L, i, sumlx, suml2, nmax)
                changed |= c
            if not changed:
                break
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0)).astype(F32)
    L = np.where(zero[:, None], 0, L).astype(np.uint8)
    return np.where(zero, F32(0), scale), L


def _qp_refine_one(xi, wi, wxi, L, i, sumlx, suml2, nmax):
    """One step of make_qp_quants' refinement loop for element i (L holds uint8 values)."""
    li = as_f(L[:, i])
    slx = sumlx - wxi * li
    sl2 = suml2 - wi * li * li
    new_l = np.minimum(nmax, nearest_int(xi * sl2 / slx))
    nl = as_f(new_l)
    slx2 = slx + wxi * nl
    sl22 = sl2 + wi * nl * nl
    ok = (slx > 0) & (sl2 > 0) & (new_l != L[:, i]) & (slx2 * slx2 * suml2 > sumlx * sumlx * sl22)
    L[:, i] = np.where(ok, new_l & 0xFF, L[:, i])
    return np.where(ok, slx2, sumlx), np.where(ok, sl22, suml2), bool(ok.any())


# ------------------------------------------------------------------------- bit packing

def pack_scale_min_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K: 8 x (6-bit scale, 6-bit min) into 12 bytes (uint8 wrap like C).

    bytes 0..3: sc0..3 | (sc4..7 >> 4) << 6;  bytes 4..7: m0..3 | (m4..7 >> 4) << 6;
    bytes 8..11: (sc4..7 & 0xF) | (m4..7 & 0xF) << 4.
    """
    ls = ls.astype(np.uint8)
    lm = lm.astype(np.uint8)
    lo = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    mid = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    hi = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    return np.concatenate([lo, mid, hi], axis=1).astype(np.uint8)


def unpack_scale_min_k4(q: np.ndarray):
    """get_scale_min_k4 for j = 0..7: returns (sc, m), each (nb, 8) uint8."""
    sc_lo, m_lo = q[:, 0:4] & 63, q[:, 4:8] & 63
    sc_hi = (q[:, 8:12] & 0xF) | ((q[:, 0:4] >> 6) << 4)
    m_hi = (q[:, 8:12] >> 4) | ((q[:, 4:8] >> 6) << 4)
    return np.concatenate([sc_lo, sc_hi], axis=1), np.concatenate([m_lo, m_hi], axis=1)


def pack_q3_scales(l6: np.ndarray) -> np.ndarray:
    """Q3_K: 16 x 6-bit (already offset by +32) into 12 bytes.

    byte j (0..7) = low nibble of scale j | low nibble of scale j+8 << 4;
    byte 8+k = high 2 bits of scales k, k+4, k+8, k+12 at shifts 0, 2, 4, 6.
    """
    l6 = l6.astype(np.uint8)
    lo = (l6[:, :8] & 0xF) | ((l6[:, 8:] & 0xF) << 4)
    h = l6 >> 4
    hi = h[:, 0:4] | (h[:, 4:8] << 2) | (h[:, 8:12] << 4) | (h[:, 12:16] << 6)
    return np.concatenate([lo, hi], axis=1).astype(np.uint8)


def unpack_q3_scales(s: np.ndarray) -> np.ndarray:
    """Inverse of pack_q3_scales, minus 32: (nb, 16) int in -32..31."""
    lo = np.concatenate([s[:, :8] & 0xF, s[:, :8] >> 4], axis=1)
    shifts = np.repeat(np.arange(4, dtype=np.uint8) * 2, 4)
    hi = (np.tile(s[:, 8:12], (1, 4)) >> shifts) & 3
    return (lo | (hi << 4)).astype(np.int32) - 32


def pack_2bit(L: np.ndarray) -> np.ndarray:
    """Q2_K/Q3_K qs: per 128-half, qs[l] = L[l] | L[l+32]<<2 | L[l+64]<<4 | L[l+96]<<6."""
    q = L.astype(np.uint8).reshape(-1, 2, 4, 32)
    out = q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)
    return out.reshape(-1, 64)


def pack_nibbles_k(L: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K qs: per 64-chunk c, q[32c+l] = (L[64c+l] & 0xF) | (L[64c+32+l] & 0xF) << 4."""
    q = (L.astype(np.uint8) & 0xF).reshape(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def pack_q5_high(L: np.ndarray) -> np.ndarray:
    """Q5_K qh[l]: bit 2c = bit 4 of L[64c+l], bit 2c+1 = bit 4 of L[64c+32+l]."""
    h = (L.astype(np.uint8) >> 4).reshape(-1, 8, 32)
    shifts = np.arange(8, dtype=np.uint8)[None, :, None]
    return np.bitwise_or.reduce(h << shifts, axis=1).astype(np.uint8)


def pack_q6(L: np.ndarray):
    """Q6_K ql/qh per 128-half h: ql[l] = L[l]&F | (L[l+64]&F)<<4, ql[l+32] = L[l+32]&F |
    (L[l+96]&F)<<4, qh[l] = L[l]>>4 | (L[l+32]>>4)<<2 | (L[l+64]>>4)<<4 | (L[l+96]>>4)<<6."""
    q = L.astype(np.uint8).reshape(-1, 2, 4, 32)
    lo = q & 0xF
    ql = np.concatenate([lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2)
    h = q >> 4
    qh = h[:, :, 0] | (h[:, :, 1] << 2) | (h[:, :, 2] << 4) | (h[:, :, 3] << 6)
    return ql.reshape(-1, 128), qh.reshape(-1, 64)


# ---------------------------------------------------------------- legacy 32-blocks

def q8_0(x: np.ndarray, qw=None, s=None) -> np.ndarray:
    """quantize_row_q8_0_ref: d = amax/127, qs = roundf(x/d). Block: d f16 | int8 qs[32]."""
    b = x.reshape(-1, 32)
    d = np.abs(b).max(axis=1) / F32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)
    v = b * inv[:, None]
    t = np.trunc(v)  # roundf = half away from zero; v - trunc(v) is exact in float32
    qs = (t + np.where(np.abs(v - t) >= F32(0.5), np.sign(v), F32(0))).astype(np.int8).view(np.uint8)
    return np.concatenate([fp16_bits(d), qs], axis=1)


def _sym_legacy(b: np.ndarray, nmax: int):
    """quantize_row_q4_0_ref / q5_0_ref: d = max/-nmax, q = MIN(2nmax-1, (int8)(x/d + nmax+.5))."""
    d = abs_argmax_value(b) / F32(-nmax)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)
    q = np.trunc(b * inv[:, None] + F32(nmax + 0.5)).astype(np.int32)
    return d, np.minimum(2 * nmax - 1, q)


def _asym_legacy(b: np.ndarray, nmax: int):
    """quantize_row_q4_1_ref / q5_1_ref: d = (max-min)/nmax, q = (int)((x-min)/d + 0.5)."""
    vmin, vmax = b.min(axis=1), b.max(axis=1)
    d = (vmax - vmin) / F32(nmax)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, F32(1) / d, F32(0)).astype(F32)
    q = np.trunc((b - vmin[:, None]) * inv[:, None] + F32(0.5)).astype(np.int32)
    return d, vmin, np.minimum(nmax, q)


def _pack_legacy4(q: np.ndarray) -> np.ndarray:
    """Q4_0/Q4_1 qs[j] = q[j] | q[j+16] << 4 (elements 0..15 low nibbles)."""
    q = q.astype(np.uint8)
    return (q[:, :16] & 0xF) | ((q[:, 16:] & 0xF) << 4)


def _qh_legacy5(q: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1 qh: uint32 little endian, bit j = bit 4 of q[j]."""
    bits = ((q.astype(np.uint32) >> 4) & 1) << np.arange(32, dtype=np.uint32)
    return np.bitwise_or.reduce(bits, axis=1).astype("<u4").view(np.uint8).reshape(-1, 4)


def _row_weights(x: np.ndarray, qw: np.ndarray) -> np.ndarray:
    """Legacy *_impl weights: qw * sqrt(sigma2 + x^2), sigma2 = sum(x^2)/n_per_row per row."""
    sigma2 = seq_sum(x * x) / F32(x.shape[1])
    return qw[None, :] * np.sqrt(sigma2[:, None] + x * x)


def _sym_impl(x, qw, nmax, s):
    """quantize_row_q4_0_impl / q5_0_impl: make_qx_quants(32, nmax, ..., rmse_type 1, weights)."""
    w = _row_weights(x, qw).reshape(-1, 32)
    return s.make_qx_quants(x.reshape(-1, 32), w, nmax)


def q4_0(x, qw, s=None):
    """Block: d f16 | qs[16]. With imatrix: quantize_row_q4_0_impl (make_qx_quants, nmax 8)."""
    s = s or SEARCH
    d, q = _sym_legacy(x.reshape(-1, 32), 8) if qw is None else _sym_impl(x, qw, 8, s)
    return np.concatenate([fp16_bits(d), _pack_legacy4(q)], axis=1)


def q5_0(x, qw, s=None):
    """Block: d f16 | qh u32 | qs[16]. With imatrix: quantize_row_q5_0_impl (nmax 16)."""
    s = s or SEARCH
    d, q = _sym_legacy(x.reshape(-1, 32), 16) if qw is None else _sym_impl(x, qw, 16, s)
    return np.concatenate([fp16_bits(d), _qh_legacy5(q), _pack_legacy4(q)], axis=1)


def _asym_impl(x, qw, nmax, s):
    """quantize_row_q4_1_impl / q5_1_impl: make_qkx3_quants(32, nmax, ..., -0.9, 0.05, 36)."""
    w = _row_weights(x, qw).reshape(-1, 32)
    d, the_min, q = s.make_qkx_quants(x.reshape(-1, 32), w, nmax, -0.9, 0.05, 36, False)
    return d, -the_min, q


def q4_1(x, qw, s=None):
    """Block: d f16 | m f16 | qs[16]."""
    s = s or SEARCH
    d, m, q = _asym_legacy(x.reshape(-1, 32), 15) if qw is None else _asym_impl(x, qw, 15, s)
    return np.concatenate([fp16_bits(d), fp16_bits(m), _pack_legacy4(q)], axis=1)


def q5_1(x, qw, s=None):
    """Block: d f16 | m f16 | qh u32 | qs[16]."""
    s = s or SEARCH
    d, m, q = _asym_legacy(x.reshape(-1, 32), 31) if qw is None else _asym_impl(x, qw, 31, s)
    return np.concatenate([fp16_bits(d), fp16_bits(m), _qh_legacy5(q), _pack_legacy4(q)], axis=1)


# --------------------------------------------------------------------------- k-quants

def _block_qw(qw: np.ndarray, nb: int, sub: int) -> np.ndarray:
    """imatrix (n_per_row,) tiled over the rows of the chunk, as (nb * 256/sub, sub)."""
    rows = nb * QK_K // qw.size
    return np.broadcast_to(qw, (rows, qw.size)).reshape(-1, sub)


def _requant_asym(xs, d, dmin, sc, m, nmax, L):
    """Recompute quants with the fp16-rounded d/dmin: l = nearest_int((x + dmin*m)/(d*sc))."""
    dd = (d[:, None] * as_f(sc)).reshape(-1)
    dm = (dmin[:, None] * as_f(m)).reshape(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        l = np.clip(nearest_int((xs + dm[:, None]) / dd[:, None]), 0, nmax)
    return np.where((dd != 0)[:, None], l, L)


def _requant_sym(xs, d, sc, lo, hi, L):
    """Recompute quants: l = clamp(nearest_int(x/(d*sc)), lo, hi) - lo; skip when d*sc == 0."""
    dd = (d[:, None] * as_f(sc)).reshape(-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        l = np.clip(nearest_int(xs / dd[:, None]), lo, hi) - lo
    return np.where((dd != 0)[:, None], l, L)


def _k_sigma2(x: np.ndarray, factor: float) -> np.ndarray:
    """*_impl: sigma2 = factor*sum(x^2)/256 per super-block, sequential sum."""
    return F32(factor) * seq_sum(x * x) / F32(QK_K)


def q2_k(x, qw, s=None):
    """quantize_row_q2_K_ref / _impl. Block: scales[16] (lo: scale, hi: min) | qs[64] | d | dmin."""
    s = s or SEARCH
    nb = x.shape[0]
    xs = x.reshape(-1, 16)
    if qw is None:
        scales, mins, L = s.make_qkx_quants(xs, np.abs(xs), 3, -0.5, 0.1, 15, True)
        scales, mins = scales.reshape(nb, 16), mins.reshape(nb, 16)
        d, dmin, packed = _q2_k_ref_scales(scales, mins)
    else:
        sigma2 = np.repeat(_k_sigma2(x, 1.0), 16)
        w = _block_qw(qw, nb, 16) * np.sqrt(sigma2[:, None] + xs * xs)
        scales, mins, L = s.make_qkx_quants(xs, w, 3, -0.9, 0.05, 36, False)
        sw = seq_sum(w).reshape(nb, 16)
        d, Ls = s.make_qp_quants(scales.reshape(nb, 16), sw, 15)
        dmin, Lm = s.make_qp_quants(mins.reshape(nb, 16), sw, 15)
        packed = Ls | (Lm << 4)
    dh, dminh = fp16_bits(d), fp16_bits(dmin)
    L = _requant_asym(xs, fp16_round(d), fp16_round(dmin), packed & 0xF, packed >> 4, 3, L)
    return np.concatenate([packed, pack_2bit(L.reshape(nb, QK_K)), dh, dminh], axis=1)


def _q2_k_ref_scales(scales, mins):
    """quantize_row_q2_K_ref: 4-bit sub-block scales/mins against max/15 (uint8 wrap)."""
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    with np.errstate(divide="ignore", invalid="ignore"):
        ls = nearest_int((F32(15) / max_scale)[:, None] * scales)
        lm = nearest_int((F32(15) / max_min)[:, None] * mins)
    ls = np.where((max_scale > 0)[:, None], ls & 0xFF, 0)
    lm = np.where((max_min > 0)[:, None], (lm << 4) & 0xFF, 0)
    d = np.where(max_scale > 0, max_scale / F32(15), F32(0))
    dmin = np.where(max_min > 0, max_min / F32(15), F32(0))
    return d, dmin, (ls | lm).astype(np.uint8)


def q3_k(x, qw, s=None):
    """quantize_row_q3_K_ref / _impl. Block: hmask[32] | qs[64] | scales[12] | d."""
    s = s or SEARCH
    nb = x.shape[0]
    xs = x.reshape(-1, 16)
    if qw is None:
        scales, L = s.make_q3_quants(xs, 4)
        d, l6 = _q3_k_ref_scales(scales.reshape(nb, 16))
    else:
        sigma2 = np.repeat(_k_sigma2(x, 2.0), 16)
        w = _block_qw(qw, nb, 16) * np.sqrt(sigma2[:, None] + xs * xs)
        scales, L = s.make_qx_quants(xs, w, 4)
        d, l6 = s.make_qx_quants(scales.reshape(nb, 16), seq_sum(w).reshape(nb, 16), 32)
    packed = pack_q3_scales(l6)
    L = _requant_sym(xs, fp16_round(d), unpack_q3_scales(packed), -4, 3, L).reshape(nb, QK_K)
    high = L > 3
    hbits = high.reshape(nb, 8, 32).astype(np.uint8) << np.arange(8, dtype=np.uint8)[None, :, None]
    hmask = np.bitwise_or.reduce(hbits, axis=1).astype(np.uint8)
    qs = pack_2bit(np.where(high, L - 4, L))
    return np.concatenate([hmask, qs, packed, fp16_bits(d)], axis=1)


def _q3_k_ref_scales(scales):
    """quantize_row_q3_K_ref: 6-bit signed scales against the largest |scale| (iscale=-32/max)."""
    max_scale = abs_argmax_value(scales)
    nz = max_scale != 0
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = F32(-32) / max_scale
        l6 = np.clip(nearest_int(iscale[:, None] * scales), -32, 31) + 32
        d = np.where(nz, F32(1) / iscale, F32(0))
    return d, np.where(nz[:, None], l6, 0)


def _q45_k_scales(x, qw, nmax, ref_params, s):
    """Sub-block search shared by Q4_K/Q5_K: returns (d, dmin, packed scales[12], xs, L)."""
    nb = x.shape[0]
    xs = x.reshape(-1, 32)
    if qw is None:  # quantize_row_q{4,5}_K_ref
        av_x = np.sqrt(seq_sum(xs * xs) / F32(32))
        scales, mins, L = s.make_qkx_quants(xs, av_x[:, None] + np.abs(xs), nmax, *ref_params, False)
        d, dmin, ls, lm = _k4_ref_scales(scales.reshape(nb, 8), mins.reshape(nb, 8))
    else:  # quantize_row_q{4,5}_K_impl
        sigma2 = np.repeat(_k_sigma2(x, 2.0), 8)
        w = _block_qw(qw, nb, 32) * np.sqrt(sigma2[:, None] + xs * xs)
        scales, mins, L = s.make_qkx_quants(xs, w, nmax, -0.9, 0.05, 36, False)
        sw = seq_sum(w).reshape(nb, 8)
        d, ls = s.make_qp_quants(scales.reshape(nb, 8), sw, 63)
        dmin, lm = s.make_qp_quants(mins.reshape(nb, 8), sw, 63)
        if nmax == 31:  # only quantize_row_q5_K_impl clamps
            ls, lm = np.minimum(ls, 63), np.minimum(lm, 63)
    return d, dmin, pack_scale_min_k4(ls, lm), xs, L


def _k4_ref_scales(scales, mins):
    """Q4_K/Q5_K ref: ls = MIN(63, (uint8)nearest_int(63/max_scale*scale)), same for mins."""
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0)).astype(F32)
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0)).astype(F32)
    ls = np.minimum(63, nearest_int(inv_scale[:, None] * scales) & 0xFF)
    lm = np.minimum(63, nearest_int(inv_min[:, None] * mins) & 0xFF)
    return max_scale / F32(63), max_min / F32(63), ls, lm


def q4_k(x, qw, s=None):
    """Block: d f16 | dmin f16 | scales[12] | qs[128]."""
    s = s or SEARCH
    nb = x.shape[0]
    d, dmin, packed, xs, L = _q45_k_scales(x, qw, 15, (-1.0, 0.1, 20), s)
    sc, m = unpack_scale_min_k4(packed)
    L = _requant_asym(xs, fp16_round(d), fp16_round(dmin), sc, m, 15, L).reshape(nb, QK_K)
    return np.concatenate([fp16_bits(d), fp16_bits(dmin), packed, pack_nibbles_k(L)], axis=1)


def q5_k(x, qw, s=None):
    """Block: d f16 | dmin f16 | scales[12] | qh[32] | qs[128]."""
    s = s or SEARCH
    nb = x.shape[0]
    d, dmin, packed, xs, L = _q45_k_scales(x, qw, 31, (-0.5, 0.1, 15), s)
    sc, m = unpack_scale_min_k4(packed)
    L = _requant_asym(xs, fp16_round(d), fp16_round(dmin), sc, m, 31, L).reshape(nb, QK_K)
    parts = [fp16_bits(d), fp16_bits(dmin), packed, pack_q5_high(L), pack_nibbles_k(L)]
    return np.concatenate(parts, axis=1)


def q6_k(x, qw, s=None):
    """quantize_row_q6_K_ref / _impl. Block: ql[128] | qh[64] | int8 scales[16] | d."""
    s = s or SEARCH
    nb = x.shape[0]
    xs = x.reshape(-1, 16)
    w = None if qw is None else _block_qw(qw, nb, 16)  # _impl passes the raw imatrix
    scales, L = s.make_qx_quants(xs, w, 32)
    scales = scales.reshape(nb, 16)
    max_scale = abs_argmax_value(scales)
    zero = np.abs(max_scale) < GROUP_MAX_EPS
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = F32(-128) / max_scale
        d = np.where(zero, F32(0), F32(1) / iscale)
        sc = np.minimum(127, nearest_int(iscale[:, None] * scales))
    sc = np.where(zero[:, None], 0, sc)
    L = _requant_sym(xs, fp16_round(d), sc, -32, 31, L).reshape(nb, QK_K)
    ql, qh = pack_q6(L)
    out = np.concatenate([ql, qh, sc.astype(np.int8).view(np.uint8), fp16_bits(d)], axis=1)
    out[zero] = 0  # an all-zero block is memset to 0
    return out


# the four searches, passed to the kernels (kquants_numba.SEARCH has the same interface)
SEARCH = SimpleNamespace(make_qx_quants=make_qx_quants, make_q3_quants=make_q3_quants,
                         make_qkx_quants=make_qkx_quants, make_qp_quants=make_qp_quants)
