"""numba ports of ggml-quants.c's grid-based i-quant quantizers, bit-exact with llama.cpp.

One whole-row kernel per type (``iq3_xxs``, ``iq3_s``, ``iq2_xxs``, ``iq2_xs``, ``iq2_s``,
``iq1_s``, ``iq1_m``) with the interface of quants._FUSED: ``kernel(x (rows, n_per_row) float32,
qw (n_per_row,) float32 or None) -> (blocks, block_bytes) uint8``. Each mirrors its
``quantize_row_*_impl``: the sign split, the scale search over the grid (with the neighbour
lists of quantkit.gguf.iquants_grid for keys off the grid), the 4-bit (IQ1: 3-bit) block scales
and the bit layout of the block. The compiled part returns each block's float32 super-scale;
the fp16 rounding (GGML_FP32_TO_FP16, numpy's float16 cast) and its bytes are done in numpy.

IQ2_XXS, IQ2_XS and IQ1_S need an imatrix (llama.cpp asserts one); the others have a path
without one, ported too (``quant_weights == NULL``).

Bit-exact rules are those of kquants_numba: float32 everywhere, sums left to right, no fastmath,
nearest_int by the magic-number trick, C's integer stores emulated. Two C details kept on
purpose: the IQ1 searches sort values with glibc's qsort, a stable merge sort for these sizes
(here a stable insertion sort), and quantize_row_iq3_s_impl advances its qs/signs write position
only for sub-blocks that are not all zero (an all-zero sub-block shifts the later ones).
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as QT

from quantkit.gguf.iquants_grid import grid_tables
from quantkit.gguf.kquants_numba import jit, nint, numba, qp_one
from quantkit.gguf.kquants_numpy import fp16_bits

F32 = np.float32
QK_K = 256
FLT_MAX = F32(np.finfo(np.float32).max)
# hot helpers inlined into their callers by numba (no call and array reference-count overhead)
jit_inline = numba.njit(cache=True, nogil=True, error_model="numpy", inline="always") if numba else jit


# ------------------------------------------------------------------ shared pieces

@jit
def _sigma2(xb, factor):
    """sigma2 = factor*sumx2/QK_K over one super-block (sum left to right)."""
    s = F32(0)
    for i in range(QK_K):
        s += xb[i] * xb[i]
    return factor * s / F32(QK_K)


@jit_inline
def _weights(xb, start, n, qw, off, sigma2, no_qw_sigma, weight):
    """weight = qw*sqrt(sigma2 + x^2) with an imatrix; without: x^2 (+ 0.25*sigma2 for IQ2_S)."""
    for i in range(n):
        v = xb[start + i]
        if qw.shape[0] > 0:
            weight[i] = qw[off + start + i] * np.sqrt(sigma2 + v * v)
        elif no_qw_sigma:
            weight[i] = F32(0.25) * sigma2 + v * v
        else:
            weight[i] = v * v


@jit
def _abs_signs(xb, start, n, xval, signs):
    """xval = |x| (C: x >= 0 ? x : -x) and one sign byte per group of 8."""
    for k in range(n // 8):
        s = 0
        for i in range(8):
            v = xb[start + 8 * k + i]
            if v >= 0:
                xval[8 * k + i] = v
            else:
                xval[8 * k + i] = -v
                s |= 1 << i
        signs[k] = s


@jit
def _even_signs(xb, start, n, weight, xval, signs):
    """As _abs_signs, then an odd count of negatives flips the least important value
    (smallest w*x^2) so the 7 stored sign bits imply the 8th (IQ2_XXS, IQ2_XS, IQ3_XXS)."""
    _abs_signs(xb, start, n, xval, signs)
    for k in range(n // 8):
        s = signs[k]
        nflip = 0
        for i in range(8):
            nflip += (s >> i) & 1
        if nflip % 2:
            imin = 0
            v = xb[start + 8 * k]
            mn = weight[8 * k] * v * v
            for i in range(1, 8):
                v = xb[start + 8 * k + i]
                ax = weight[8 * k + i] * v * v
                if ax < mn:
                    mn = ax
                    imin = i
            xval[8 * k + imin] = -xval[8 * k + imin]
            s ^= 1 << imin
        signs[k] = s & 127


@jit_inline
def _fmax(a, n):
    """C's max = a[0]; max = MAX(max, a[i])."""
    m = a[0]
    for i in range(1, n):
        if not m > a[i]:
            m = a[i]
    return m


@jit_inline
def _key(L, start, dim, bits):
    u = 0
    for i in range(dim):
        u |= L[start + i] << (bits * i)
    return u


