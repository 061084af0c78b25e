#!/usr/bin/env python
"""Benchmark: --auto-precision against fixed formats of the same size (GGUF and gptq), and --fallback.

Section gguf (default): for one model (an HF checkpoint dir) the imatrix is computed once from the
bundled calibration text (quantkit.gguf.imatrix, in memory: the models here are small) and written to a
file; then for each mixture type (default Q3_K_M Q4_K_M Q5_K_M) two whole gated runs of
`quantkit quantize --method gguf --gguf-type T --imatrix FILE`, each in its own process with the same
calibration and evaluation windows:

  mixture  the plain run: llama.cpp's mixture for the type (tensor bytes equal to llama-quantize
           --imatrix FILE, tests/gguf prove it byte for byte), wall seconds of the whole run
  auto     the same run with --auto-precision (sensitivity, the budget at the mixture's size), wall

KLD and top-1 agreement are measured by llama-perplexity --kl-divergence against the F32 GGUF of
the checkpoint (exact: bf16 -> f32) on the bundled text. Reported per type: bytes, KLD and wall of
both, and the ratios auto / mixture. --validate also measures every tensor's KL divergence alone at its
cheapest candidate type and gives the Spearman correlation of the weighted error and of the predicted
damage (gains measured on the probes, interpolated for the rest) with it.
Needs llama-perplexity (scripts/build_llamacpp.sh).

Section gptq: `quantkit quantize --method gptq` three ways, each in its own process with the same
calibration windows (--num-samples x --seq-len of the bundled text) and the same held-out
evaluation windows (--eval-windows x --seq-len): plain W4A16 (int4, group size auto), plain W8A16
(int8 per channel), and --auto-precision (int4/int8/16-bit per layer at W4A16 size +5%). KLD and top-1
are quantkit's gate metrics against the full-precision model; bytes are the artifact's safetensors; the
sensitivity pass's seconds are set against the quantization's.

Section fallback: fp8, smoothquant and nf4 with their default gates, plain and with --fallback (--max-size,
default +25%): the plain run's metrics and verdict, the fallback's steps, the layers it kept 16-bit, its size
cost, final metrics, the sensitivity pass's seconds and its rank correlation, and the wall against the plain run.

Usage: nice python scripts/bench_autoprecision.py --model DIR [--sections gguf gptq fallback]
       [--types Q4_K_M ...] [--work DIR] [--threads 2] [--num-samples 32] [--seq-len 128]
       [--eval-windows 40] [--json out.json] [--validate] [--fallback-methods fp8 smoothquant nf4] [--max-size +25%]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from bench_gguf import LLAMA, make_kld_base  # noqa: E402  (the shared llama.cpp helpers)


def kld(model: Path, base: Path, threads: int, ctx: int) -> dict:
    """llama-perplexity --kl-divergence against the saved base logits (same -c as the base). stdout and
    stderr share one pipe (with two, the summary lines were lost); retried as quantkit.eval.llamacpp does."""
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


# the KLD vs size curve: the k-quant mixes Q2_K ... Q8_0 and the i-quant mixes
CURVE_TYPES = ["IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "Q2_K", "IQ3_XXS", "IQ3_XS", "IQ3_S", "IQ3_M",
               "Q3_K_M", "IQ4_XS", "IQ4_NL", "Q4_K_M", "Q5_K_M", "Q6_K", "Q8_0"]


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True)
    parser.add_argument("--sections", nargs="+", choices=["gguf", "gptq", "fallback"], default=["gguf"])
    parser.add_argument("--types", nargs="+", default=["Q3_K_M", "Q4_K_M", "Q5_K_M"],
                        help='mixture types, or "curve": the KLD vs size curve (CURVE_TYPES)')
    parser.add_argument("--max-size", default="+25%", help="the fallback section's --max-size")
    parser.add_argument("--fallback-methods", nargs="+", choices=["fp8", "smoothquant", "nf4"],
                        default=["fp8", "smoothquant", "nf4"], help="methods of the fallback section")
    parser.add_argument("--work", type=Path, default=Path("/tmp/bench-autoprecision"))
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--measure-windows", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--ctx", type=int, default=128)
    parser.add_argument("--chunks", type=int, default=40)
    parser.add_argument("--eval-windows", type=int, default=40, help="held-out windows of --seq-len tokens (gates)")
    parser.add_argument("--validate", action="store_true", help="also measure single-tensor KLD at Q2_K")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.types == ["curve"]:
        args.types = CURVE_TYPES
    return args


def calibration(model: Path, num_samples: int, seq_len: int):
    from quantkit.engines.transformers import load_tokenizer
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.calibration import make_windows
    from quantkit.run.recipe import Calibration

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
    """Every decoder tensor's KL divergence alone at its cheapest candidate type, against the raw
    weighted error and the predicted damage there (gains from the probes, interpolated for the rest)."""
    from quantkit.mixed.gguf import measure_klds
    from quantkit.mixed.sensitivity import SensitivityRow

    rows = [r for r in table if r.name.startswith("blk.")]
    at = {r.name: r.candidates[0] for r in rows}
    probes = [SensitivityRow(r.name, r.shape, r.errors, at[r.name]) for r in rows]
    measured = measure_klds(info.path, probes, plans, weights, windows)
    return {"tensors": len(rows), "probed": sum(r.kld is not None for r in rows),
            "spearman_error": spearman([r.errors[at[r.name]] for r in rows], [measured[r.name] for r in rows]),
            "spearman_damage": spearman([r.damage(at[r.name]) for r in rows], [measured[r.name] for r in rows])}


def quantkit_run(model: Path, out: Path, flags: list[str], args, enforce: bool = False) -> tuple[dict, float]:
    """One `quantkit quantize` in a child process, its gate measured (and enforced with `enforce`: a failed
    gate writes nothing, exit 3): its report's target entry and the run's wall seconds."""
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    report = out.with_suffix(".json")
    cmd = [sys.executable, "-c", "from quantkit.cli.app import main; main()", "quantize", str(model), *flags,
           "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len),
           "--eval-windows", str(args.eval_windows), *([] if enforce else ["--no-gate"]), "--quiet", "-o", str(out),
           "--json", str(report)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()
    code = subprocess.run(cmd, env=env).returncode
    if code not in ((0, 3) if enforce else (0,)):
        raise RuntimeError(f"quantkit quantize exited {code}: {' '.join(cmd)}")
    return json.loads(report.read_text())["targets"][0], round(time.perf_counter() - started, 2)


def gguf_row(label: str, target: dict, wall: float, out: Path, base: Path, args) -> dict:
    gguf = next(out.glob("*.gguf"))
    details = target["details"]
    row = {"file": label, "bytes": gguf.stat().st_size, "wall_s": wall, "types": details["gguf"]["tensor_types"],
           "gate_kld": target["metrics"]["kld_mean"], **kld(gguf, base, args.threads, args.ctx)}
    if "sensitivity" in details:
        row["sensitivity_s"] = details["sensitivity"]["seconds"]
        row["probes"] = details["sensitivity"]["probes"]
        mixed = details["mixed_precision"]
        row["budget_bytes"] = mixed["budget_bytes"]
        row["kept"] = mixed["measured"]["kept"] if "measured" in mixed else (
            "search (not measured)" if mixed["changed"] else "mixture (search unchanged)")
    return row


def gguf_section(args, work: Path) -> dict:
    from quantkit.gguf.convert import convert

    info, windows = calibration(args.model, args.num_samples, args.seq_len)
    started = time.perf_counter()
    imatrix_file = work / "imatrix.gguf"
    imatrix = compute_imatrix(args.model, windows, imatrix_file)
    result = {"model": str(args.model), "imatrix_s": round(time.perf_counter() - started, 2), "types": {}}
    f32 = work / "f32.gguf"
    convert(args.model, f32, "F32")
    base = make_kld_base(f32, work, args.threads, args.ctx, args.chunks)
    rows = []
    for gguf_type in args.types:
        flags = ["--method", "gguf", "--gguf-type", gguf_type, "--imatrix", str(imatrix_file)]
        plain = gguf_row(f"llama.cpp {gguf_type}", *quantkit_run(args.model, work / f"mix-{gguf_type}", flags, args),
                         work / f"mix-{gguf_type}", base, args)
        auto_out = work / f"auto-{gguf_type}"
        auto = gguf_row(f"auto @{gguf_type}", *quantkit_run(args.model, auto_out, flags + ["--auto-precision"], args),
                        auto_out, base, args)
        rows += [plain, auto]
        for r in (plain, auto):
            print(json.dumps({k: v for k, v in r.items() if k != "types"}), flush=True)
        result["types"][gguf_type] = {"bytes_ratio": round(auto["bytes"] / plain["bytes"], 4),
                                      "kld_ratio": round(auto["kld"] / plain["kld"], 3),
                                      "wall_ratio": round(auto["wall_s"] / plain["wall_s"], 2)}
        print(json.dumps({"type": gguf_type, **result["types"][gguf_type]}), flush=True)
    if args.validate:
        from quantkit.mixed.gguf import Sensitivity

        report = json.loads((work / f"auto-{args.types[0]}.json").read_text())["targets"][0]
        table = Sensitivity.from_dict(report["details"]["sensitivity"]).tensors
        result["validation"] = validate(info, table, plans_for(info, args.types[0]), imatrix.weights(),
                                        windows[:args.measure_windows])
        print(json.dumps(result["validation"]), flush=True)
    result["rows"] = rows
    print(curve_table(rows, f32.stat().st_size), flush=True)
    return result


def curve_table(rows: list[dict], f32_bytes: int) -> str:
    """Markdown: per type, bits per weight (file bytes against the F32 file's) and KLD of the mixture
    and of auto-precision at its size (rows come in pairs: mixture, auto), and the map auto-precision
    kept after measuring its candidates."""
    lines = ["| type | mixture bpw | mixture KLD | auto bpw | auto KLD | auto / mixture KLD | map kept |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for plain, auto in zip(rows[::2], rows[1::2]):
        bpw = [round(32 * r["bytes"] / f32_bytes, 3) for r in (plain, auto)]
        lines.append(f"| {plain['file'].split()[-1]} | {bpw[0]} | {plain['kld']:.6f} | {bpw[1]} | {auto['kld']:.6f} | "
                     f"{auto['kld'] / plain['kld']:.2f}x | {auto.get('kept', '')} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- gptq

GPTQ_VARIANTS = {
    "W4A16": ["--bits", "4"],
    "W8A16": ["--bits", "8", "--group-size", "-1"],
    "auto @W4A16+5%": ["--bits", "4", "--auto-precision"],
}


def gptq_row(label: str, target: dict, wall: float, out: Path) -> dict:
    details = target["details"]
    sens = details.get("sensitivity", {}).get("seconds", {}).get("total", 0.0)
    row = {"artifact": label, "bytes": sum(f.stat().st_size for f in out.glob("*.safetensors")),
           "kld": target["metrics"]["kld_mean"], "top1": target["metrics"]["top1"], "wall_s": wall,
           "quantize_s": round(target["timings"]["quantize_s"] - sens, 2), "sensitivity_s": sens,
           "group_size": target["options"]["group_size"]}
    if "mixed_precision" in details:
        mixed = details["mixed_precision"]
        row.update(counts=mixed["counts"], layer_bytes=mixed["bytes"], w4a16_layer_bytes=mixed["plain_bytes"],
                   sensitivity_parts=details["sensitivity"]["seconds"])
    return row


def gptq_section(args, work: Path) -> dict:
    rows = []
    for label, flags in GPTQ_VARIANTS.items():
        out = work / ("gptq-" + "".join(c if c.isalnum() else "-" for c in label))
        rows.append(gptq_row(label, *quantkit_run(args.model, out, ["--method", "gptq", *flags], args), out))
        print(json.dumps(rows[-1]), flush=True)
    plain, auto = rows[0], rows[-1]
    return {"rows": rows, "kld_ratio_vs_w4a16": round(auto["kld"] / plain["kld"], 3),
            "bytes_ratio_vs_w4a16": round(auto["bytes"] / plain["bytes"], 4),
            "wall_ratio_vs_w4a16": round(auto["wall_s"] / plain["wall_s"], 2)}


# ---------------------------------------------------------------- fallback


def fallback_section(args, work: Path) -> dict:
    """fp8, smoothquant, nf4 with their default gates: plain, then --fallback (default +25%)."""
    from quantkit.methods import get_method

    result = {}
    for method in args.fallback_methods:
        plain, plain_wall = quantkit_run(args.model, work / f"plain-{method}", ["--method", method], args, True)
        fallback, wall = quantkit_run(args.model, work / f"fallback-{method}",
                                      ["--method", method, "--fallback", "--max-size", args.max_size], args, True)
        spec = get_method(method)
        record = fallback["details"].get("fallback", {})
        steps, sensitivity = record.get("steps", []), fallback["details"].get("sensitivity", {})
        result[method] = {
            "gate": spec.default_gate(spec.options()), "plain": {**pick(plain["metrics"]),
                                                                 "passed": plain["gate"]["passed"], "wall_s": plain_wall},
            "fallback": {**pick(fallback["metrics"]), "passed": fallback["gate"]["passed"], "wall_s": wall,
                         "wall_ratio": round(wall / plain_wall, 2), "steps": max(0, len(steps) - 1),
                         "kept_16bit": sum(1 for p in record.get("types", {}).values() if p == "16-bit"),
                         "layers": len(record.get("types", {})),
                         "size_cost": round(record["size_cost_bytes"] / record["first_bytes"], 4) if record else 0.0,
                         "sensitivity_s": sensitivity.get("seconds", {}),
                         "rank_correlation": sensitivity.get("rank_correlation"),
                         "fallback_s": record.get("seconds"), "stopped": record.get("stopped")}}
        print(json.dumps({method: result[method]}), flush=True)
    return result


def pick(metrics: dict) -> dict:
    return {k: round(metrics[k], 6) for k in ("kld_mean", "top1", "ppl_increase")}


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
    if "fallback" in args.sections:
        result["fallback"] = fallback_section(args, work)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
