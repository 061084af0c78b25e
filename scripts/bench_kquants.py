#!/usr/bin/env python
"""Throughput of quantkit's GGUF kernels vs llama.cpp's ggml_quantize_chunk on the same data.

llama.cpp is called through ctypes in libggml-base.so from scripts/build_llamacpp.sh (the
function llama-quantize runs per thread); with --threads N both sides split the rows over N
threads. MB/s counts float32 input bytes. Prints a table; --json writes the rows. Both sides
are timed after a warm-up call (best of --repeat), so numba compilation and llama.cpp's one-time
ggml_quantize_init of the i-quant grids are not counted.

    python scripts/bench_kquants.py [--rows 1024 --cols 4096 --threads 1 --types Q4_K,IQ4_XS]
    python scripts/bench_kquants.py --rows 64 --types IQ3_XXS,IQ2_XS,IQ1_M --clock cpu
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT

from quantkit.gguf import quants

ROOT = Path(__file__).resolve().parent.parent
# every quantized type quantkit has a kernel for (k-quants, legacy, i-quants; REQUIRES_IMATRIX: imatrix rows only)
DEFAULT_TYPES = ",".join(t.name for t in quants.SUPPORTED if t not in (QT.F32, QT.F16, QT.BF16))


def load_harness():
    spec = importlib.util.spec_from_file_location("make_gguf_golden", ROOT / "scripts" / "make_gguf_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def best_time(fn, repeat: int, clock=time.perf_counter) -> float:
    fn()  # warm-up: compilation, grid tables
    times = []
    for _ in range(repeat):
        t0 = clock()
        fn()
        times.append(clock() - t0)
    return min(times)


def llamacpp_runner(harness, lib, x, qtype, imatrix, threads):
    if threads <= 1:
        return lambda: harness.ggml_quantize(lib, x, qtype, imatrix)
    parts = np.array_split(x, threads)

    def run():
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda p: harness.ggml_quantize(lib, p, qtype, imatrix), parts))
    return run


def bench(args) -> list[dict]:
    harness = load_harness()
    lib = harness.load_ggml()
    rng = np.random.default_rng(0)
    x = (rng.standard_t(4, (args.rows, args.cols)) * 0.02).astype(np.float32)
    imatrix = rng.gamma(0.5, 1.0, args.cols).astype(np.float32)
    mb = x.nbytes / 1e6
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    rows = []
    for name in args.types.split(","):
        qtype = QT[name]
        for qw in (None, imatrix):
            if qw is None and qtype in quants.REQUIRES_IMATRIX:
                continue
            ours = best_time(lambda: quants.quantize(x, qtype, qw, threads=args.threads), args.repeat, clock)
            row = {"type": name, "imatrix": qw is not None, "quantkit_MBps": mb / ours}
            if lib is not None:
                ref = best_time(llamacpp_runner(harness, lib, x, qtype, qw, args.threads), args.repeat, clock)
                row["llamacpp_MBps"] = mb / ref
                row["slowdown"] = ours / ref
            rows.append(row)
    return rows


def print_table(rows: list[dict], args) -> None:
    print(f"{args.rows}x{args.cols} float32, threads={args.threads}, best of {args.repeat}, {args.clock} clock")
    print(f"{'type':7} {'imatrix':7} {'quantkit MB/s':>14} {'llama.cpp MB/s':>15} {'slowdown':>9}")
    for r in rows:
        ref = f"{r['llamacpp_MBps']:15.1f}" if "llamacpp_MBps" in r else f"{'n/a':>15}"
        slow = f"{r['slowdown']:8.2f}x" if "slowdown" in r else f"{'n/a':>9}"
        print(f"{r['type']:7} {str(r['imatrix']):7} {r['quantkit_MBps']:14.1f} {ref} {slow}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--cols", type=int, default=4096)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--types", default=DEFAULT_TYPES)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: process CPU time, steadier on a busy machine (compare at --threads 1)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = bench(args)
    print_table(rows, args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
