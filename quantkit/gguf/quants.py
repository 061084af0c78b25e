"""GGUF quantization kernels, bit-exact with llama.cpp's ``ggml_quantize_chunk``.

gguf-py can write GGUF files and dequantize every type, but it cannot quantize the
k-quants. This module ports the reference quantizers of ``ggml/src/ggml-quants.c`` to
numpy, vectorized across blocks:

* without an imatrix: ``quantize_row_qX_ref`` (what ``quantize_qX`` calls when
  ``quant_weights == NULL``);
* with an imatrix: the weighted ``quantize_row_qX_impl`` paths (Q8_0 ignores it).

Matched llama.cpp: the copy vendored by llama-cpp-python 0.3.36 (llama.cpp commit
0c1e57098bba43ac29e6e3b677cdceebdd22334f); tests/data/gguf_golden holds blocks produced by
that build (see scripts/build_llamacpp.sh and scripts/make_gguf_golden.py).

Floating point rules followed to stay bit-exact:

* every value is float32 and every sum is sequential, left to right (``np.cumsum``
  accumulates in order; ``np.sum`` is pairwise and would round differently);
* ``nearest_int`` is the 1.5*2^23 magic-number trick of ggml, reproduced bit by bit;
* d/dmin are rounded to fp16 (round to nearest even, as ``GGML_FP32_TO_FP16``) and the
  *rounded* values are used when the quants are recomputed;
* C stores into ``uint8_t``/``int8_t`` wrap around; that is emulated where it can happen;
* no fused multiply-add: ggml-quants.c lives in ggml-base, which on x86-64 is compiled for
  the baseline ISA (no FMA, no F16C), so the default llama.cpp build (the one
  llama-cpp-python users get) never contracts ``a*b+c`` there. On aarch64 GCC contracts by
  default, so an ARM build of llama.cpp may differ from this module in rare last-bit cases;
  scripts/build_llamacpp.sh builds with ``-ffp-contract=off`` to keep the reference exact
  everywhere;
* make_qkx2/3_quants update ``min`` in place during the search, so later trial scales are
  measured from the best min found so far (easy to miss, changes ~80% of blocks).

Speed: the scale searches (make_qkx*, make_qx, make_q3, make_qp) dominate. With numba
installed they run as compiled scalar loops mirroring the C (``BACKEND = "numba"``, cached
on disk after the first compile); without it, as vectorized numpy (``"numpy"``, ~3-10x
slower). Both are bit-exact. ``quantize(..., threads=N)`` splits row chunks over N threads
(numba kernels and large numpy ops release the GIL).
"""

from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize as _gguf_dequantize
from gguf.quants import quantize as _gguf_quantize

from quantkit.errors import InputError, UnsupportedError

F32 = np.float32
QK_K = 256
GROUP_MAX_EPS = F32(1e-15)
_MAGIC = F32(12582912.0)  # 1.5 * 2**23
CHUNK_ELEMS = 1 << 19  # elements per work item: bounds temporary memory (~100 MB peak)

SUPPORTED = (
    QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1, QT.Q5_0, QT.Q5_1,
    QT.Q2_K, QT.Q3_K, QT.Q4_K, QT.Q5_K, QT.Q6_K,
)


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

def _np_make_qx_quants(x: np.ndarray, w: np.ndarray | None, nmax: int):
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


def _np_make_q3_quants(x: np.ndarray, nmax: int):
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


def _np_make_qkx_quants(x, w, nmax, rmin, rdelta, nstep, use_mad):
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


def _np_make_qp_quants(x: np.ndarray, w: np.ndarray, nmax: int):
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


# ------------------------------------------------------ numba versions of the searches
#
# The searches above dominate the run time (20-37 trial scales per sub-block). When numba is
# installed the same four C routines run as compiled scalar loops, one sub-block at a time,
# which is ~10x faster than the vectorized numpy versions and equally bit-exact (float32
# everywhere, no fastmath, no FMA contraction). The numpy versions stay as the fallback and
# as a cross-check in the tests. BACKEND selects: "numba" (when importable) or "numpy".

try:  # optional accelerator
    import numba as _numba
except ImportError:  # pragma: no cover - depends on the environment
    _numba = None

BACKEND = "numba" if _numba is not None else "numpy"
# compiled lazily on first call and cached on disk by numba; plain Python when numba is missing
_jit = _numba.njit(cache=True, nogil=True, error_model="numpy") if _numba is not None else (lambda f: f)


