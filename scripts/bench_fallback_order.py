#!/usr/bin/env python
"""Benchmark: fp8 --fallback on a model whose weighted-error proxy ranks the layers poorly, before and after
the fallback's measured order (quantkit.mixed.ordering), same model, same flags, one run after the other.

The model (unless --model is given): quantkit.toy's `deep256` preset (8 layers of width 256, vocabulary 2048)
trained on the bundled text, sharpened (quantkit.toy.sharpen: --logit-scale 32, float32, outlier channels in
every attention block) and then blinded (quantkit.toy.blind_the_proxy: in every layer q/k, v/o and up/down
rescaled against each other by seeded powers of two; the function and its fp8 quantization are unchanged, the
layers' weighted errors move by up to 4^4). Its proxy ranks the probes with Spearman's rho about 0.2.

Runs, each `quantkit quantize MODEL --method fp8` in its own process with the same calibration and evaluation
windows and the gate --max-kld (Δppl left loose: the sharpened toy's perplexity means little):

  plain     the gated run without --fallback (it fails), this tree's code
  before    --fallback --max-size S with the code in --before (a source tree, e.g. `git archive REV | tar -x`)
  after     the same with this tree's code

for each --max-size S. Reported: passed, KLD, measured steps, bytes against the first artifact, wall seconds and
their ratio to the plain run, the rank correlation and the order used.

Usage: nice python scripts/bench_fallback_order.py --before SRC [--model DIR] [--work DIR]
       [--max-size +25% +100%] [--max-kld 0.002] [--num-samples 32] [--seq-len 256] [--eval-windows 4]
       [--json out.json]
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
sys.path.insert(0, str(ROOT))  # this tree's quantkit, whatever is installed


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", type=Path, required=True, help="source tree of the code to compare against")
    parser.add_argument("--model", type=Path, default=None, help="default: build the blinded deep256 model")
    parser.add_argument("--work", type=Path, default=Path("bench-fallback-order"))
    parser.add_argument("--max-size", nargs="+", default=["+25%", "+100%"])
    parser.add_argument("--max-kld", default="0.002")
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--eval-windows", type=int, default=4)
    parser.add_argument("--json", type=Path, default=None)
    return parser.parse_args(argv)


def blinded_model(work: Path) -> Path:
    """The deep256 model, trained, sharpened and blinded (module docstring); built once under `work`."""
    from quantkit.toy import blind_the_proxy, make_toy_model, sharpen

    blinded = work / "deep256-blind"
    if not blinded.exists():
        trained = work / "deep256-trained"
        if not trained.exists():
            make_toy_model(trained, "deep256")
        sharp = work / "deep256-sharp"
        if not sharp.exists():
            sharpen(trained, sharp, logit_scale=32, dtype="float32")
        blind_the_proxy(sharp, blinded)
    return blinded


def quantize(root: Path, model: Path, out: Path, flags: list[str], args) -> tuple[dict, float]:
    """One gated `quantkit quantize` with the code under `root`, in its own process (exit 0 or 3): its report's
    target entry and the wall seconds."""
    import shutil

    shutil.rmtree(out, ignore_errors=True)
    report = out.with_suffix(".json")
    cmd = [sys.executable, "-c", "from quantkit.cli.app import main; main()", "quantize", str(model),
           "--method", "fp8", *flags, "--max-kld", args.max_kld, "--max-ppl-increase", "10",
           "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len),
           "--eval-windows", str(args.eval_windows), "--quiet", "-o", str(out), "--json", str(report)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    started = time.perf_counter()
    code = subprocess.run(cmd, env=env, cwd=root).returncode
    if code not in (0, 3):
        raise RuntimeError(f"quantkit quantize exited {code}: {' '.join(cmd)}")
    return json.loads(report.read_text())["targets"][0], round(time.perf_counter() - started, 2)


def row(label: str, target: dict, wall: float, plain_wall: float) -> dict:
    details = target["details"]
    record, sensitivity = details.get("fallback", {}), details.get("sensitivity", {})
    ordering = record.get("ordering") or {"used": "proxy" if record else "—"}
    return {"run": label, "passed": target["gate"]["passed"], "kld": round(target["metrics"]["kld_mean"], 6),
            "steps": max(0, len(record.get("steps", [])) - 1),
            "size_cost": round(record["size_cost_bytes"] / record["first_bytes"], 4) if record else 0.0,
            "kept_16bit": sum(1 for p in record.get("types", {}).values() if p == "16-bit"),
            "wall_s": wall, "wall_ratio": round(wall / plain_wall, 2),
            "rank_correlation": sensitivity.get("rank_correlation"), "ordering": ordering["used"],
            "stopped": record.get("stopped")}


def table(rows: list[dict]) -> str:
    lines = ["| run | --max-size | gate | KLD | measured steps | kept 16-bit | size | wall, × plain | rho | order |",
             "|---|---|---|---:|---:|---:|---:|---|---:|---|"]
    for r in rows:
        rho = "" if r["rank_correlation"] is None else f"{r['rank_correlation']:.2f}"
        lines.append(f"| {r['run']} | {r.get('max_size', '')} | {'passes' if r['passed'] else 'fails'} | "
                     f"{r['kld']:.4g} | {r['steps']} | {r['kept_16bit']} | {100 * r['size_cost']:+.1f}% | "
                     f"{r['wall_s']:.1f} s, {r['wall_ratio']:.2f}× | {rho} | {r['ordering']} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    work = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    model = args.model.resolve() if args.model else blinded_model(work)
    plain, plain_wall = quantize(ROOT, model, work / "plain", [], args)
    rows = [row("plain", plain, plain_wall, plain_wall)]
    for size in args.max_size:
        for label, root in (("before", args.before.resolve()), ("after", ROOT)):
            target, wall = quantize(root, model, work / f"{label}-{size.strip('+%')}",
                                    ["--fallback", "--max-size", size], args)
            rows.append({**row(label, target, wall, plain_wall), "max_size": size})
            print(json.dumps(rows[-1]), flush=True)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"model": str(model), "max_kld": args.max_kld, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
