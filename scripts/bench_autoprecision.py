#!/usr/bin/env python
"""Benchmark: GGUF --auto-precision vs llama.cpp's fixed mixtures at the same size and imatrix.

For one model (an HF checkpoint dir): the imatrix is computed once from the bundled calibration
text (quantkit.gguf.imatrix, in memory: the models here are small); then for each mixture type
(default Q3_K_M Q4_K_M Q5_K_M):

  mixture  quantkit's file for that type with the imatrix: the types and bytes of llama-quantize
           --imatrix (tests/gguf prove it byte for byte)
  auto     quantkit's sensitivity table (weighted errors + single-tensor KLD measured on
           --measure-windows calibration windows) and the greedy knapsack at the mixture's byte size

KLD and top-1 agreement are measured by llama-perplexity --kl-divergence against the F32 GGUF of
the checkpoint (exact: bf16 -> f32) on the bundled text. Also reported: the Spearman correlation of
the raw weighted error and of the KLD-scaled damage with the measured single-tensor KLD at
Q2_K (--validate), and the sensitivity pass's seconds next to the quantization's.

Usage: nice python scripts/bench_autoprecision.py --model DIR [--types Q4_K_M ...] [--work DIR]
       [--measure-windows 8] [--threads 2] [--json out.json] [--validate]
Needs llama-perplexity (scripts/build_llamacpp.sh).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_gguf import LLAMA, make_kld_base  # noqa: E402  (the shared llama.cpp helpers)


def kld(model: Path, base: Path, threads: int, ctx: int) -> dict:
    """llama-perplexity --kl-divergence against the saved base logits (same -c as the base). stdout and
    stderr share one pipe (with two, the summary lines were lost); retried as quantkit.llamacpp does."""
    import re
    import subprocess

    cmd = [str(LLAMA / "bin" / "llama-perplexity"), "-m", str(model), "--kl-divergence-base", str(base),
           "--kl-divergence", "-t", str(threads), "-c", str(ctx)]
    for _attempt in range(10):
        text = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True).stdout
        mean = re.search(r"Mean\s+KLD:\s+([-0-9.eE+]+)", text)
        top = re.search(r"Same top p:\s+([0-9.]+)", text)
        if mean and top:
            return {"kld": float(mean.group(1)), "top1": float(top.group(1)) / 100}
    raise RuntimeError(f"llama-perplexity gave no KLD for {model.name}: {text[-500:]}")


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--types", nargs="+", default=["Q3_K_M", "Q4_K_M", "Q5_K_M"])
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-autoprecision"))
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--measure-windows", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=128)
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument("--validate", action="store_true", help="also measure single-tensor KLD at Q2_K")
    parser.add_argument("--json", type=Path)
    return parser.parse_args(argv)


def calibration(model: Path, num_samples: int, seq_len: int):
    from quantkit.calibration import make_windows
    from quantkit.model import check_model_dir, load_tokenizer
    from quantkit.recipe import Calibration

    info = check_model_dir(model)
    return info, make_windows(load_tokenizer(info), Calibration(num_samples=num_samples, seq_len=seq_len)).calib


def compute_imatrix(model: Path, windows, out: Path):
    import torch
    from transformers import AutoModelForCausalLM

    from quantkit.gguf import imatrix as im

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    return im.read(im.write(im.compute(net, windows, net.config.to_dict(), batch_size=4), out))


def plans_for(info, gguf_type: str):
    from quantkit.gguf.convert import load_hparams, plan_tensors

    hp = {**load_hparams(info.path), "architectures": info.config.get("architectures")}
    return plan_tensors(hp, info.tensors, gguf_type, has_imatrix=True, model_dir=info.path)


def spearman(a, b) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def validate(info, table, plans, weights, windows) -> dict:
    """Single-tensor KLD at Q2_K vs the raw weighted error and vs the damage predicted from Q3_K."""
    from quantkit.gguf.mixture import T
    from quantkit.gguf.sensitivity import TensorSensitivity, measure_klds

    rows = [r for r in table.tensors if r.name.startswith("blk.")]
    probes = [TensorSensitivity(r.name, r.shape, r.mixture, r.errors, probe="Q2_K") for r in rows]
    measure_klds(info.path, probes, plans, weights, windows)
    measured = [p.kld for p in probes]
    return {"tensors": len(rows), "spearman_error": spearman([r.errors["Q2_K"] for r in rows], measured),
            "spearman_damage": spearman([r.damage(T.Q2_K) for r in rows], measured)}


def main(argv=None) -> int:
    from quantkit.gguf import budget, sensitivity
    from quantkit.gguf.convert import convert

    args = parse_args(sys.argv[1:] if argv is None else argv)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    info, windows = calibration(args.model, args.num_samples, args.seq_len)
    started = time.perf_counter()
    imatrix = compute_imatrix(args.model, windows, work / "imatrix.gguf")
    imatrix_s = time.perf_counter() - started
    weights = imatrix.weights()
    f32 = work / "f32.gguf"
    convert(args.model, f32, "F32")
    base = make_kld_base(f32, work, args.threads, args.ctx, args.chunks)
    rows, result = [], {"model": str(args.model), "imatrix_s": round(imatrix_s, 2)}
    started = time.perf_counter()
    table = sensitivity.measure(info.path, plans_for(info, args.types[0]), weights, weights, windows,
                                args.measure_windows, args.threads, work)
    result["sensitivity_s"] = round(time.perf_counter() - started, 2)
    result["sensitivity_parts"] = table.seconds
    print(json.dumps(result), flush=True)
    for gguf_type in args.types:
        started = time.perf_counter()
        mixture = convert(args.model, work / f"mix-{gguf_type}.gguf", gguf_type, imatrix=weights, threads=args.threads)
        quantize_s = time.perf_counter() - started
        allowed = sum(budget.nbytes(p.shape, p.qtype) for p in sensitivity.quantized_plans(plans_for(info, gguf_type)))
        types = budget.assign_types(table.tensors, allowed)
        auto = convert(args.model, work / f"auto-{gguf_type}.gguf", gguf_type, imatrix=weights, threads=args.threads,
                       types=types)
        for label, res in (("llama.cpp " + gguf_type, mixture), ("auto @" + gguf_type, auto)):
            row = {"file": label, "bytes": res.bytes, "quantize_s": round(quantize_s, 2), "types": res.type_counts,
                   **kld(res.path, base, args.threads, args.ctx)}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.validate:
        result["validation"] = validate(info, table, plans_for(info, args.types[-1]), weights, windows)
        print(json.dumps(result["validation"]), flush=True)
    result["rows"] = rows
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