@_jit
def _nb_nint(f):
    """nearest_int: (bits(f + 1.5*2^23) & 0x7FFFFF) - 0x400000, without a bit cast."""
    val = f + F32(12582912.0)
    if val >= F32(8388608.0) and val < F32(16777216.0):
        return int(val) - 12582912
    a = abs(val)
    if a != a:
        return 0
    if a == math.inf or a == 0:
        return -0x400000
    m, e = math.frexp(a)
    if e < -125:
        return int(a * 2.0 ** 149) - 0x400000
    return int((2.0 * m - 1.0) * 8388608.0) - 0x400000

@_jit
def _nb_qkx(x, w, nmax, rmin, rdelta, nstep, use_mad, scales, mins, L):
    """make_qkx2_quants / make_qkx3_quants for every row of x (m, n)."""
    m, n = x.shape
    rmin, rdelta = F32(rmin), F32(rdelta)
    laux = np.empty(n, np.int32)
    for r in range(m):
        xr, wr = x[r], w[r]
        mn, mx = xr[0], xr[0]
        sum_w = wr[0]
        sum_x = sum_w * xr[0]
        for i in range(1, n):
            if xr[i] < mn:
                mn = xr[i]
            if xr[i] > mx:
                mx = xr[i]
            sum_w += wr[i]
            sum_x += wr[i] * xr[i]
        if mn > 0:
            mn = F32(0)
        if mx == mn:
            L[r, :] = 0
            mins[r] = -mn
            scales[r] = F32(0)
            continue
        iscale = F32(nmax) / (mx - mn)
        scale = F32(1) / iscale
        best = F32(0)
        for i in range(n):
            L[r, i] = max(0, min(nmax, _nb_nint(iscale * (xr[i] - mn))))
            diff = scale * F32(L[r, i]) + mn - xr[i]
            diff = abs(diff) if use_mad else diff * diff
            best += wr[i] * diff
        for step in range(nstep + 1):
            iscale = (rmin + rdelta * F32(step) + F32(nmax)) / (mx - mn)
            sum_l, sum_l2, sum_xl = F32(0), F32(0), F32(0)
            for i in range(n):
                l = max(0, min(nmax, _nb_nint(iscale * (xr[i] - mn))))
                laux[i] = l
                fl = F32(l)
                sum_l += wr[i] * fl
                sum_l2 += wr[i] * fl * fl
                sum_xl += wr[i] * fl * xr[i]
            D = sum_w * sum_l2 - sum_l * sum_l
            if D > 0:
                this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
                this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
                if this_min > 0:
                    this_min = F32(0)
                    this_scale = sum_xl / sum_l2
                cur = F32(0)
                for i in range(n):
                    diff = this_scale * F32(laux[i]) + this_min - xr[i]
                    diff = abs(diff) if use_mad else diff * diff
                    cur += wr[i] * diff
                if cur < best:
                    L[r, :] = laux
                    best = cur
                    scale = this_scale
                    mn = this_min
        mins[r] = -mn
        scales[r] = scale

@_jit
def _nb_qx(x, w, nmax, scales, L):
    """make_qx_quants(n, nmax, x, L, rmse_type=1, w) for every row; L gets l + nmax."""
    m, n = x.shape
    for r in range(m):
        xr, wr = x[r], w[r]
        vmax, amax = F32(0), F32(0)
        for i in range(n):
            ax = abs(xr[i])
            if ax > amax:
                amax = ax
                vmax = xr[i]
        if amax < F32(1e-15):
            L[r, :] = 0
            scales[r] = F32(0)
            continue
        iscale = F32(-nmax) / vmax
        sumlx, suml2 = F32(0), F32(0)
        for i in range(n):
            l = max(-nmax, min(nmax - 1, _nb_nint(iscale * xr[i])))
            L[r, i] = l + nmax
            sumlx += wr[i] * xr[i] * F32(l)
            suml2 += wr[i] * F32(l) * F32(l)
        scale = sumlx / suml2 if suml2 != 0 else F32(0)
        best = scale * sumlx
        for step in range(-9, 10):
            if step == 0:
                continue
            iscale = -(F32(nmax) + F32(0.1) * F32(step)) / vmax
            sumlx, suml2 = F32(0), F32(0)
            for i in range(n):
                l = max(-nmax, min(nmax - 1, _nb_nint(iscale * xr[i])))
                sumlx += wr[i] * xr[i] * F32(l)
                suml2 += wr[i] * F32(l) * F32(l)
            if suml2 > 0 and sumlx * sumlx > best * suml2:
                for i in range(n):
                    L[r, i] = nmax + max(-nmax, min(nmax - 1, _nb_nint(iscale * xr[i])))
                scale = sumlx / suml2
                best = scale * sumlx
        scales[r] = scale

