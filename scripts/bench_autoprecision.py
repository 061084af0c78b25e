#!/usr/bin/env python
"""Benchmark: --auto-precision against fixed formats of the same size (GGUF and gptq).

Section gguf (default): GGUF --auto-precision vs llama.cpp's fixed mixtures at the same size and
imatrix. For one model (an HF checkpoint dir): the imatrix is computed once from the bundled
calibration text (quantkit.gguf.imatrix, in memory: the models here are small); then for each
mixture type (default Q3_K_M Q4_K_M Q5_K_M):

  mixture  quantkit's file for that type with the imatrix: the types and bytes of llama-quantize
           --imatrix (tests/gguf prove it byte for byte)
  auto     quantkit's sensitivity table (weighted errors + single-tensor KLD measured on
           --measure-windows calibration windows) and the greedy knapsack at the mixture's byte size

KLD and top-1 agreement are measured by llama-perplexity --kl-divergence against the F32 GGUF of
the checkpoint (exact: bf16 -> f32) on the bundled text. Also reported: the Spearman correlation of
the raw weighted error and of the KLD-scaled damage with the measured single-tensor KLD at
Q2_K (--validate), and the sensitivity pass's seconds next to the quantization's.
Needs llama-perplexity (scripts/build_llamacpp.sh).

Section gptq: `quantkit quantize --method gptq` three ways, each in its own process with the same
calibration windows (--num-samples x --seq-len of the bundled text) and the same held-out
evaluation windows (--eval-windows x --seq-len): plain W4A16 (int4 g128 sym), plain W8A16 (int8 per
channel), and --auto-precision (int4/int8/16-bit per layer at W4A16 size +5%). KLD and top-1 are
quantkit's gate metrics against the full-precision model; bytes are the artifact's safetensors; the
sensitivity pass's seconds (details.sensitivity.seconds.total, measure_windows 8, its default) are set
against the quantization's (the rest of the quantize step).

Usage: nice python scripts/bench_autoprecision.py --model DIR [--sections gguf gptq] [--types Q4_K_M ...]
       [--work DIR] [--measure-windows 8] [--threads 2] [--eval-windows 40] [--json out.json] [--validate]
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
    parser.add_argument("--sections", nargs="+", choices=["gguf", "gptq"], default=["gguf"])
    parser.add_argument("--types", nargs="+", default=["Q3_K_M", "Q4_K_M", "Q5_K_M"])
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-autoprecision"))
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--measure-windows", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=128)
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument("--eval-windows", type=int, default=40, help="gptq: held-out windows of --seq-len tokens")
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


def gguf_section(args, work: Path) -> dict:
    from quantkit.gguf import budget, sensitivity
    from quantkit.gguf.convert import convert

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
    return result


# ---------------------------------------------------------------- gptq

GPTQ_VARIANTS = {
    "W4A16 g128": ["--bits", "4", "--group-size", "128"],
    "W8A16": ["--bits", "8", "--group-size", "-1"],
    "auto @W4A16+5%": ["--bits", "4", "--group-size", "128", "--auto-precision"],
}


def quantkit_quantize(model: Path, out: Path, flags: list[str], args) -> dict:
    """One `quantkit quantize --method gptq --no-gate` in a child process; its report's target entry."""
    import os
    import shutil
    import subprocess

    shutil.rmtree(out, ignore_errors=True)
    report = out.with_suffix(".json")
    cmd = [sys.executable, "-c", "from quantkit.cli.app import main; main()", "quantize", str(model),
           "--method", "gptq", *flags, "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len),
           "--eval-windows", str(args.eval_windows), "--no-gate", "--quiet", "-o", str(out), "--json", str(report)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    subprocess.run(cmd, check=True, env=env)
    return json.loads(report.read_text())["targets"][0]


def gptq_row(label: str, target: dict, out: Path) -> dict:
    details = target["details"]
    sens = details.get("sensitivity", {}).get("seconds", {}).get("total", 0.0)
    row = {"artifact": label, "bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
           "kld": target["metrics"]["kld_mean"], "top1": target["metrics"]["top1"],
           "quantize_s": round(target["timings"]["quantize_s"] - sens, 2), "sensitivity_s": sens}
    if "mixed_precision" in details:
        mixed = details["mixed_precision"]
        row.update(counts=mixed["counts"], layer_bytes=mixed["bytes"], w4a16_layer_bytes=mixed["w4a16_bytes"],
                   sensitivity_parts=details["sensitivity"]["seconds"])
    return row


def gptq_section(args, work: Path) -> dict:
    rows = []
    for label, flags in GPTQ_VARIANTS.items():
        out = work / ("gptq-" + "".join(c if c.isalnum() else "-" for c in label))
        rows.append(gptq_row(label, quantkit_quantize(args.model, out, flags, args), out))
        print(json.dumps(rows[-1]), flush=True)
    plain, auto = rows[0], rows[-1]
    return {"rows": rows, "kld_ratio_vs_w4a16": round(auto["kld"] / plain["kld"], 3),
            "bytes_ratio_vs_w4a16": round(auto["bytes"] / plain["bytes"], 4),
            "sensitivity_vs_quantize": round(auto["sensitivity_s"] / auto["quantize_s"], 2)}


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    result = {"model": str(args.model)}
    if "gguf" in args.sections:
        result.update(gguf_section(args, work))  # top level, as before the gptq section existed
    if "gptq" in args.sections:
        result["gptq"] = gptq_section(args, work)
        print(json.dumps({k: v for k, v in result["gptq"].items() if k != "rows"}), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
