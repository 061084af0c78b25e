#!/usr/bin/env python
"""Benchmark: a killed --resume run continued, against the uninterrupted run, for gptq and gguf.

    python scripts/bench_resume.py [--work DIR] [--shape H,LAYERS,FFN,HEADS,KV,VOCAB] [--methods gptq,gguf]
                                   [--fractions 0.25,0.5,0.9] [--num-samples 32] [--seq-len 256] [--json out.json]
    python scripts/bench_resume.py --render out.json

The model is scripts/bench_gpu.py's random-init Llama of the given shape (default the 125M shape: hidden 768,
12 layers, ffn 2048, 12 heads / 4 KV heads, vocabulary 32000, bf16). Every run is `python -m quantkit
quantize MODEL --method M ... --eval-windows 0` (the gate is not part of what resumes: a resumed run
scores it again in full), each in its own process, one after the other:

  plain         without --resume
  resume        with --resume, uninterrupted: what saving the progress costs, and the most disk it took
  killed F      with --resume, SIGKILLed right after the unit at fraction F of the run's units was saved
                (tests/cli/fault_run.py: gptq's decoder layers, gguf's tensors), then the same command run
                again: its wall against the plain run's and against the remaining fraction (1 - F)

Every resumed artifact is compared byte for byte (`cmp`) with the plain run's (quantkit.json aside: it
records timings). Units: gptq saves a layer after each of its LAYERS decoder layers (the head's subgraph is
never saved); gguf records each tensor written.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

DEFAULT_SHAPE = "768,12,2048,12,4,32000"
METHODS = {"gptq": ["--method", "gptq"], "gguf": ["--method", "gguf", "--gguf-type", "Q4_K_M"]}
KEPT_OUT = {"quantkit.json"}  # records the run's timings: differs between any two runs


def flags(args) -> list[str]:
    return ["--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len), "--eval-windows", "0"]


def units(method: str, model: Path, plain_out: Path) -> int:
    """How many units a run of `method` saves: gptq's decoder layers, gguf's tensors in the written file."""
    if method == "gptq":
        return json.loads((model / "config.json").read_text())["num_hidden_layers"]
    from gguf import GGUFReader

    (path,) = plain_out.glob("*.gguf")
    return len(GGUFReader(path).tensors)


def staged_bytes(out: Path) -> int:
    total = 0
    for staging in out.parent.glob(f".{out.name}.staging-*"):
        for path in staging.rglob("*"):
            try:
                total += path.stat().st_size if path.is_file() else 0
            except OSError:
                pass
    return total


def timed(cmd: list[str], out: Path, log: Path) -> dict:
    """Run `cmd`; its wall, exit code, and the most bytes its staging directory held (sampled every 0.5 s)."""
    peak, done = [0], threading.Event()

    def sample():
        while not done.wait(0.5):
            peak[0] = max(peak[0], staged_bytes(out))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    started = time.time()
    with open(log, "a") as fh:
        code = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    done.set()
    thread.join()
    return {"wall_s": round(time.time() - started, 2), "rc": code, "staged_peak_bytes": peak[0]}


def same_artifact(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir() if p.name not in KEPT_OUT)
    if names != sorted(p.name for p in b.iterdir() if p.name not in KEPT_OUT):
        return False
    return all(subprocess.run(["cmp", "-s", a / n, b / n]).returncode == 0 for n in names)


def method_rows(method: str, model: Path, args, work: Path) -> list[dict]:
    quantize = [sys.executable, "-m", "quantkit", "quantize", str(model), *METHODS[method], *flags(args)]
    plain_out = work / f"{method}-plain"
    log = work / f"{method}.log"
    shutil.rmtree(plain_out, ignore_errors=True)
    plain = timed([*quantize, "-o", str(plain_out)], plain_out, log)
    if plain["rc"] != 0:
        raise SystemExit(f"{method}: the plain run failed (exit {plain['rc']}); its output is in {log}")
    rows = [{"method": method, "run": "plain", **plain}]
    total = units(method, model, plain_out)
    resume_out = work / f"{method}-resume"
    shutil.rmtree(resume_out, ignore_errors=True)
    whole = timed([*quantize, "-o", str(resume_out), "--resume"], resume_out, log)
    rows.append({"method": method, "run": "resume", **whole, "identical": same_artifact(plain_out, resume_out)})
    unit = "layer" if method == "gptq" else "tensor"
    for fraction in args.fractions:
        after = max(1, min(total - 1, round(fraction * total)))
        out = work / f"{method}-killed-{after}"
        shutil.rmtree(out, ignore_errors=True)
        fault = [sys.executable, "-m", "tests.cli.fault_run", unit, str(after), "KILL", *quantize[3:]]  # "quantize", MODEL, ...
        first = timed([*fault, "-o", str(out), "--resume"], out, log)
        second = timed([*quantize, "-o", str(out), "--resume"], out, log)
        if first["rc"] != -9:
            raise SystemExit(f"{method}: the run to kill after {unit} {after} ended with {first['rc']}, not SIGKILL; "
                             f"its output is in {log}")
        rows.append({"method": method, "run": f"killed after {after}/{total} {unit}s", "fraction": after / total,
                     "killed_wall_s": first["wall_s"], "killed_rc": first["rc"], **second,
                     "remaining_fraction": round(1 - after / total, 3),
                     "resumed_over_plain": round(second["wall_s"] / plain["wall_s"], 3),
                     "identical": second["rc"] == 0 and same_artifact(plain_out, out)})
    return rows


def render(rows: list[dict]) -> str:
    lines = ["| method | run | wall s | resumed / plain wall | remaining work | byte-identical | most staged |",
             "|---|---|---:|---:|---:|---|---:|"]
    for r in rows:
        ratio = f"{r['resumed_over_plain']:.2f}" if "resumed_over_plain" in r else "—"
        remaining = f"{r['remaining_fraction']:.2f}" if "remaining_fraction" in r else "—"
        same = {True: "yes", False: "NO"}.get(r.get("identical"), "—")
        wall = f"{r['wall_s']:.1f}" + (f" (killed at {r['killed_wall_s']:.1f})" if "killed_wall_s" in r else "")
        lines.append(f"| {r['method']} | {r['run']} | {wall} | {ratio} | {remaining} | {same} | "
                     f"{r['staged_peak_bytes'] / 2**20:.0f} MiB |")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/quantkit-bench-resume"))
    parser.add_argument("--shape", default=DEFAULT_SHAPE)
    parser.add_argument("--methods", default="gptq,gguf")
    parser.add_argument("--fractions", default="0.25,0.5,0.9", type=lambda t: [float(v) for v in t.split(",")])
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--render", type=Path, help="print the table of a JSON this script wrote, and exit")
    return parser.parse_args(argv)


def main() -> int:
    args = parse_args(sys.argv[1:])
    if args.render:
        print(render(json.loads(args.render.read_text())["rows"]))
        return 0
    from bench_gpu import build_model, shape_of

    args.work.mkdir(parents=True, exist_ok=True)
    model = build_model(args.work / "model", shape_of(args.shape), "cpu")
    rows = []
    for method in args.methods.split(","):
        rows += method_rows(method, model, args, args.work)
        print(render(rows), flush=True)
    record = {"shape": args.shape, "num_samples": args.num_samples, "seq_len": args.seq_len,
              "threads": os.cpu_count(), "load_average": os.getloadavg(), "rows": rows}
    if args.json:
        args.json.write_text(json.dumps(record, indent=1))
    return 0 if all(r.get("identical", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