@jit_inline
def _best_neighbour(neigh, pos, grid, xval, waux, start, scale, L):
    """iq2_find_best_neighbour / iq3_find_best_neighbour: the listed point with the least
    sum w*(scale*q - x)^2 (first on ties); writes its levels into L[start:]."""
    dim = grid.shape[1]
    best_d2 = FLT_MAX
    gi = -1
    for j in range(1, neigh[pos] + 1):
        p = neigh[pos + j]
        d2 = F32(0)
        for i in range(dim):
            diff = scale * grid[p, i] - xval[start + i]
            d2 += waux[start + i] * diff * diff
        if d2 < best_d2:
            best_d2 = d2
            gi = p
    if gi < 0:
        raise ValueError("i-quant grid search found no point (non-finite input?)")
    for i in range(dim):
        L[start + i] = (np.int64(grid[gi, i]) - 1) // 2
    return gi


@jit_inline
def _round_groups(xval, n, id_, kmaxq, bits, grid, kmap, neigh, waux, scale, L, on_grid, skip):
    """Levels l = clamp(nearest_int(0.5*(id*x - 1))) per group; an off-grid group takes its best
    neighbour at `scale`. on_grid[k] says whether group k's key was on the grid. Groups with
    skip[k] (if skip is not empty) are left alone."""
    dim = grid.shape[1]
    for k in range(n // dim):
        if skip.shape[0] > 0 and skip[k]:
            continue
        u = 0
        for i in range(dim):
            l = max(0, min(kmaxq - 1, nint(F32(0.5) * (id_ * xval[dim * k + i] - F32(1)))))
            L[dim * k + i] = l
            u |= l << (bits * i)
        on_grid[k] = kmap[u] >= 0
        if not on_grid[k]:
            _best_neighbour(neigh, -kmap[u] - 1, grid, xval, waux, dim * k, scale, L)


@jit_inline
def _sums(weight, xval, L, n):
    """sumqx = sum w*x*q, sumq2 = sum w*q*q with q = 2*L + 1."""
    sumqx, sumq2 = F32(0), F32(0)
    for i in range(n):
        q = F32(2 * L[i] + 1)
        sumqx += weight[i] * xval[i] * q
        sumq2 += weight[i] * q * q
    return sumqx, sumq2


@jit
def _grid_search(xval, weight, waux, n, kmaxq, bits, nis, step, vmax, scale, on_init, refit_all, need_off,
                 grid, kmap, neigh, L, Laux, on, on_aux):
    """The scale search shared by IQ2_XXS/XS/S and IQ3_XXS/S.

    Trial scales id = (2*kmaxq - 1 + is*step)/vmax, is = -nis..nis; the best sumqx^2/sumq2 wins.
    Then the groups are rounded again at the best scale and the scale refit: all groups
    (refit_all) or only those off the grid, when any is (need_off) and the scale is > 0.
    Returns the scale; L holds the levels."""
    ngroups = n // grid.shape[1]
    best = F32(0)
    for k in range(ngroups):
        on[k] = on_init
    for is_ in range(-nis, nis + 1):
        id_ = (F32(2 * kmaxq - 1) + F32(is_) * step) / vmax
        _round_groups(xval, n, id_, kmaxq, bits, grid, kmap, neigh, waux, F32(1) / id_, Laux, on_aux, on[:0])
        sumqx, sumq2 = _sums(weight, xval, Laux, n)
        if sumq2 > 0 and sumqx * sumqx > best * sumq2:
            scale = sumqx / sumq2
            best = scale * sumqx
            L[:n] = Laux[:n]
            on[:ngroups] = on_aux[:ngroups]
    n_off = 0
    for k in range(ngroups):
        if not on[k]:
            n_off += 1
    if (n_off > 0 or not need_off) and scale > 0:
        id_ = F32(1) / scale
        _round_groups(xval, n, id_, kmaxq, bits, grid, kmap, neigh, waux, scale, Laux, on_aux,
                      on[:0] if refit_all else on)
        dim = grid.shape[1]
        for k in range(ngroups):
            if refit_all or not on[k]:
                L[dim * k:dim * k + dim] = Laux[dim * k:dim * k + dim]
        sumqx, sumq2 = _sums(weight, xval, L, n)
        if sumq2 > 0:
            scale = sumqx / sumq2
    return scale


@jit
def _grid_index(L, start, dim, bits, kmap):
    gi = kmap[_key(L, start, dim, bits)]
    if gi < 0:
        raise ValueError("i-quant: point not on grid")
    return gi


@jit_inline
def _scale_nibble(id_, s):
    """nearest_int(0.5*(id*scale - 1)) clamped to 0..15."""
    return max(0, min(15, nint(F32(0.5) * (id_ * s - F32(1)))))


def _prepare(x, qw, qtype):
    """(blocks of 256, imatrix or empty, blocks per row, (grid, kmap, neighbours)). The kernels get
    the grid as they use it: float32 coordinates (IQ2/IQ3), int levels 0..2 (IQ1, C's (q - 1)/2)."""
    xb = np.ascontiguousarray(x, dtype=F32).reshape(-1, QK_K)
    bpr = x.shape[-1] // QK_K
    qw_arr = np.empty(0, F32) if qw is None else np.ascontiguousarray(qw, dtype=F32)
    grid, kmap, neigh = grid_tables(qtype)
    if qtype in (QT.IQ1_S, QT.IQ1_M):
        grid = (grid.astype(np.int64) - 1) // 2
    else:
        grid = grid.astype(F32)
    return xb, qw_arr, bpr, (grid, kmap, neigh)


def _with_d(out, d, at=0):
    out[:, at:at + 2] = fp16_bits(d)
    return out


# ------------------------------------------------------------------ IQ2_XXS

@jit
def _iq2_xxs(x, qw, bpr, grid, kmap, neigh, d, out):
    """quantize_row_iq2_xxs_impl: 8 groups of 32; qs = 2 uint32 per group (4 grid bytes; 4x7 sign
    bits | scale << 28)."""
    weight, waux, xval = np.empty(32, F32), np.empty(32, F32), np.empty(32, F32)
    L, Laux = np.zeros(32, np.int64), np.zeros(32, np.int64)
    lq = np.empty(32, np.uint8)
    on, on_aux = np.empty(4, np.bool_), np.empty(4, np.bool_)
    signs = np.empty(4, np.int64)
    scales = np.empty(8, F32)
    q2 = np.empty(16, np.int64)
    for b in range(x.shape[0]):
        xbl = x[b]
        off = (b % bpr) * QK_K
        q2[:] = 0
        max_scale = F32(0)
        sigma2 = _sigma2(xbl, F32(1))
        for ib in range(8):
            _weights(xbl, 32 * ib, 32, qw, off, sigma2, False, weight)
            for i in range(32):
                waux[i] = np.sqrt(weight[i])
            _even_signs(xbl, 32 * ib, 32, weight, xval, signs)
            if _fmax(xval, 32) < F32(1e-15):
                scales[ib] = 0
                continue
            scale = qp_one(xval, weight, 4, lq)
            L[:] = lq
            eff_max = scale * F32(3)
            if eff_max <= 0:
                scales[ib] = 0
                continue
            scale = _grid_search(xval, weight, waux, 32, 3, 2, 6, F32(0.1), eff_max, scale, True, True, False,
                                 grid, kmap, neigh, L, Laux, on, on_aux)
            if scale < 0:
                scale = -scale
                for k in range(4):
                    signs[k] = (~signs[k]) & 127
            for k in range(4):
                q2[2 * ib] |= _grid_index(L, 8 * k, 8, 2, kmap) << (8 * k)
                q2[2 * ib + 1] |= signs[k] << (7 * k)
            scales[ib] = scale
            max_scale = max(max_scale, scale)
        ob = out[b]
        if max_scale == 0:
            d[b] = 0
            ob[:] = 0
            continue
        dd = max_scale / F32(31)
        d[b] = dd
        id_ = F32(1) / dd
        for ib in range(8):
            q2[2 * ib + 1] |= _scale_nibble(id_, scales[ib]) << 28
        for j in range(16):
            for t in range(4):
                ob[2 + 4 * j + t] = (q2[j] >> (8 * t)) & 0xFF


def iq2_xxs(x, qw=None):
    """Block: d f16 | qs uint16[32]. Needs the imatrix (qw)."""
    if qw is None:
        raise ValueError("IQ2_XXS needs an imatrix")
    xb, qw_arr, bpr, (grid, kmap, neigh) = _prepare(x, qw, QT.IQ2_XXS)
    d, out = np.empty(xb.shape[0], F32), np.zeros((xb.shape[0], 66), np.uint8)
    _iq2_xxs(xb, qw_arr, bpr, grid, kmap, neigh, d, out)
    return _with_d(out, d)


# ------------------------------------------------------------------ IQ2_XS / IQ2_S

@jit
def _iq2_16(x, qw, bpr, grid, kmap, neigh, is_s, d, out):
    """quantize_row_iq2_xs_impl (is_s False) / quantize_row_iq2_s_impl (is_s True): 16 groups of
    16 = 2 grid points of 8; 4-bit scales two per byte.
    IQ2_XS block: d | qs uint16[32] (9-bit index | 7 sign bits << 9) | scales[8].
    IQ2_S block: d | qs[32] index low bytes | signs[32] | qh[8] (2 high bits each) | scales[8]."""
    weight, waux, xval = np.empty(16, F32), np.empty(16, F32), np.empty(16, F32)
    L, Laux = np.zeros(16, np.int64), np.zeros(16, np.int64)
    on, on_aux = np.empty(2, np.bool_), np.empty(2, np.bool_)
    signs = np.empty(2, np.int64)
    scales = np.empty(16, F32)
    for b in range(x.shape[0]):
        xbl, ob = x[b], out[b]
        off = (b % bpr) * QK_K
        max_scale = F32(0)
        sigma2 = _sigma2(xbl, F32(2) if is_s else F32(1))
        for ib in range(16):
            _weights(xbl, 16 * ib, 16, qw, off, sigma2, is_s, weight)
            for i in range(16):
                waux[i] = np.sqrt(weight[i])
            if is_s:
                _abs_signs(xbl, 16 * ib, 16, xval, signs)
            else:
                _even_signs(xbl, 16 * ib, 16, weight, xval, signs)
            vmax = _fmax(xval, 16)
            L[:] = 0
            if vmax < (F32(1e-8) if is_s else F32(1e-15)):
                scales[ib] = 0
                continue
            scale = _grid_search(xval, weight, waux, 16, 3, 2, 9, F32(0.1), vmax, vmax / F32(5), True, False, True,
                                 grid, kmap, neigh, L, Laux, on, on_aux)
            if scale < 0:
                scale = -scale
                for k in range(2):
                    signs[k] = (~signs[k]) & (0xFF if is_s else 127)
            for k in range(2):
                gi = _grid_index(L, 8 * k, 8, 2, kmap)
                i8 = 2 * ib + k
                if is_s:
                    ob[2 + i8] = gi & 255
                    ob[66 + i8 // 4] |= (gi >> 8) << (2 * (i8 % 4))
                    ob[34 + i8] = signs[k]
                else:
                    v = gi | (signs[k] << 9)
                    ob[2 + 2 * i8] = v & 0xFF
                    ob[3 + 2 * i8] = (v >> 8) & 0xFF
            scales[ib] = scale
            max_scale = max(max_scale, scale)
        if max_scale == 0:
            d[b] = 0
            if not is_s:  # C clears IQ2_XS's qs; IQ2_S keeps what was written
                ob[2:66] = 0
            continue
        dd = max_scale / F32(31)
        d[b] = dd * F32(0.9875) if is_s else dd
        id_ = F32(1) / dd
        sc = 74 if is_s else 66
        for ib in range(0, 16, 2):
            ob[sc + ib // 2] = _scale_nibble(id_, scales[ib]) | (_scale_nibble(id_, scales[ib + 1]) << 4)


def iq2_xs(x, qw=None):
    """Block: d f16 | qs uint16[32] | scales[8]. Needs the imatrix (qw)."""
    if qw is None:
        raise ValueError("IQ2_XS needs an imatrix")
    xb, qw_arr, bpr, (grid, kmap, neigh) = _prepare(x, qw, QT.IQ2_XS)
    d, out = np.empty(xb.shape[0], F32), np.zeros((xb.shape[0], 74), np.uint8)
    _iq2_16(xb, qw_arr, bpr, grid, kmap, neigh, False, d, out)
    return _with_d(out, d)


def iq2_s(x, qw=None):
    """Block: d f16 | qs[64] (index low bytes, then signs) | qh[8] | scales[8]."""
    xb, qw_arr, bpr, (grid, kmap, neigh) = _prepare(x, qw, QT.IQ2_S)
    d, out = np.empty(xb.shape[0], F32), np.zeros((xb.shape[0], 82), np.uint8)
    _iq2_16(xb, qw_arr, bpr, grid, kmap, neigh, True, d, out)
    return _with_d(out, d)


# ------------------------------------------------------------------ IQ3_XXS / IQ3_S

@jit
def _iq3(x, qw, bpr, grid, kmap, neigh, is_s, d, out):
    """quantize_row_iq3_xxs_impl (is_s False) / quantize_row_iq3_s_impl(32, ...) (is_s True):
    8 groups of 32 = 8 grid points of 4 (levels 0..7).
    IQ3_XXS block: d | qs[64] grid bytes | uint32[8] (4x7 sign bits | scale << 28).
    IQ3_S block: d | qs[64] index low bytes | qh[8] (9th bits) | signs[32] | scales[4]."""
    weight, waux, xval = np.empty(32, F32), np.empty(32, F32), np.empty(32, F32)
    L, Laux = np.zeros(32, np.int64), np.zeros(32, np.int64)
    on, on_aux = np.empty(8, np.bool_), np.empty(8, np.bool_)
    signs = np.empty(4, np.int64)
    scales = np.empty(8, F32)
    sas = np.empty(8, np.int64)
    for b in range(x.shape[0]):
        xbl, ob = x[b], out[b]
        off = (b % bpr) * QK_K
        sas[:] = 0
        max_scale = F32(0)
        pos = 0  # IQ3_S: C advances qs/signs only past sub-blocks that are not all zero
        sigma2 = _sigma2(xbl, F32(2))
        for ib in range(8):
            _weights(xbl, 32 * ib, 32, qw, off, sigma2, False, weight)
            for i in range(32):
                waux[i] = np.sqrt(weight[i])
            if is_s:
                _abs_signs(xbl, 32 * ib, 32, xval, signs)
            else:
                _even_signs(xbl, 32 * ib, 32, weight, xval, signs)
            vmax = _fmax(xval, 32)
            L[:] = 0
            if (is_s and vmax == 0) or (not is_s and vmax < F32(1e-8)):
                scales[ib] = 0
                continue
            scale = _grid_search(xval, weight, waux, 32, 8, 3, 9 if is_s else 15, F32(0.2), vmax, vmax / F32(15),
                                 not is_s, is_s, True, grid, kmap, neigh, L, Laux, on, on_aux)
            if scale < 0:
                scale = -scale
                for k in range(4):
                    signs[k] = (~signs[k]) & (0xFF if is_s else 127)
            for k in range(8):
                gi = _grid_index(L, 4 * k, 4, 3, kmap)
                if is_s:
                    ob[2 + 8 * pos + k] = gi & 255
                    ob[66 + ib] |= (gi >> 8) << k
                else:
                    ob[2 + 8 * ib + k] = gi
            if is_s:
                for k in range(4):
                    ob[74 + 4 * pos + k] = signs[k]
                pos += 1
            else:
                sas[ib] = signs[0] | (signs[1] << 7) | (signs[2] << 14) | (signs[3] << 21)
            scales[ib] = scale
            max_scale = max(max_scale, scale)
        if max_scale == 0:
            d[b] = 0
            if not is_s:
                ob[:] = 0
            continue
        dd = max_scale / F32(31)
        d[b] = dd * (F32(1.033) if is_s else F32(1.0125))
        id_ = F32(1) / dd
        if is_s:
            for ib in range(0, 8, 2):
                ob[106 + ib // 2] = _scale_nibble(id_, scales[ib]) | (_scale_nibble(id_, scales[ib + 1]) << 4)
        else:
            for ib in range(8):
                v = sas[ib] | (_scale_nibble(id_, scales[ib]) << 28)
                for t in range(4):
                    ob[66 + 4 * ib + t] = (v >> (8 * t)) & 0xFF


def iq3_xxs(x, qw=None):
    """Block: d f16 | qs[64] | scales_and_signs uint32[8]."""
    xb, qw_arr, bpr, (grid, kmap, neigh) = _prepare(x, qw, QT.IQ3_XXS)
    d, out = np.empty(xb.shape[0], F32), np.zeros((xb.shape[0], 98), np.uint8)
    _iq3(xb, qw_arr, bpr, grid, kmap, neigh, False, d, out)
    return _with_d(out, d)


def iq3_s(x, qw=None):
    """Block: d f16 | qs[64] | qh[8] | signs[32] | scales[4]."""
    xb, qw_arr, bpr, (grid, kmap, neigh) = _prepare(x, qw, QT.IQ3_S)
    d, out = np.empty(xb.shape[0], F32), np.zeros((xb.shape[0], 110), np.uint8)
    _iq3(xb, qw_arr, bpr, grid, kmap, neigh, True, d, out)
    return _with_d(out, d)


# ------------------------------------------------------------------ IQ1_S / IQ1_M

@jit_inline
def _stable_order(xb, start, n, idx):
    """Indices of xb[start:start+n] sorted by value, ties in index order (glibc's qsort here)."""
    for j in range(n):
        v = xb[start + j]
        m = j
        while m > 0 and xb[start + idx[m - 1]] > v:
            idx[m] = idx[m - 1]
            m -= 1
        idx[m] = j


@jit_inline
def _best_neighbour2(neigh, pos, grid, xb, start, weight, wstart, scale, xx, L, lstart):
    """iq1_find_best_neighbour2: the listed point minimizing sum w*(scale*xx[level] - x)^2
    (grid: the levels of each point)."""
    best = FLT_MAX
    gi = -1
    for j in range(1, neigh[pos] + 1):
        p = neigh[pos + j]
        d2 = F32(0)
        for i in range(8):
            q = xx[grid[p, i]]
            diff = scale * q - xb[start + i]
            d2 += weight[wstart + i] * diff * diff
        if d2 < best:
            best = d2
            gi = p
    if gi < 0:  # C then scans the whole grid reading past its inputs; only non-finite data gets here
        raise ValueError("i-quant grid search found no point (non-finite input?)")
    for i in range(8):
        L[lstart + i] = grid[gi, i]
    return gi


@jit_inline
def _splits_iq1_s(xb, start, weight, idx, x_p, x_m, sumx, sumw):
    """The exhaustive 3-group split of quantize_row_iq1_s_impl: (scale, i1, i2, shift)."""
    n = 32
    sumx[0], sumw[0] = F32(0), F32(0)
    for j in range(n):
        i = idx[j]
        sumx[j + 1] = sumx[j] + weight[i] * xb[start + i]
        sumw[j + 1] = sumw[j] + weight[i]
    p0, p1, p2 = x_p[0], x_p[1], x_p[2]
    m0, m1, m2 = x_m[0], x_m[1], x_m[2]
    best, scale = -FLT_MAX, F32(0)
    bi1, bi2, shift = -1, -1, 0
    for i1 in range(n + 1):
        for i2 in range(i1, n + 1):
            a, bb, c = sumx[i1] - sumx[0], sumx[i2] - sumx[i1], sumx[n] - sumx[i2]
            wa, wb, wc = sumw[i1] - sumw[0], sumw[i2] - sumw[i1], sumw[n] - sumw[i2]
            sumqx = a * p0 + bb * p1 + c * p2
            sumq2 = wa * p0 * p0 + wb * p1 * p1 + wc * p2 * p2
            if sumq2 > 0 and sumqx * sumqx > best * sumq2:
                scale = sumqx / sumq2
                best = scale * sumqx
                bi1, bi2, shift = i1, i2, 1
            sumqx = a * m0 + bb * m1 + c * m2
            sumq2 = wa * m0 * m0 + wb * m1 * m1 + wc * m2 * m2
            if sumq2 > 0 and sumqx * sumqx > best * sumq2:
                scale = sumqx / sumq2
                best = scale * sumqx
                bi1, bi2, shift = i1, i2, -1
    return scale, bi1, bi2, shift


@jit
def _iq1_s(x, qw, bpr, grid, kmap, neigh, d, out):
    """quantize_row_iq1_s_impl: 8 groups of 32 = 4 grid points of 8 (levels -1, 0, 1 shifted by
    +-IQ1S_DELTA). Block: d | qs[32] index low bytes | qh uint16[8] (3x3 high index bits |
    3-bit scale << 12 | negative shift << 15)."""
    x_p = np.array([-1 + 0.125, 0.125, 1 + 0.125], F32)
    x_m = np.array([-1 - 0.125, -0.125, 1 - 0.125], F32)
    weight = np.empty(32, F32)
    sumx, sumw = np.empty(33, F32), np.empty(33, F32)
    idx = np.empty(32, np.int64)
    L = np.empty(32, np.int64)
    index = np.empty(4, np.int64)
    scales = np.empty(8, F32)
    shifts = np.empty(8, np.int64)
    qh = np.empty(8, np.int64)
    for b in range(x.shape[0]):
        xbl, ob = x[b], out[b]
        off = (b % bpr) * QK_K
        qh[:] = 0
        max_scale = F32(0)
        sigma2 = _sigma2(xbl, F32(2))
        for ib in range(8):
            _weights(xbl, 32 * ib, 32, qw, off, sigma2, False, weight)
            vmax = abs(xbl[32 * ib])
            for i in range(1, 32):
                vmax = max(vmax, abs(xbl[32 * ib + i]))
            scales[ib], shifts[ib] = F32(0), 1
            if vmax < F32(1e-12):
                continue
            _stable_order(xbl, 32 * ib, 32, idx)
            scale, i1, i2, shift = _splits_iq1_s(xbl, 32 * ib, weight, idx, x_p, x_m, sumx, sumw)
            if i1 < 0 or i2 < 0 or shift == 0:
                continue
            for j in range(32):
                L[idx[j]] = 0 if j < i1 else (1 if j < i2 else 2)
            if scale < 0:
                for j in range(32):
                    L[j] = 2 - L[j]
                scale, shift = -scale, -shift
            xx = x_p if shift == 1 else x_m
            all_on = True
            for k in range(4):
                gi = kmap[_key(L, 8 * k, 8, 2)]
                if gi < 0:
                    all_on = False
                    gi = _best_neighbour2(neigh, -gi - 1, grid, xbl, 32 * ib + 8 * k, weight, 8 * k, scale, xx, L, 8 * k)
                index[k] = gi
            if not all_on:
                sumqx, sumq2 = F32(0), F32(0)
                for k in range(4):
                    for j in range(8):
                        w = weight[8 * k + j]
                        q = xx[grid[index[k], j]]
                        sumqx += w * q * xbl[32 * ib + 8 * k + j]
                        sumq2 += w * q * q
                if sumqx > 0 and sumq2 > 0:
                    scale = sumqx / sumq2
            h = 0
            for k in range(4):
                ob[2 + 4 * ib + k] = index[k] & 255
                h |= (index[k] >> 8) << (3 * k)
            qh[ib] = h
            scales[ib], shifts[ib] = scale, shift
            max_scale = max(max_scale, scale)
        d[b] = 0
        if max_scale != 0:  # else C leaves qs/qh as written, without scales
            dd = max_scale / F32(15)
            d[b] = dd * F32(1.125)
            id_ = F32(1) / dd
            for ib in range(8):
                l = max(0, min(7, nint(F32(0.5) * (id_ * scales[ib] - F32(1)))))
                if shifts[ib] == -1:
                    l |= 8
                qh[ib] |= l << 12
        for ib in range(8):
            ob[34 + 2 * ib] = qh[ib] & 0xFF
            ob[35 + 2 * ib] = (qh[ib] >> 8) & 0xFF


def iq1_s(x, qw=None):
    """Block: d f16 | qs[32] | qh uint16[8]. Needs the imatrix (qw)."""
    if qw is None:
        raise ValueError("IQ1_S needs an imatrix")
    xb, qw_arr, bpr, (grid, kmap, neigh) = _prepare(x, qw, QT.IQ1_S)
    d, out = np.empty(xb.shape[0], F32), np.zeros((xb.shape[0], 50), np.uint8)
    _iq1_s(xb, qw_arr, bpr, grid, kmap, neigh, d, out)
    return _with_d(out, d)


@jit_inline
def _splits_iq1_m(xb, start, weight, idx, x_p, x_m, px, pw):
    """The split search of quantize_row_iq1_m_impl (prefix sums per half of the 16 values, each
    half with its own shift): (scale, i1, i2, k) with k = 2*(first half -) + (second half -)."""
    n = 16
    px[:, 0], pw[:, 0] = F32(0), F32(0)
    for j in range(n):
        i = idx[j]
        h = 0 if i < n // 2 else 1
        px[h, j + 1] = px[h, j] + weight[i] * xb[start + i]
        px[1 - h, j + 1] = px[1 - h, j]
        pw[h, j + 1] = pw[h, j] + weight[i]
        pw[1 - h, j + 1] = pw[1 - h, j]
    p2, m2 = x_p[2], x_m[2]
    cp1, cp2 = x_p[0] * x_p[0] - x_p[1] * x_p[1], x_p[1] * x_p[1] - x_p[2] * x_p[2]
    cm1, cm2 = x_m[0] * x_m[0] - x_m[1] * x_m[1], x_m[1] * x_m[1] - x_m[2] * x_m[2]
    tx0, tx1, tw0, tw1 = px[0, n], px[1, n], pw[0, n], pw[1, n]
    best, scale = -FLT_MAX, F32(0)
    bi1, bi2, bk = -1, -1, -1
    for i1 in range(n + 1):
        for i2 in range(i1, n + 1):
            sx0 = px[0, i1] + px[0, i2]
            sx1 = px[1, i1] + px[1, i2]
            qxp0, qxm0 = tx0 * p2 - sx0, tx0 * m2 - sx0
            qxp1, qxm1 = tx1 * p2 - sx1, tx1 * m2 - sx1
            q2p0 = tw0 * p2 * p2 + pw[0, i1] * cp1 + pw[0, i2] * cp2
            q2m0 = tw0 * m2 * m2 + pw[0, i1] * cm1 + pw[0, i2] * cm2
            q2p1 = tw1 * p2 * p2 + pw[1, i1] * cp1 + pw[1, i2] * cp2
            q2m1 = tw1 * m2 * m2 + pw[1, i1] * cm1 + pw[1, i2] * cm2
            for k in range(4):  # 0: +,+  1: +,-  2: -,+  3: -,-
                sumqx = (qxp0 if k < 2 else qxm0) + (qxp1 if k % 2 == 0 else qxm1)
                sumq2 = (q2p0 if k < 2 else q2m0) + (q2p1 if k % 2 == 0 else q2m1)
                if sumq2 > 0 and sumqx * sumqx > best * sumq2:
                    scale = sumqx / sumq2
                    best = scale * sumqx
                    bi1, bi2, bk = i1, i2, k
    return scale, bi1, bi2, bk


@jit
def _iq1_m(x, qw, bpr, grid, kmap, neigh, d, out):
    """quantize_row_iq1_m_impl: 16 groups of 16 = 2 grid points of 8, each with its own shift.
    Block: qs[32] index low bytes | qh[16] (3 high index bits + shift bit per point) |
    scales uint16[4] (3-bit scales; the fp16 super-scale's nibbles in the top 4 bits, by the caller)."""
    x_p = np.array([-1 + 0.125, 0.125, 1 + 0.125], F32)
    x_m = np.array([-1 - 0.125, -0.125, 1 - 0.125], F32)
    masks = np.array([0x00, 0x80, 0x08, 0x88], np.int64)
    weight = np.empty(16, F32)
    px, pw = np.empty((2, 17), F32), np.empty((2, 17), F32)
    idx = np.empty(16, np.int64)
    L = np.empty(16, np.int64)
    index = np.empty(2, np.int64)
    scales = np.empty(16, F32)
    shifts = np.empty(16, np.int64)
    sc = np.empty(4, np.int64)
    for b in range(x.shape[0]):
        xbl, ob = x[b], out[b]
        off = (b % bpr) * QK_K
        max_scale = F32(0)
        sigma2 = _sigma2(xbl, F32(2))
        for ib in range(16):
            _weights(xbl, 16 * ib, 16, qw, off, sigma2, False, weight)
            vmax = abs(xbl[16 * ib])
            for i in range(1, 16):
                vmax = max(vmax, abs(xbl[16 * ib + i]))
            scales[ib], shifts[ib] = F32(0), 0
            if vmax < F32(1e-7):
                continue
            _stable_order(xbl, 16 * ib, 16, idx)
            scale, i1, i2, bk = _splits_iq1_m(xbl, 16 * ib, weight, idx, x_p, x_m, px, pw)
            if i1 < 0 or i2 < 0 or bk < 0:
                continue
            for j in range(16):
                L[idx[j]] = 0 if j < i1 else (1 if j < i2 else 2)
            if scale < 0:
                for j in range(16):
                    L[j] = 2 - L[j]
                scale = -scale
                bk = 3 - bk
            all_on = True
            for k in range(2):
                xx = _iq1m_levels(bk, k, x_p, x_m)
                gi = kmap[_key(L, 8 * k, 8, 2)]
                if gi < 0:
                    all_on = False
                    gi = _best_neighbour2(neigh, -gi - 1, grid, xbl, 16 * ib + 8 * k, weight, 8 * k, scale, xx, L, 8 * k)
                index[k] = gi
            if not all_on:
                sumqx, sumq2 = F32(0), F32(0)
                for k in range(2):
                    xx = _iq1m_levels(bk, k, x_p, x_m)
                    for j in range(8):
                        w = weight[8 * k + j]
                        q = xx[grid[index[k], j]]
                        sumqx += w * q * xbl[16 * ib + 8 * k + j]
                        sumq2 += w * q * q
                if sumqx > 0 and sumq2 > 0:
                    scale = sumqx / sumq2
            ob[2 * ib] = index[0] & 255
            ob[2 * ib + 1] = index[1] & 255
            ob[32 + ib] = (index[0] >> 8) | ((index[1] >> 8) << 4)
            scales[ib], shifts[ib] = scale, bk
            max_scale = max(max_scale, scale)
        if max_scale == 0:
            d[b] = 0
            continue
        dd = max_scale / F32(15)
        id_ = F32(1) / dd
        sumqx, sumq2 = F32(0), F32(0)
        sc[:] = 0
        for ib in range(16):
            l = max(0, min(7, nint(F32(0.5) * (id_ * scales[ib] - F32(1)))))
            sc[ib // 4] |= l << (3 * (ib % 4))
            ob[32 + ib] |= masks[shifts[ib]]
            _weights(xbl, 16 * ib, 16, qw, off, sigma2, False, weight)
            for k in range(2):
                xx = _iq1m_levels(shifts[ib], k, x_p, x_m)
                gi = np.int64(ob[2 * ib + k]) + ((np.int64(ob[32 + ib]) << (8 - 4 * k)) & 0x700)
                for j in range(8):
                    w = weight[8 * k + j]
                    q = xx[grid[gi, j]] * F32(2 * l + 1)
                    sumqx += w * q * xbl[16 * ib + 8 * k + j]
                    sumq2 += w * q * q
        if sumq2 > 0:
            dd = sumqx / sumq2
        d[b] = dd * F32(1.1125)
        for j in range(4):
            ob[48 + 2 * j] = sc[j] & 0xFF
            ob[49 + 2 * j] = (sc[j] >> 8) & 0xFF


@jit_inline
def _iq1m_levels(k_shift, k, x_p, x_m):
    """The level values of point k (0: first 8, 1: last 8) for shift code k_shift (0..3)."""
    if k == 0:
        return x_p if k_shift < 2 else x_m
    return x_p if k_shift % 2 == 0 else x_m


def iq1_m(x, qw=None):
    """Block: qs[32] | qh[16] | scales uint16[4] (the fp16 super-scale spread over their top nibbles)."""
    xb, qw_arr, bpr, (grid, kmap, neigh) = _prepare(x, qw, QT.IQ1_M)
    d, out = np.empty(xb.shape[0], F32), np.zeros((xb.shape[0], 56), np.uint8)
    _iq1_m(xb, qw_arr, bpr, grid, kmap, neigh, d, out)
    u16 = fp16_bits(d).view(np.uint16)[:, 0].astype(np.int64)
    for j, mask, shift in ((0, 0x000F, 12), (1, 0x00F0, 8), (2, 0x0F00, 4), (3, 0xF000, 0)):
        top = ((u16 & mask) << shift) >> 8  # the high byte of sc[j] |= (s & mask) << shift
        out[:, 49 + 2 * j] |= top.astype(np.uint8)
    return out
