#!/usr/bin/env python
"""Benchmark: mlx-lm's own round-to-nearest (`mlx_lm.convert -q`) vs quantkit's calibrated MLX export.

For each bits / group size: `mlx_lm.convert(MODEL, quantize=True, q_bits, q_group_size)` and
`python -m quantkit quantize MODEL --method mlx --bits B --group-size G` (its calibration windows,
gate not enforced) write two mlx-lm directories of the same modules in the same format. Both are
loaded with `mlx_lm.load` on the CPU, as is the 16-bit base, and run on the same held-out windows
(quantkit's evaluation windows for the run's seed: disjoint from its calibration windows). Reported
per row: weight bytes (model*.safetensors), mean KL(base || quantized) of the next-token
distributions, top-1 agreement with the base, and the seconds each tool took.

Usage: python scripts/bench_mlx.py MODEL [--bits 4 3 2] [--group-size 64] [--num-samples 64]
       [--seq-len 256] [--eval-windows 16] [--work DIR] [--json out.json]
MODEL: a Hugging Face checkpoint of a family mlx-lm loads (scripts/train_reference_model.py OUT
--preset smol576 trains the one docs/mlx.md reports). Needs `pip install "quantkit[mlx]"`.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's quantkit, also when run from elsewhere


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path)
    parser.add_argument("--bits", type=int, nargs="+", default=[4, 3, 2])
    parser.add_argument("--group-size", type=int, nargs="+", default=[64])
    parser.add_argument("--num-samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--eval-windows", type=int, default=16)
    parser.add_argument("--work", type=Path, default=None, help="where the artifacts go (default: a temporary dir)")
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args(argv)


def eval_windows(model: Path, args) -> "object":
    """quantkit's held-out windows for the run's settings (the ones its gate measures on)."""
    from transformers import AutoTokenizer

    from quantkit.run.calibration import make_windows
    from quantkit.run.recipe import Calibration

    spec = Calibration(num_samples=args.num_samples, seq_len=args.seq_len, eval_windows=args.eval_windows)
    return make_windows(AutoTokenizer.from_pretrained(model), spec).eval.numpy()


def mlx_log_probs(path: Path, windows):
    """float32 log-probs (windows, positions, vocab) of a directory mlx_lm.load reads, on the CPU."""
    import mlx.core as mx
    from mlx_lm import load

    mx.set_default_device(mx.cpu)
    model, _tokenizer = load(str(path))
    out = []
    for row in windows:
        logits = model(mx.array(row[None])).astype(mx.float32)
        out.append(np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0])
    return np.stack(out)


def compare(base, other) -> dict:
    kld = (np.exp(base) * (base - other)).sum(-1)
    return {"kld_mean": float(kld.mean()), "top1": float((base.argmax(-1) == other.argmax(-1)).mean())}


def weight_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("model*.safetensors"))


def mlx_lm_rtn(model: Path, out: Path, bits: int, group_size: int) -> float:
    started = time.perf_counter()
    code = (f"from mlx_lm import convert; convert({str(model)!r}, {str(out)!r}, quantize=True, "
            f"q_bits={bits}, q_group_size={group_size})")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return time.perf_counter() - started


def quantkit_mlx(model: Path, out: Path, bits: int, group_size: int, args) -> float:
    started = time.perf_counter()
    subprocess.run([sys.executable, "-m", "quantkit", "quantize", str(model), "--method", "mlx", "--bits", str(bits),
                    "--group-size", str(group_size), "--num-samples", str(args.num_samples), "--seq-len",
                    str(args.seq_len), "--eval-windows", "0", "--quiet", "-o", str(out)], check=True, cwd=ROOT)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="bench-mlx-"))
    work.mkdir(parents=True, exist_ok=True)
    windows = eval_windows(args.model, args)
    base = mlx_log_probs(args.model, windows)
    rows = []
    for group_size in args.group_size:
        for bits in args.bits:
            for tool, run in (("mlx_lm.convert -q (RTN)", lambda o: mlx_lm_rtn(args.model, o, bits, group_size)),
                              ("quantkit --method mlx", lambda o: quantkit_mlx(args.model, o, bits, group_size, args))):
                out = work / f"{'rtn' if 'RTN' in tool else 'quantkit'}-{bits}bit-g{group_size}"
                seconds = run(out)
                rows.append({"tool": tool, "bits": bits, "group_size": group_size, "bytes": weight_bytes(out),
                             "seconds": round(seconds, 1), **compare(base, mlx_log_probs(out, windows))})
    print(f"model {args.model}: {len(windows)} x {windows.shape[1]} held-out tokens, base and artifacts "
          "read by mlx_lm.load on the CPU\n")
    print("| bits | group | tool | weight bytes | KLD mean | top-1 | seconds |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['bits']} | {r['group_size']} | {r['tool']} | {r['bytes']:,} | {r['kld_mean']:.5f} | "
              f"{100 * r['top1']:.2f}% | {r['seconds']} |")
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "windows": list(windows.shape), "rows": rows},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