@_jit
def _nb_q3(x, nmax, scales, L):
    """make_q3_quants(n, nmax, x, L, do_rmse=true) for every row; L gets l + nmax."""
    m, n = x.shape
    for r in range(m):
        xr = x[r]
        vmax, amax = F32(0), F32(0)
        for i in range(n):
            ax = abs(xr[i])
            if ax > amax:
                amax = ax
                vmax = xr[i]
        if amax < F32(1e-15):
            L[r, :] = 0
            scales[r] = F32(0)
            continue
        iscale = F32(-nmax) / vmax
        sumlx, suml2 = F32(0), F32(0)
        for i in range(n):
            l = max(-nmax, min(nmax - 1, _nb_nint(iscale * xr[i])))
            L[r, i] = l
            w = xr[i] * xr[i]
            sumlx += w * xr[i] * F32(l)
            suml2 += w * F32(l) * F32(l)
        for _ in range(5):
            n_changed = 0
            for i in range(n):
                w = xr[i] * xr[i]
                li = F32(L[r, i])
                slx = sumlx - w * xr[i] * li
                if slx > 0:
                    sl2 = suml2 - w * li * li
                    new_l = max(-nmax, min(nmax - 1, _nb_nint(xr[i] * sl2 / slx)))
                    if new_l != L[r, i]:
                        slx += w * xr[i] * F32(new_l)
                        sl2 += w * F32(new_l) * F32(new_l)
                        if sl2 > 0 and slx * slx * suml2 > sumlx * sumlx * sl2:
                            L[r, i] = new_l
                            sumlx = slx
                            suml2 = sl2
                            n_changed += 1
            if n_changed == 0:
                break
        for i in range(n):
            L[r, i] += nmax
        scales[r] = sumlx / suml2 if suml2 > 0 else F32(0)

@_jit
def _nb_qp(x, w, nmax, scales, L):
    """make_qp_quants(n, nmax, x, L, w) for every row; L is uint8 (wraps like C)."""
    m, n = x.shape
    for r in range(m):
        xr, wr = x[r], w[r]
        vmax = F32(0)
        for i in range(n):
            vmax = max(vmax, xr[i])
        if vmax < F32(1e-15):
            L[r, :] = 0
            scales[r] = F32(0)
            continue
        iscale = F32(nmax) / vmax
        for i in range(n):
            L[r, i] = _nb_nint(iscale * xr[i]) & 0xFF
        scale = F32(1) / iscale
        best = F32(0)
        for i in range(n):
            diff = xr[i] - scale * F32(L[r, i])
            best += wr[i] * diff * diff
        for step in range(-4, 5):
            if step == 0:
                continue
            iscale_is = (F32(0.1) * F32(step) + F32(nmax)) / vmax
            scale_is = F32(1) / iscale_is
            mse = F32(0)
            for i in range(n):
                l = min(nmax, _nb_nint(iscale_is * xr[i]))
                diff = xr[i] - scale_is * F32(l)
                mse += wr[i] * diff * diff
            if mse < best:
                best = mse
                iscale = iscale_is
        sumlx, suml2 = F32(0), F32(0)
        for i in range(n):
            l = min(nmax, _nb_nint(iscale * xr[i]))
            L[r, i] = l & 0xFF
            sumlx += wr[i] * xr[i] * F32(l)
            suml2 += wr[i] * F32(l) * F32(l)
        for _ in range(5):
            n_changed = 0
            for i in range(n):
                li = F32(L[r, i])
                slx = sumlx - wr[i] * xr[i] * li
                sl2 = suml2 - wr[i] * li * li
                if slx > 0 and sl2 > 0:
                    new_l = min(nmax, _nb_nint(xr[i] * sl2 / slx))
                    if new_l != L[r, i]:
                        slx += wr[i] * xr[i] * F32(new_l)
                        sl2 += wr[i] * F32(new_l) * F32(new_l)
                        if slx * slx * suml2 > sumlx * sumlx * sl2:
                            L[r, i] = new_l & 0xFF
                            sumlx = slx
                            suml2 = sl2
                            n_changed += 1
            if n_changed == 0:
                break
        scales[r] = sumlx / suml2 if suml2 > 0 else F32(0)


