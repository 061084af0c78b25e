"""The grids of the GGUF i-quants and the neighbour maps llama.cpp builds from them.

The grid-based i-quants (IQ3_XXS, IQ3_S, IQ2_XXS, IQ2_XS, IQ2_S, IQ1_S, IQ1_M) store each
group of 8 (IQ2/IQ1) or 4 (IQ3) values as the index of a point of a fixed grid plus signs. The
quantizer rounds a group to integer levels l (0..2 for IQ2/IQ1, 0..7 for IQ3), packs them into a
key u (2 or 3 bits per coordinate) and looks u up in a map: a grid point, or, for keys that are
not on the grid, a list of its nearest grid points to choose from.

This module rebuilds what ``iq2xs_init_impl`` / ``iq3xs_init_impl`` (ggml-quants.c) build when
llama.cpp calls ``ggml_quantize_init``, with the same content and order:

* ``grid``: int8 (points, dim), coordinate ``2*l + 1``;
* ``kmap``: int32 (keys,), the grid index of an on-grid key, else ``-(offset + 1)`` where
  ``neighbours[offset]`` is the neighbour count n and ``neighbours[offset + 1 : offset + 1 + n]``
  the grid indices;
* the neighbours of a key: all grid points at the ``nwant`` smallest distinct squared distances,
  ordered by (distance, index), which is what C's qsort of (d2, index) pairs yields.

The grid values come from quantkit.gguf.iquant_tables (copied from ggml-quants.c by
scripts/make_iquant_tables.py); the maps are built on first use (numba, well under a second) and
kept for the process.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
from gguf import GGMLQuantizationType as QT

from quantkit.gguf import iquant_tables
from quantkit.gguf.kquants_numba import jit


@dataclass(frozen=True)
class GridSpec:
    """One grid of iq2xs_init_impl / iq3xs_init_impl."""
    kgrid: tuple[int, ...]   # packed points (iquant_tables)
    dim: int                 # coordinates per point: 8 (IQ2/IQ1) or 4 (IQ3)
    bits: int                # bits per coordinate in a key: 2 or 3
    nkeys: int               # kmap_size in C
    nwant: int               # distinct distances kept per off-grid key


GRIDS = {
    QT.IQ2_XXS: GridSpec(iquant_tables.KGRID_IQ2XXS, 8, 2, 43692, 2),
    QT.IQ2_XS: GridSpec(iquant_tables.KGRID_IQ2XS, 8, 2, 43692, 2),
    QT.IQ2_S: GridSpec(iquant_tables.KGRID_IQ2S, 8, 2, 43692, 1),
    QT.IQ1_S: GridSpec(iquant_tables.KGRID_IQ1S, 8, 2, 43692, 3),
    QT.IQ1_M: GridSpec(iquant_tables.KGRID_IQ1S, 8, 2, 43692, 3),
    QT.IQ3_XXS: GridSpec(iquant_tables.KGRID_IQ3XXS, 4, 3, 4096, 2),
    QT.IQ3_S: GridSpec(iquant_tables.KGRID_IQ3S, 4, 3, 4096, 3),
}


def grid_points(spec: GridSpec) -> np.ndarray:
    """int8 (points, dim): coordinate i of point k is 2*((kgrid[k] >> bits*i) & mask) + 1."""
    kgrid = np.asarray(spec.kgrid, dtype=np.int32)[:, None]
    shifts = spec.bits * np.arange(spec.dim)
    levels = (kgrid >> shifts) & ((1 << spec.bits) - 1)
    return (2 * levels + 1).astype(np.int8)


@jit
def _key_points(nkeys, dim, bits):
    """The point 2*l + 1 of every key (what C's init loops decode as ``pos``)."""
    pos = np.empty((nkeys, dim), np.int32)
    mask = (1 << bits) - 1
    for i in range(nkeys):
        for k in range(dim):
            pos[i, k] = 2 * ((i >> (bits * k)) & mask) + 1
    return pos


@jit
def _build_neighbours(grid, keys, on_grid, nwant):
    """(kmap offsets, neighbours) for the off-grid keys, in key order (C's offsets[] layout)."""
    npoints, dim = grid.shape
    nkeys = keys.shape[0]
    kmap = np.empty(nkeys, np.int32)
    out = np.empty(1 << 16, np.uint16)
    used = 0
    d2 = np.empty(npoints, np.int32)
    levels = np.empty(nwant, np.int32)
    hist = np.empty(dim * 14 * 14 + 1, np.int32)  # squared distances are at most dim * 14^2
    for i in range(nkeys):
        if on_grid[i] >= 0:
            kmap[i] = on_grid[i]
            continue
        for j in range(npoints):
            s = 0
            for k in range(dim):
                diff = grid[j, k] - keys[i, k]
                s += diff * diff
            d2[j] = s
        hist[:] = 0
        for j in range(npoints):
            hist[d2[j]] += 1
        nlev, count = 0, 0  # the nwant smallest distinct distances, ascending
        for v in range(hist.shape[0]):
            if hist[v] > 0 and nlev < nwant:
                levels[nlev] = v
                nlev += 1
                count += hist[v]
        while used + 1 + count > out.shape[0]:
            grown = np.empty(2 * out.shape[0], np.uint16)
            grown[:used] = out[:used]
            out = grown
        kmap[i] = -(used + 1)
        out[used] = count
        used += 1
        for lev in range(nlev):
            for j in range(npoints):
                if d2[j] == levels[lev]:
                    out[used] = j
                    used += 1
    return kmap, out[:used].copy()


def grid_tables(qtype: QT) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(grid int8 (points, dim), kmap int32 (keys,), neighbours uint16) of an i-quant type."""
    qtype = QT(qtype)
    return _tables(QT.IQ1_S if qtype == QT.IQ1_M else qtype)  # IQ1_M shares IQ1_S's grid


@cache
def _tables(qtype: QT) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    spec = GRIDS[qtype]
    grid = grid_points(spec)
    on_grid = np.full(spec.nkeys, -1, np.int32)
    levels = (grid.astype(np.int32) - 1) // 2
    keys = (levels << (spec.bits * np.arange(spec.dim))).sum(axis=1)
    on_grid[keys] = np.arange(len(grid), dtype=np.int32)
    kmap, neighbours = _build_neighbours(grid.astype(np.int32), _key_points(spec.nkeys, spec.dim, spec.bits),
                                         on_grid, spec.nwant)
    for arr in (grid, kmap, neighbours):
        arr.setflags(write=False)
    return grid, kmap, neighbours
