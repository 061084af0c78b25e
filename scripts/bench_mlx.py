#!/usr/bin/env python
"""Benchmark: mlx-lm's own round-to-nearest (`mlx_lm.convert -q`) vs quantkit's calibrated MLX export.

For each bits / group size: `mlx_lm.convert(MODEL, quantize=True, q_bits, q_group_size)` and
`python -m quantkit quantize MODEL --method mlx --bits B --group-size G` (its calibration windows,
gate not enforced) write two mlx-lm directories of the same modules in the same format. Both are
loaded with `mlx_lm.load`, as is the 16-bit base, their quantized modules dequantized by mlx
(`mlx_lm.utils.dequantize_model`), and the weights run in float32 through the base's transformers
architecture (mlx's CPU kernels are too slow for this on a small machine) on the same held-out
windows (quantkit's evaluation windows for the run's seed: disjoint from its calibration windows). Reported
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
    parser.add_argument("--work", type=Path, default=None, help="where the artifacts go (default: a temporary dir); "
                        "an artifact already there is measured, not written again")
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args(argv)


def eval_windows(model: Path, args):
    """quantkit's held-out windows for the run's settings (the ones its gate measures on)."""
    from transformers import AutoTokenizer

    from quantkit.run.calibration import make_windows
    from quantkit.run.recipe import Calibration

    spec = Calibration(num_samples=args.num_samples, seq_len=args.seq_len, eval_windows=args.eval_windows)
    return make_windows(AutoTokenizer.from_pretrained(model), spec).eval.numpy()


def mlx_weights(path: Path) -> dict:
    """Every parameter as mlx_lm.load builds the model, quantized modules dequantized by mlx itself
    (mlx_lm.utils.dequantize_model), in float32."""
    import mlx.core as mx
    import torch
    from mlx.utils import tree_flatten
    from mlx_lm import load
    from mlx_lm.utils import dequantize_model

    mx.set_default_device(mx.cpu)
    model, _tokenizer = load(str(path))
    params = tree_flatten(dequantize_model(model).parameters())
    return {name: torch.from_numpy(np.array(value.astype(mx.float32))) for name, value in params}


def log_probs(base: Path, weights: dict | None, windows):
    """float32 log-probs (windows, positions, vocab): the base's architecture in float32 with `weights`
    (None: the base's own), run by transformers on the CPU. mlx's CPU kernels take minutes per window
    on a 2-core machine; the weights are mlx-lm's either way."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if weights is not None:
        loading = model.load_state_dict(weights, strict=False)
        if loading.unexpected_keys or [k for k in loading.missing_keys if k != "lm_head.weight"]:
            raise SystemExit(f"mlx-lm's parameters do not match the base: {loading}")
        model.tie_weights()
    with torch.no_grad():
        return np.stack([model(torch.from_numpy(row[None])).logits[0].log_softmax(-1).numpy() for row in windows])


def compare(base, other) -> dict:
    kld = (np.exp(base) * (base - other)).sum(-1)
    return {"kld_mean": float(kld.mean()), "top1": float((base.argmax(-1) == other.argmax(-1)).mean())}


def weight_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("model*.safetensors"))


def mlx_lm_rtn(model: Path, out: Path, bits: int, group_size: int, args) -> float:
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
    base = log_probs(args.model, mlx_weights(args.model), windows)
    rows = []
    for group_size in args.group_size:
        for bits in args.bits:
            for tool, writer in (("mlx_lm.convert -q (RTN)", mlx_lm_rtn), ("quantkit --method mlx", quantkit_mlx)):
                out = work / f"{'rtn' if writer is mlx_lm_rtn else 'quantkit'}-{bits}bit-g{group_size}"
                seconds = None if out.exists() else round(writer(args.model, out, bits, group_size, args), 1)
                rows.append({"tool": tool, "bits": bits, "group_size": group_size, "bytes": weight_bytes(out),
                             "seconds": seconds, **compare(base, log_probs(args.model, mlx_weights(out), windows))})
                print(rows[-1], file=sys.stderr, flush=True)
    print(f"model {args.model}: {len(windows)} x {windows.shape[1]} held-out tokens; base and artifacts loaded "
          "by mlx_lm.load (quantized modules dequantized by mlx), run in float32\n")
    print("| bits | group | tool | weight bytes | KLD mean | top-1 | seconds |")
    print("|---:|---:|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['bits']} | {r['group_size']} | {r['tool']} | {r['bytes']:,} | {r['kld_mean']:.5f} | "
              f"{100 * r['top1']:.2f}% | {r['seconds'] if r['seconds'] is not None else '(reused)'} |")
    if args.json:
        args.json.write_text(json.dumps({"model": str(args.model), "windows": list(windows.shape), "rows": rows},
                                        indent=2) + "\n")


if __name__ == "__main__":
    main()