def _nb_out(x: np.ndarray, dtype=np.int32):
    return np.empty(x.shape[0], F32), np.empty(x.shape, dtype)


def _nb_make_qkx_quants(x, w, nmax, rmin, rdelta, nstep, use_mad):
    scales, L = _nb_out(x)
    mins = np.empty(x.shape[0], F32)
    _nb_qkx(np.ascontiguousarray(x), np.ascontiguousarray(w, dtype=F32),
                            nmax, rmin, rdelta, nstep, use_mad, scales, mins, L)
    return scales, mins, L


def _nb_make_qx_quants(x, w, nmax):
    w = x * x if w is None else w
    scales, L = _nb_out(x)
    _nb_qx(np.ascontiguousarray(x), np.ascontiguousarray(w, dtype=F32), nmax, scales, L)
    return scales, L


def _nb_make_q3_quants(x, nmax):
    scales, L = _nb_out(x)
    _nb_q3(np.ascontiguousarray(x), nmax, scales, L)
    return scales, L


def _nb_make_qp_quants(x, w, nmax):
    scales, L = _nb_out(x, np.uint8)
    _nb_qp(np.ascontiguousarray(x), np.ascontiguousarray(w, dtype=F32), nmax, scales, L)
    return scales, L


def make_qx_quants(x, w, nmax):
    """make_qx_quants (rmse_type 1): numba kernel or numpy fallback (see BACKEND)."""
    fn = _nb_make_qx_quants if BACKEND == "numba" else _np_make_qx_quants
    return fn(x, w, nmax)


def make_q3_quants(x, nmax):
    """make_q3_quants (do_rmse): numba kernel or numpy fallback (see BACKEND)."""
    fn = _nb_make_q3_quants if BACKEND == "numba" else _np_make_q3_quants
    return fn(x, nmax)


def make_qkx_quants(x, w, nmax, rmin, rdelta, nstep, use_mad):
    """make_qkx2/3_quants: numba kernel or numpy fallback (see BACKEND)."""
    fn = _nb_make_qkx_quants if BACKEND == "numba" else _np_make_qkx_quants
    return fn(x, w, nmax, rmin, rdelta, nstep, use_mad)


def make_qp_quants(x, w, nmax):
    """make_qp_quants: numba kernel or numpy fallback (see BACKEND)."""
    fn = _nb_make_qp_quants if BACKEND == "numba" else _np_make_qp_quants
    return fn(x, w, nmax)


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

def _q8_0(x: np.ndarray) -> np.ndarray:
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


def _q4_0(x, qw):
    """Block: d f16 | qs[16]. With imatrix: quantize_row_q4_0_impl (make_qx_quants, nmax 8)."""
    if qw is None:
        d, q = _sym_legacy(x.reshape(-1, 32), 8)
    else:
        w = _row_weights(x, qw).reshape(-1, 32)
        d, q = make_qx_quants(x.reshape(-1, 32), w, 8)
    return np.concatenate([fp16_bits(d), _pack_legacy4(q)], axis=1)


def _q5_0(x, qw):
    """Block: d f16 | qh u32 | qs[16]. With imatrix: quantize_row_q5_0_impl (nmax 16)."""
    if qw is None:
        d, q = _sym_legacy(x.reshape(-1, 32), 16)
    else:
        w = _row_weights(x, qw).reshape(-1, 32)
        d, q = make_qx_quants(x.reshape(-1, 32), w, 16)
    return np.concatenate([fp16_bits(d), _qh_legacy5(q), _pack_legacy4(q)], axis=1)


def _asym_impl(x, qw, nmax):
    """quantize_row_q4_1_impl / q5_1_impl: make_qkx3_quants(32, nmax, ..., -0.9, 0.05, 36)."""
    w = _row_weights(x, qw).reshape(-1, 32)
    d, the_min, q = make_qkx_quants(x.reshape(-1, 32), w, nmax, -0.9, 0.05, 36, False)
    return d, -the_min, q


def _q4_1(x, qw):
    """Block: d f16 | m f16 | qs[16]."""
    d, m, q = _asym_legacy(x.reshape(-1, 32), 15) if qw is None else _asym_impl(x, qw, 15)
    return np.concatenate([fp16_bits(d), fp16_bits(m), _pack_legacy4(q)], axis=1)


