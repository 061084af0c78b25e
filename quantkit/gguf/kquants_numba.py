"""numba ports of ggml-quants.c's quantizers: compiled scalar loops that mirror the C.

Two layers:

* the four scale searches (make_qkx2/3_quants, make_qx_quants, make_q3_quants, make_qp_quants),
  one sub-block per call (``*_one``) and over the rows of a 2-D array (``SEARCH``, the same
  interface as kquants_numpy.SEARCH, used by the numpy kernels of the other types);
* whole-row kernels for Q8_0 and the k-quants Q2_K..Q6_K (``q8_0``, ``q2_k`` ... ``q6_k``):
  search, re-quantization and bit packing all compiled, writing the block bytes directly. Each runs in two compiled passes
  around one small numpy step, the fp16 rounding of the per-block d/dmin (numpy's float16
  cast is the GGML_FP32_TO_FP16 rounding, so it is kept rather than re-implemented):
  ``*_search`` (scales, quants, float32 d) -> fp16 -> ``*_pack`` (quants recomputed from the
  rounded d, bytes written).

Bit-exact rules (see quantkit/gguf/quants.py): float32 everywhere (every literal is wrapped in
F32, or numba would promote to float64), sums left to right, no fastmath, C's uint8/int8 stores
emulated with ``& 0xFF``. Compiled lazily on first call and cached on disk (``cache=True``);
without numba the functions stay plain Python (correct but slow, and unused: quants.BACKEND is
"numpy" then).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from quantkit.gguf.kquants_numpy import fp16_bits, fp16_round

try:  # optional accelerator
    import numba
except ImportError:  # pragma: no cover - depends on the environment
    numba = None

F32 = np.float32
QK_K = 256
jit = numba.njit(cache=True, nogil=True, error_model="numpy") if numba is not None else (lambda f: f)


@jit
def nint(f):
    """nearest_int: bits(f + 1.5*2^23) & 0x7FFFFF) - 0x400000 (branch-free, so loops vectorize)."""
    return (np.float32(f + F32(12582912.0)).view(np.int32) & 0x007FFFFF) - 0x00400000


# ------------------------------------------------------------------ searches, one sub-block

@jit
def qkx_one(x, w, nmax, rmin, rdelta, nstep, use_mad, L, laux):
    """make_qkx2_quants / make_qkx3_quants (same code when weights are given).

    Writes L (0..nmax); returns (scale, the_min) with the_min = -min >= 0. C updates `min` in
    place during the search, so later trial scales start from the best min found so far.
    """
    n = x.shape[0]
    rmin, rdelta = F32(rmin), F32(rdelta)
    mn, mx = x[0], x[0]
    sum_w = w[0]
    sum_x = sum_w * x[0]
    for i in range(1, n):
        if x[i] < mn:
            mn = x[i]
        if x[i] > mx:
            mx = x[i]
        sum_w += w[i]
        sum_x += w[i] * x[i]
    if mn > 0:
        mn = F32(0)
    if mx == mn:
        L[:] = 0
        return F32(0), -mn
    iscale = F32(nmax) / (mx - mn)
    scale = F32(1) / iscale
    best = F32(0)
    for i in range(n):
        L[i] = max(0, min(nmax, nint(iscale * (x[i] - mn))))
        diff = scale * F32(L[i]) + mn - x[i]
        diff = abs(diff) if use_mad else diff * diff
        best += w[i] * diff
    for step in range(nstep + 1):
        iscale = (rmin + rdelta * F32(step) + F32(nmax)) / (mx - mn)
        sum_l, sum_l2, sum_xl = F32(0), F32(0), F32(0)
        for i in range(n):
            l = max(0, min(nmax, nint(iscale * (x[i] - mn))))
            laux[i] = l
            fl = F32(l)
            sum_l += w[i] * fl
            sum_l2 += w[i] * fl * fl
            sum_xl += w[i] * fl * x[i]
        D = sum_w * sum_l2 - sum_l * sum_l
        if D > 0:
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            if this_min > 0:
                this_min = F32(0)
                this_scale = sum_xl / sum_l2
            cur = F32(0)
            for i in range(n):
                diff = this_scale * F32(laux[i]) + this_min - x[i]
                diff = abs(diff) if use_mad else diff * diff
                cur += w[i] * diff
            if cur < best:
                L[:] = laux
                best = cur
                scale = this_scale
                mn = this_min
    return scale, -mn


@jit
def block_sigma2(xb, factor):
    """*_K_impl: sigma2 = factor * sum(x^2) / 256 over one super-block, summed left to right."""
    sum_x2 = F32(0)
    for l in range(QK_K):
        sum_x2 += xb[l] * xb[l]
    return factor * sum_x2 / F32(QK_K)


@jit
def impl_weights(xb, qw, off, sigma2, start, n, w):
    """*_K_impl: w[l] = qw * sqrt(sigma2 + x^2) over sub-block [start, start + n); returns sum(w)."""
    sumw = F32(0)
    for l in range(n):
        v = xb[start + l]
        w[l] = qw[off + start + l] * np.sqrt(sigma2 + v * v)
        sumw += w[l]
    return sumw


@jit
def signed_absmax(x):
    """(the value with the largest |x|, that |x|): the first such value wins, as in the C loops."""
    vmax, amax = F32(0), F32(0)
    for i in range(x.shape[0]):
        ax = abs(x[i])
        if ax > amax:
            amax = ax
            vmax = x[i]
    return vmax, amax


@jit
def qx_one(x, w, nmax, L):
    """make_qx_quants(n, nmax, x, L, rmse_type=1, w): writes L = l + nmax; returns the scale."""
    n = x.shape[0]
    vmax, amax = signed_absmax(x)
    if amax < F32(1e-15):
        L[:] = 0
        return F32(0)
    iscale = F32(-nmax) / vmax
    sumlx, suml2 = F32(0), F32(0)
    for i in range(n):
        l = max(-nmax, min(nmax - 1, nint(iscale * x[i])))
        L[i] = l + nmax
        sumlx += w[i] * x[i] * F32(l)
        suml2 += w[i] * F32(l) * F32(l)
    scale = sumlx / suml2 if suml2 != 0 else F32(0)
    best = scale * sumlx
    for step in range(-9, 10):
        if step == 0:
            continue
        iscale = -(F32(nmax) + F32(0.1) * F32(step)) / vmax
        sumlx, suml2 = F32(0), F32(0)
        for i in range(n):
            l = max(-nmax, min(nmax - 1, nint(iscale * x[i])))
            sumlx += w[i] * x[i] * F32(l)
            suml2 += w[i] * F32(l) * F32(l)
        if suml2 > 0 and sumlx * sumlx > best * suml2:
            for i in range(n):
                L[i] = nmax + max(-nmax, min(nmax - 1, nint(iscale * x[i])))
            scale = sumlx / suml2
            best = scale * sumlx
    return scale


@jit
def q3_one(x, nmax, L):
    """make_q3_quants(n, nmax, x, L, do_rmse=true): writes L = l + nmax; returns the scale."""
    n = x.shape[0]
    vmax, amax = signed_absmax(x)
    if amax < F32(1e-15):
        L[:] = 0
        return F32(0)
    iscale = F32(-nmax) / vmax
    sumlx, suml2 = F32(0), F32(0)
    for i in range(n):
        l = max(-nmax, min(nmax - 1, nint(iscale * x[i])))
        L[i] = l
        w = x[i] * x[i]
        sumlx += w * x[i] * F32(l)
        suml2 += w * F32(l) * F32(l)
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            w = x[i] * x[i]
            li = F32(L[i])
            slx = sumlx - w * x[i] * li
            if slx > 0:
                sl2 = suml2 - w * li * li
                new_l = max(-nmax, min(nmax - 1, nint(x[i] * sl2 / slx)))
                if new_l != L[i]:
                    slx += w * x[i] * F32(new_l)
                    sl2 += w * F32(new_l) * F32(new_l)
                    if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    for i in range(n):
        L[i] += nmax
    return sumlx / suml2 if suml2 > 0 else F32(0)


@jit
def qp_one(x, w, nmax, L):
    """make_qp_quants(n, nmax, x, L, w): L is uint8 (C's uint8_t wraps); returns the scale."""
    n = x.shape[0]
    vmax = F32(0)
    for i in range(n):
        vmax = max(vmax, x[i])
    if vmax < F32(1e-15):
        L[:] = 0
        return F32(0)
    iscale = F32(nmax) / vmax
    for i in range(n):
        L[i] = nint(iscale * x[i]) & 0xFF
    scale = F32(1) / iscale
    best = F32(0)
    for i in range(n):
        diff = x[i] - scale * F32(L[i])
        best += w[i] * diff * diff
    for step in range(-4, 5):
        if step == 0:
            continue
        iscale_is = (F32(0.1) * F32(step) + F32(nmax)) / vmax
        scale_is = F32(1) / iscale_is
        mse = F32(0)
        for i in range(n):
            l = min(nmax, nint(iscale_is * x[i]))
            diff = x[i] - scale_is * F32(l)
            mse += w[i] * diff * diff
        if mse < best:
            best = mse
            iscale = iscale_is
    sumlx, suml2 = F32(0), F32(0)
    for i in range(n):
        l = min(nmax, nint(iscale * x[i]))
        L[i] = l & 0xFF
        sumlx += w[i] * x[i] * F32(l)
        suml2 += w[i] * F32(l) * F32(l)
    for _ in range(5):
        n_changed = 0
        for i in range(n):
            li = F32(L[i])
            slx = sumlx - w[i] * x[i] * li
            sl2 = suml2 - w[i] * li * li
            if slx > 0 and sl2 > 0:
                new_l = min(nmax, nint(x[i] * sl2 / slx))
                if new_l != L[i]:
                    slx += w[i] * x[i] * F32(new_l)
                    sl2 += w[i] * F32(new_l) * F32(new_l)
                    if slx * slx * suml2 > sumlx * sumlx * sl2:
                        L[i] = new_l & 0xFF
                        sumlx = slx
                        suml2 = sl2
                        n_changed += 1
        if n_changed == 0:
            break
    return sumlx / suml2 if suml2 > 0 else F32(0)


# ------------------------------------------------------------------ searches over rows

@jit
def _qkx_rows(x, w, nmax, rmin, rdelta, nstep, use_mad, scales, mins, L):
    laux = np.empty(x.shape[1], np.int32)
    for r in range(x.shape[0]):
        scales[r], mins[r] = qkx_one(x[r], w[r], nmax, rmin, rdelta, nstep, use_mad, L[r], laux)


@jit
def _qx_rows(x, w, nmax, scales, L):
    for r in range(x.shape[0]):
        scales[r] = qx_one(x[r], w[r], nmax, L[r])


@jit
def _q3_rows(x, nmax, scales, L):
    for r in range(x.shape[0]):
        scales[r] = q3_one(x[r], nmax, L[r])


@jit
def _qp_rows(x, w, nmax, scales, L):
    for r in range(x.shape[0]):
        scales[r] = qp_one(x[r], w[r], nmax, L[r])


def _c(a):
    return np.ascontiguousarray(a, dtype=F32)


def make_qkx_quants(x, w, nmax, rmin, rdelta, nstep, use_mad):
    """(scales (m,), the_mins (m,), L (m, n) int32) for the m rows of x; see qkx_one."""
    scales, mins, L = np.empty(x.shape[0], F32), np.empty(x.shape[0], F32), np.empty(x.shape, np.int32)
    _qkx_rows(_c(x), _c(w), nmax, rmin, rdelta, nstep, use_mad, scales, mins, L)
    return scales, mins, L


def make_qx_quants(x, w, nmax):
    """(scales, L) for the rows of x; w=None means w = x*x (C's qw == NULL)."""
    scales, L = np.empty(x.shape[0], F32), np.empty(x.shape, np.int32)
    _qx_rows(_c(x), _c(x * x if w is None else w), nmax, scales, L)
    return scales, L


def make_q3_quants(x, nmax):
    scales, L = np.empty(x.shape[0], F32), np.empty(x.shape, np.int32)
    _q3_rows(_c(x), nmax, scales, L)
    return scales, L


def make_qp_quants(x, w, nmax):
    scales, L = np.empty(x.shape[0], F32), np.empty(x.shape, np.uint8)
    _qp_rows(_c(x), _c(w), nmax, scales, L)
    return scales, L


SEARCH = SimpleNamespace(make_qx_quants=make_qx_quants, make_q3_quants=make_q3_quants,
                         make_qkx_quants=make_qkx_quants, make_qp_quants=make_qp_quants)


# ------------------------------------------------------------------ Q8_0

@jit
def _q8_0_blocks(x, d, out):
    """quantize_row_q8_0_ref: d = amax/127, qs[j] = roundf(x[j]/d) into out[:, 2:34]; d float32."""
    for b in range(x.shape[0]):
        xb = x[b]
        amax = F32(0)
        for j in range(32):
            amax = max(amax, abs(xb[j]))
        db = amax / F32(127)
        inv = F32(1) / db if db != 0 else F32(0)
        d[b] = db
        for j in range(32):
            v = xb[j] * inv
            q = int(v)  # roundf: half away from zero; v - trunc(v) is exact in float32
            if abs(v - F32(q)) >= F32(0.5):
                q += 1 if v > 0 else -1
            out[b, 2 + j] = q & 0xFF


def q8_0(x, qw=None):
    """Q8_0 rows -> blocks (d f16 | int8 qs[32]); the imatrix is ignored, as in C."""
    xb = x.reshape(-1, 32)
    out = np.empty((xb.shape[0], 34), np.uint8)
    d = np.empty(xb.shape[0], F32)
    _q8_0_blocks(xb, d, out)
    out[:, 0:2] = fp16_bits(d)
    return out


# ------------------------------------------------------------------ Q4_K / Q5_K

@jit
def _k45_search(x, qw, bpr, nmax, rmin, rdelta, nstep, clamp63, L, packed, d, dmin):
    """quantize_row_q{4,5}_K_ref / _impl up to the fp16 rounding of d and dmin.

    Per super-block: the 8 sub-block searches (make_qkx2_quants with weights av_x + |x| for
    _ref, make_qkx3_quants with qw*sqrt(sigma2 + x^2) for _impl), the 6-bit scales/mins (against
    max/63 for _ref, make_qp_quants for _impl) packed into 12 bytes like C, d/dmin as float32.
    qw has size 0 for _ref; bpr = blocks per row (the imatrix offset of block b is b % bpr).
    """
    has_qw = qw.shape[0] > 0
    w = np.empty(32, F32)
    laux = np.empty(32, np.int32)
    scales, mins, sw = np.empty(8, F32), np.empty(8, F32), np.empty(8, F32)
    ls, lm = np.empty(8, np.uint8), np.empty(8, np.uint8)
    for b in range(x.shape[0]):
        xb, Lb = x[b], L[b]
        if has_qw:  # quantize_row_q{4,5}_K_impl
            sigma2 = block_sigma2(xb, F32(2))
            off = (b % bpr) * QK_K
            for j in range(8):
                sw[j] = impl_weights(xb, qw, off, sigma2, 32 * j, 32, w)
                scales[j], mins[j] = qkx_one(xb[32 * j:32 * j + 32], w, nmax, F32(-0.9), F32(0.05), 36, False,
                                             Lb[32 * j:32 * j + 32], laux)
            d[b] = qp_one(scales, sw, 63, ls)
            dmin[b] = qp_one(mins, sw, 63, lm)
            if clamp63:  # only quantize_row_q5_K_impl clamps
                for j in range(8):
                    ls[j] = min(63, ls[j])
                    lm[j] = min(63, lm[j])
        else:  # quantize_row_q{4,5}_K_ref
            for j in range(8):
                sum_x2 = F32(0)
                for l in range(32):
                    sum_x2 += xb[32 * j + l] * xb[32 * j + l]
                av_x = np.sqrt(sum_x2 / F32(32))
                for l in range(32):
                    w[l] = av_x + abs(xb[32 * j + l])
                scales[j], mins[j] = qkx_one(xb[32 * j:32 * j + 32], w, nmax, rmin, rdelta, nstep, False,
                                             Lb[32 * j:32 * j + 32], laux)
            max_scale, max_min = F32(0), F32(0)
            for j in range(8):
                if scales[j] > max_scale:
                    max_scale = scales[j]
                if mins[j] > max_min:
                    max_min = mins[j]
            inv_scale = F32(63) / max_scale if max_scale > 0 else F32(0)
            inv_min = F32(63) / max_min if max_min > 0 else F32(0)
            for j in range(8):  # uint8_t ls = nearest_int(...); MIN(63, ls)
                ls[j] = min(63, nint(inv_scale * scales[j]) & 0xFF)
                lm[j] = min(63, nint(inv_min * mins[j]) & 0xFF)
            d[b] = max_scale / F32(63)
            dmin[b] = max_min / F32(63)
        _pack_scale_min_k4(ls, lm, packed[b])


@jit
def _pack_scale_min_k4(ls, lm, q):
    """The 12-byte scales of Q4_K/Q5_K, as the loops of quantize_row_q4_K_ref write them."""
    for j in range(8):
        if j < 4:
            q[j] = ls[j] & 0xFF
            q[j + 4] = lm[j] & 0xFF
        else:
            q[j + 4] = ((ls[j] & 0xF) | ((lm[j] & 0xF) << 4)) & 0xFF
            q[j - 4] = (q[j - 4] | ((ls[j] >> 4) << 6)) & 0xFF
            q[j] = (q[j] | ((lm[j] >> 4) << 6)) & 0xFF


@jit
def _scale_min_k4(j, q):
    """get_scale_min_k4."""
    if j < 4:
        return q[j] & 63, q[j + 4] & 63
    return (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4)


@jit
def _k45_pack(x, L, packed, dr, dminr, nmax, out):
    """Second half of quantize_row_q{4,5}_K_*: quants recomputed from the fp16-rounded d/dmin,
    then scales | (Q5_K: qh[32]) | qs[128] written to out[:, 4:] (d/dmin bytes by the caller)."""
    q5 = nmax == 31
    for b in range(x.shape[0]):
        xb, Lb, ob = x[b], L[b], out[b]
        for j in range(8):
            sc, m = _scale_min_k4(j, packed[b])
            dd = dr[b] * F32(sc)
            if dd == 0:
                continue
            dm = dminr[b] * F32(m)
            for ii in range(32):
                Lb[32 * j + ii] = max(0, min(nmax, nint((xb[32 * j + ii] + dm) / dd)))
        for k in range(12):
            ob[4 + k] = packed[b, k]
        qs = 48 if q5 else 16
        if q5:
            for k in range(32):
                ob[16 + k] = 0
        m1, m2 = 1, 2
        for n in range(0, QK_K, 64):
            for j in range(32):
                l1, l2 = Lb[n + j], Lb[n + j + 32]
                if q5:
                    if l1 > 15:
                        l1 -= 16
                        ob[16 + j] |= m1
                    if l2 > 15:
                        l2 -= 16
                        ob[16 + j] |= m2
                ob[qs + n // 2 + j] = (l1 | (l2 << 4)) & 0xFF
            m1 <<= 2
            m2 <<= 2


def _k45(x, qw, nmax, ref_params, type_size):
    """quantize_row_q4_K / q5_K (ref or impl) over rows of a multiple of 256 values."""
    n_per_row = x.shape[-1]
    xb = np.ascontiguousarray(x.reshape(-1, QK_K))
    nb = xb.shape[0]
    L = np.empty((nb, QK_K), np.int32)
    packed = np.zeros((nb, 12), np.uint8)
    d, dmin = np.empty(nb, F32), np.empty(nb, F32)
    qw_arr = np.empty(0, F32) if qw is None else qw
    _k45_search(xb, qw_arr, n_per_row // QK_K, nmax, *ref_params, nmax == 31, L, packed, d, dmin)
    out = np.empty((nb, type_size), np.uint8)
    _k45_pack(xb, L, packed, fp16_round(d), fp16_round(dmin), nmax, out)
    out[:, 0:2] = fp16_bits(d)
    out[:, 2:4] = fp16_bits(dmin)
    return out


def q4_k(x, qw=None):
    """Block: d f16 | dmin f16 | scales[12] | qs[128]."""
    return _k45(x, qw, 15, (-1.0, 0.1, 20), 144)


def q5_k(x, qw=None):
    """Block: d f16 | dmin f16 | scales[12] | qh[32] | qs[128]."""
    return _k45(x, qw, 31, (-0.5, 0.1, 15), 176)


# ------------------------------------------------------------------ Q6_K

@jit
def _q6_search(x, qw, bpr, L, sc, d, zero):
    """quantize_row_q6_K_ref / _impl up to the fp16 rounding of d: 16 make_qx_quants(16, 32)
    (w = x*x for _ref, the raw imatrix for _impl), int8 scales against -128/max_scale."""
    has_qw = qw.shape[0] > 0
    w = np.empty(16, F32)
    scales = np.empty(16, F32)
    for b in range(x.shape[0]):
        xb, Lb = x[b], L[b]
        off = (b % bpr) * QK_K
        max_scale, max_abs = F32(0), F32(0)
        for ib in range(16):
            for l in range(16):
                v = xb[16 * ib + l]
                w[l] = qw[off + 16 * ib + l] if has_qw else v * v
            s = qx_one(xb[16 * ib:16 * ib + 16], w, 32, Lb[16 * ib:16 * ib + 16])
            scales[ib] = s
            if abs(s) > max_abs:
                max_abs = abs(s)
                max_scale = s
        if max_abs < F32(1e-15):
            zero[b] = True
            d[b] = F32(0)
            continue
        zero[b] = False
        iscale = F32(-128) / max_scale
        d[b] = F32(1) / iscale
        for ib in range(16):
            sc[b, ib] = min(127, nint(iscale * scales[ib]))


@jit
def _q6_pack(x, L, sc, dr, zero, out):
    """Second half of quantize_row_q6_K_*: quants from the fp16-rounded d, then
    ql[128] | qh[64] | int8 scales[16] into out[:, :208] (an all-zero block stays zero)."""
    for b in range(x.shape[0]):
        ob = out[b]
        if zero[b]:
            ob[:] = 0
            continue
        xb, Lb = x[b], L[b]
        for j in range(16):
            dd = dr[b] * F32(sc[b, j])
            if dd == 0:
                continue
            for ii in range(16):
                Lb[16 * j + ii] = max(-32, min(31, nint(xb[16 * j + ii] / dd))) + 32
        for h in range(2):
            base, ql, qh = 128 * h, 64 * h, 128 + 32 * h
            for l in range(32):
                q1, q2, q3, q4 = Lb[base + l], Lb[base + l + 32], Lb[base + l + 64], Lb[base + l + 96]
                ob[ql + l] = ((q1 & 0xF) | ((q3 & 0xF) << 4)) & 0xFF
                ob[ql + l + 32] = ((q2 & 0xF) | ((q4 & 0xF) << 4)) & 0xFF
                ob[qh + l] = ((q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6)) & 0xFF
        for j in range(16):
            ob[192 + j] = sc[b, j] & 0xFF


def q6_k(x, qw=None):
    """Block: ql[128] | qh[64] | int8 scales[16] | d f16."""
    n_per_row = x.shape[-1]
    xb = np.ascontiguousarray(x.reshape(-1, QK_K))
    nb = xb.shape[0]
    L = np.empty((nb, QK_K), np.int32)
    sc = np.zeros((nb, 16), np.int32)
    d, zero = np.empty(nb, F32), np.empty(nb, np.bool_)
    _q6_search(xb, np.empty(0, F32) if qw is None else qw, n_per_row // QK_K, L, sc, d, zero)
    out = np.empty((nb, 210), np.uint8)
    _q6_pack(xb, L, sc, fp16_round(d), zero, out)
    out[:, 208:210] = fp16_bits(d)
    return out


# ------------------------------------------------------------------ Q3_K

@jit
def _q3_search(x, qw, bpr, L, l6, d):
    """quantize_row_q3_K_ref / _impl up to the fp16 rounding of d: 16 sub-blocks of 16
    (make_q3_quants(16, 4) for _ref; make_qx_quants(16, 4) with qw*sqrt(sigma2 + x^2) for _impl),
    then the 16 scales as 6-bit values l6 = q + 32 (against -32/max for _ref, make_qx_quants(16, 32)
    weighted by the sub-block weight sums for _impl)."""
    has_qw = qw.shape[0] > 0
    w = np.empty(16, F32)
    scales, sw = np.empty(16, F32), np.empty(16, F32)
    lsc = np.empty(16, np.int32)
    for b in range(x.shape[0]):
        xb, Lb = x[b], L[b]
        if has_qw:  # quantize_row_q3_K_impl
            sigma2 = block_sigma2(xb, F32(2))
            off = (b % bpr) * QK_K
            for j in range(16):
                sw[j] = impl_weights(xb, qw, off, sigma2, 16 * j, 16, w)
                scales[j] = qx_one(xb[16 * j:16 * j + 16], w, 4, Lb[16 * j:16 * j + 16])
            d[b] = qx_one(scales, sw, 32, lsc)
            for j in range(16):
                l6[b, j] = lsc[j]
        else:  # quantize_row_q3_K_ref
            max_scale, amax = F32(0), F32(0)
            for j in range(16):
                s = q3_one(xb[16 * j:16 * j + 16], 4, Lb[16 * j:16 * j + 16])
                scales[j] = s
                if abs(s) > amax:
                    amax = abs(s)
                    max_scale = s
            if max_scale != 0:
                iscale = F32(-32) / max_scale
                for j in range(16):
                    l6[b, j] = max(-32, min(31, nint(iscale * scales[j]))) + 32
                d[b] = F32(1) / iscale
            else:
                l6[b, :] = 0
                d[b] = F32(0)


@jit
def _q3_pack(x, L, l6, dr, out):
    """Second half of quantize_row_q3_K_*: quants from the fp16-rounded d and the 6-bit scales,
    then hmask[32] | qs[64] | scales[12] into out[:, :108] (d bytes by the caller)."""
    for b in range(x.shape[0]):
        xb, Lb, ob = x[b], L[b], out[b]
        for j in range(16):
            dd = dr[b] * F32(l6[b, j] - 32)
            if dd == 0:
                continue
            for ii in range(16):
                Lb[16 * j + ii] = max(-4, min(3, nint(xb[16 * j + ii] / dd))) + 4
        for j in range(32):  # hmask: bit m of byte j = L[32m + j] > 3, which then loses 4
            hm = 0
            for m in range(8):
                if Lb[32 * m + j] > 3:
                    hm |= 1 << m
                    Lb[32 * m + j] -= 4
            ob[j] = hm
        for h in range(2):  # qs[32h + l] = L[l] | L[l+32] << 2 | L[l+64] << 4 | L[l+96] << 6
            for l in range(32):
                base = 128 * h + l
                ob[32 + 32 * h + l] = (Lb[base] | (Lb[base + 32] << 2) | (Lb[base + 64] << 4)
                                       | (Lb[base + 96] << 6)) & 0xFF
        for j in range(8):  # scales: low nibbles of j and j+8, then the high 2 bits 4 at a time
            ob[96 + j] = ((l6[b, j] & 0xF) | ((l6[b, j + 8] & 0xF) << 4)) & 0xFF
        for k in range(4):
            ob[104 + k] = ((l6[b, k] >> 4) | ((l6[b, k + 4] >> 4) << 2) | ((l6[b, k + 8] >> 4) << 4)
                           | ((l6[b, k + 12] >> 4) << 6)) & 0xFF


def q3_k(x, qw=None):
    """Block: hmask[32] | qs[64] | scales[12] | d f16."""
    n_per_row = x.shape[-1]
    xb = np.ascontiguousarray(x.reshape(-1, QK_K))
    nb = xb.shape[0]
    L = np.empty((nb, QK_K), np.int32)
    l6 = np.empty((nb, 16), np.int32)
    d = np.empty(nb, F32)
    _q3_search(xb, np.empty(0, F32) if qw is None else qw, n_per_row // QK_K, L, l6, d)
    out = np.empty((nb, 110), np.uint8)
    _q3_pack(xb, L, l6, fp16_round(d), out)
    out[:, 108:110] = fp16_bits(d)
    return out


# ------------------------------------------------------------------ Q2_K

@jit
def _q2_search(x, qw, bpr, L, packed, d, dmin):
    """quantize_row_q2_K_ref / _impl up to the fp16 rounding of d/dmin: 16 sub-blocks of 16
    (make_qkx2_quants(16, 3, weights |x|, -0.5, 0.1, 15, use_mad) for _ref; make_qkx3_quants with
    qw*sqrt(sigma2 + x^2), -0.9, 0.05, 36 for _impl), then the 4-bit scale (low nibble) and min
    (high nibble) of each sub-block: against max/15 for _ref, make_qp_quants(16, 15) for _impl."""
    has_qw = qw.shape[0] > 0
    w = np.empty(16, F32)
    laux = np.empty(16, np.int32)
    scales, mins, sw = np.empty(16, F32), np.empty(16, F32), np.empty(16, F32)
    ls, lm = np.empty(16, np.uint8), np.empty(16, np.uint8)
    for b in range(x.shape[0]):
        xb, Lb = x[b], L[b]
        if has_qw:  # quantize_row_q2_K_impl
            sigma2 = block_sigma2(xb, F32(1))
            off = (b % bpr) * QK_K
            for j in range(16):
                sw[j] = impl_weights(xb, qw, off, sigma2, 16 * j, 16, w)
                scales[j], mins[j] = qkx_one(xb[16 * j:16 * j + 16], w, 3, F32(-0.9), F32(0.05), 36, False,
                                             Lb[16 * j:16 * j + 16], laux)
            d[b] = qp_one(scales, sw, 15, ls)
            dmin[b] = qp_one(mins, sw, 15, lm)
            for j in range(16):
                packed[b, j] = (ls[j] | (lm[j] << 4)) & 0xFF
        else:  # quantize_row_q2_K_ref
            for j in range(16):
                for l in range(16):
                    w[l] = abs(xb[16 * j + l])
                scales[j], mins[j] = qkx_one(xb[16 * j:16 * j + 16], w, 3, F32(-0.5), F32(0.1), 15, True,
                                             Lb[16 * j:16 * j + 16], laux)
            max_scale, max_min = F32(0), F32(0)
            for j in range(16):
                if scales[j] > max_scale:
                    max_scale = scales[j]
                if mins[j] > max_min:
                    max_min = mins[j]
            iscale = F32(15) / max_scale if max_scale > 0 else F32(0)
            imin = F32(15) / max_min if max_min > 0 else F32(0)
            for j in range(16):
                q = (nint(iscale * scales[j]) & 0xFF) if max_scale > 0 else 0
                m = ((nint(imin * mins[j]) << 4) & 0xFF) if max_min > 0 else 0
                packed[b, j] = (q | m) & 0xFF
            d[b] = max_scale / F32(15) if max_scale > 0 else F32(0)
            dmin[b] = max_min / F32(15) if max_min > 0 else F32(0)


@jit
def _q2_pack(x, L, packed, dr, dminr, out):
    """Second half of quantize_row_q2_K_*: quants from the fp16-rounded d/dmin, then
    scales[16] | qs[64] into out[:, :80] (d/dmin bytes by the caller)."""
    for b in range(x.shape[0]):
        xb, Lb, ob = x[b], L[b], out[b]
        for j in range(16):
            dd = dr[b] * F32(packed[b, j] & 0xF)
            if dd == 0:
                continue
            dm = dminr[b] * F32(packed[b, j] >> 4)
            for ii in range(16):
                Lb[16 * j + ii] = max(0, min(3, nint((xb[16 * j + ii] + dm) / dd)))
        for j in range(16):
            ob[j] = packed[b, j]
        for h in range(2):
            for l in range(32):
                base = 128 * h + l
                ob[16 + 32 * h + l] = (Lb[base] | (Lb[base + 32] << 2) | (Lb[base + 64] << 4)
                                       | (Lb[base + 96] << 6)) & 0xFF


def q2_k(x, qw=None):
    """Block: scales[16] (low nibble scale, high nibble min) | qs[64] | d f16 | dmin f16."""
    n_per_row = x.shape[-1]
    xb = np.ascontiguousarray(x.reshape(-1, QK_K))
    nb = xb.shape[0]
    L = np.empty((nb, QK_K), np.int32)
    packed = np.empty((nb, 16), np.uint8)
    d, dmin = np.empty(nb, F32), np.empty(nb, F32)
    _q2_search(xb, np.empty(0, F32) if qw is None else qw, n_per_row // QK_K, L, packed, d, dmin)
    out = np.empty((nb, 84), np.uint8)
    _q2_pack(xb, L, packed, fp16_round(d), fp16_round(dmin), out)
    out[:, 80:82] = fp16_bits(d)
    out[:, 82:84] = fp16_bits(dmin)
    return out