def _q5_1(x, qw):
    """Block: d f16 | m f16 | qh u32 | qs[16]."""
    d, m, q = _asym_legacy(x.reshape(-1, 32), 31) if qw is None else _asym_impl(x, qw, 31)
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


def _q2_k(x, qw):
    """quantize_row_q2_K_ref / _impl. Block: scales[16] (lo: scale, hi: min) | qs[64] | d | dmin."""
    nb = x.shape[0]
    xs = x.reshape(-1, 16)
    if qw is None:
        scales, mins, L = make_qkx_quants(xs, np.abs(xs), 3, -0.5, 0.1, 15, True)
        scales, mins = scales.reshape(nb, 16), mins.reshape(nb, 16)
        d, dmin, packed = _q2_k_ref_scales(scales, mins)
    else:
        sigma2 = np.repeat(_k_sigma2(x, 1.0), 16)
        w = _block_qw(qw, nb, 16) * np.sqrt(sigma2[:, None] + xs * xs)
        scales, mins, L = make_qkx_quants(xs, w, 3, -0.9, 0.05, 36, False)
        sw = seq_sum(w).reshape(nb, 16)
        d, Ls = make_qp_quants(scales.reshape(nb, 16), sw, 15)
        dmin, Lm = make_qp_quants(mins.reshape(nb, 16), sw, 15)
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


def _q3_k(x, qw):
    """quantize_row_q3_K_ref / _impl. Block: hmask[32] | qs[64] | scales[12] | d."""
    nb = x.shape[0]
    xs = x.reshape(-1, 16)
    if qw is None:
        scales, L = make_q3_quants(xs, 4)
        d, l6 = _q3_k_ref_scales(scales.reshape(nb, 16))
    else:
        sigma2 = np.repeat(_k_sigma2(x, 2.0), 16)
        w = _block_qw(qw, nb, 16) * np.sqrt(sigma2[:, None] + xs * xs)
        scales, L = make_qx_quants(xs, w, 4)
        d, l6 = make_qx_quants(scales.reshape(nb, 16), seq_sum(w).reshape(nb, 16), 32)
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


def _q45_k_scales(x, qw, nmax, ref_params):
    """Sub-block search shared by Q4_K/Q5_K: returns (d, dmin, packed scales[12], xs, L)."""
    nb = x.shape[0]
    xs = x.reshape(-1, 32)
    if qw is None:  # quantize_row_q{4,5}_K_ref
        av_x = np.sqrt(seq_sum(xs * xs) / F32(32))
        scales, mins, L = make_qkx_quants(xs, av_x[:, None] + np.abs(xs), nmax, *ref_params, False)
        d, dmin, ls, lm = _k4_ref_scales(scales.reshape(nb, 8), mins.reshape(nb, 8))
    else:  # quantize_row_q{4,5}_K_impl
        sigma2 = np.repeat(_k_sigma2(x, 2.0), 8)
        w = _block_qw(qw, nb, 32) * np.sqrt(sigma2[:, None] + xs * xs)
        scales, mins, L = make_qkx_quants(xs, w, nmax, -0.9, 0.05, 36, False)
        sw = seq_sum(w).reshape(nb, 8)
        d, ls = make_qp_quants(scales.reshape(nb, 8), sw, 63)
        dmin, lm = make_qp_quants(mins.reshape(nb, 8), sw, 63)
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


def _q4_k(x, qw):
    """Block: d f16 | dmin f16 | scales[12] | qs[128]."""
    nb = x.shape[0]
    d, dmin, packed, xs, L = _q45_k_scales(x, qw, 15, (-1.0, 0.1, 20))
    sc, m = unpack_scale_min_k4(packed)
    L = _requant_asym(xs, fp16_round(d), fp16_round(dmin), sc, m, 15, L).reshape(nb, QK_K)
    return np.concatenate([fp16_bits(d), fp16_bits(dmin), packed, pack_nibbles_k(L)], axis=1)


def _q5_k(x, qw):
    """Block: d f16 | dmin f16 | scales[12] | qh[32] | qs[128]."""
    nb = x.shape[0]
    d, dmin, packed, xs, L = _q45_k_scales(x, qw, 31, (-0.5, 0.1, 15))
    sc, m = unpack_scale_min_k4(packed)
    L = _requant_asym(xs, fp16_round(d), fp16_round(dmin), sc, m, 31, L).reshape(nb, QK_K)
    parts = [fp16_bits(d), fp16_bits(dmin), packed, pack_q5_high(L), pack_nibbles_k(L)]
    return np.concatenate(parts, axis=1)


def _q6_k(x, qw):
    """quantize_row_q6_K_ref / _impl. Block: ql[128] | qh[64] | int8 scales[16] | d."""
    nb = x.shape[0]
    xs = x.reshape(-1, 16)
    w = None if qw is None else _block_qw(qw, nb, 16)  # _impl passes the raw imatrix
    scales, L = make_qx_quants(xs, w, 32)
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


# ------------------------------------------------------------------------------- API

_ROW_KERNELS = {QT.Q4_0: _q4_0, QT.Q4_1: _q4_1, QT.Q5_0: _q5_0, QT.Q5_1: _q5_1}
_BLOCK_KERNELS = {QT.Q2_K: _q2_k, QT.Q3_K: _q3_k, QT.Q4_K: _q4_k, QT.Q5_K: _q5_k, QT.Q6_K: _q6_k}


def _check(data: np.ndarray, qtype, imatrix):
    if qtype not in SUPPORTED:
        names = ", ".join(t.name for t in SUPPORTED)
        raise UnsupportedError(f"GGUF type {QT(qtype).name} is not supported; supported: {names}")
    block_size, _ = GGML_QUANT_SIZES[qtype]
    n = data.shape[-1]
    if n % block_size != 0:
        raise UnsupportedError(
            f"{QT(qtype).name} needs rows that are a multiple of {block_size} values, got {n}")
    if imatrix is not None and np.shape(imatrix) != (n,):
        raise InputError(f"imatrix has shape {np.shape(imatrix)}, expected ({n},)")


def _quantize_rows(x: np.ndarray, qtype, qw) -> np.ndarray:
    """Quantize a (rows, n_per_row) float32 chunk to (rows, row_bytes) uint8."""
    rows, n = x.shape
    if qtype == QT.Q8_0:
        out = _q8_0(x)
    elif qtype in _ROW_KERNELS:
        out = _ROW_KERNELS[qtype](x, qw)
    else:
        out = _BLOCK_KERNELS[qtype](x.reshape(-1, QK_K), qw)
    return out.reshape(rows, -1)


def _chunks(rows: int, n: int):
    step = max(1, CHUNK_ELEMS // n)
    return [(r, min(rows, r + step)) for r in range(0, rows, step)]


def quantize(data: np.ndarray, qtype: QT, imatrix: np.ndarray | None = None,
             *, threads: int = 1) -> np.ndarray:
    """Quantize float data along its last axis exactly like llama.cpp's ggml_quantize_chunk.

    data: float array (..., n_per_row). imatrix: None or (n_per_row,) per-column importance
    (selects the weighted quantize_row_*_impl paths; ignored by Q8_0/F16/BF16/F32).
    threads: row chunks are spread over this many threads (numpy releases the GIL).
    Returns uint8 of shape gguf.quant_shape_to_byte_shape(data.shape, qtype).
    """
    qtype = QT(qtype)
    data = np.asarray(data)
    _check(data, qtype, imatrix)
    x = np.ascontiguousarray(data, dtype=F32)
    if qtype in (QT.F32, QT.F16):
        dtype = F32 if qtype == QT.F32 else np.float16
        return x.astype(dtype).view(np.uint8)
    if qtype == QT.BF16:
        return _gguf_quantize(x, qtype).view(np.uint8)
    qw = None if imatrix is None else np.ascontiguousarray(imatrix, dtype=F32)
    x2 = x.reshape(-1, x.shape[-1])
    _, type_size = GGML_QUANT_SIZES[qtype]
    block_size = GGML_QUANT_SIZES[qtype][0]
    out = np.empty((x2.shape[0], x2.shape[1] // block_size * type_size), dtype=np.uint8)

    def work(span):
        out[span[0]:span[1]] = _quantize_rows(x2[span[0]:span[1]], qtype, qw)

    spans = _chunks(x2.shape[0], x2.shape[1])
    if threads > 1 and len(spans) > 1:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(work, spans))
    else:
        for span in spans:
            work(span)
    return out.reshape(*data.shape[:-1], out.shape[-1])


def dequantize(data: np.ndarray, qtype: QT) -> np.ndarray:
    """Bytes from quantize() back to float32 (delegates to gguf-py)."""
    return _gguf_dequantize(data, QT(qtype))
