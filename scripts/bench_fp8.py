"""Benchmark: `quantkit quantize --method fp8` against a bare llm-compressor `oneshot` doing the
same work, the cost of the quality gate, and the start-up time of `quantkit --help`.

Each run is a separate process; wall time and peak RSS come from os.wait4 for that process.

    python scripts/bench_fp8.py [MODEL_DIR] [--repeat 2] [--json out.json]

Without MODEL_DIR a toy model is built under /tmp/quantkit-bench (preset `tiny`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BARE_ONESHOT = """
import sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from llmcompressor import oneshot
from llmcompressor.modifiers.quantization import QuantizationModifier
model_dir, out = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
tokenizer = AutoTokenizer.from_pretrained(model_dir)
oneshot(model=model, recipe=QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"]))
model.save_pretrained(out, save_compressed=True)
tokenizer.save_pretrained(out)
"""


def timed(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of one child process."""
    env = {**os.environ, "TQDM_DISABLE": "1"}
    started = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(cmd)}\n{stderr.decode()[-2000:]}")
    return wall, usage.ru_maxrss * 1024


def quantkit_cmd(model: Path, out: Path, gate: bool, report: Path) -> list[str]:
    cmd = [sys.executable, "-m", "quantkit", "quantize", str(model), "--method", "fp8", "-o", str(out),
           "--overwrite", "--json", str(report)]
    # --no-gate: measure the gate's full work but never refuse (a random-init model would fail it)
    return cmd + ["--no-gate"] if gate else cmd + ["--eval-windows", "0"]


def best_of(repeat: int, make_cmd) -> tuple[float, int]:
    runs = [timed(make_cmd()) for _ in range(repeat)]
    return min(r[0] for r in runs), max(r[1] for r in runs)


def help_time(repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "quantkit", "--help"], capture_output=True, check=True)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def ensure_model(path: str | None) -> Path:
    if path:
        return Path(path)
    model = Path("/tmp/quantkit-bench/tiny")
    if not (model / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "quantkit.toy", str(model)], check=True)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    model = ensure_model(args.model)
    work = Path(tempfile.mkdtemp(prefix="quantkit-bench-"))
    try:
        results = run_all(model, work, args.repeat)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print_table(results)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2) + "\n")


def run_all(model: Path, work: Path, repeat: int) -> dict:
    bare_script = work / "bare.py"
    bare_script.write_text(BARE_ONESHOT)
    bare = best_of(repeat, lambda: [sys.executable, str(bare_script), str(model), str(work / "bare")])
    plain = best_of(repeat, lambda: quantkit_cmd(model, work / "qk", False, work / "plain.json"))
    gated = best_of(repeat, lambda: quantkit_cmd(model, work / "qk", True, work / "gated.json"))
    report = json.loads((work / "gated.json").read_text())
    target = report["targets"][0]
    gate_s = report["timings"].get("baseline_s", 0) + target["timings"].get("eval_s", 0)
    return {
        "model": str(model), "parameters": report["model"]["parameters"],
        "bare_oneshot": {"wall_s": bare[0], "peak_rss": bare[1]},
        "quantkit_no_gate": {"wall_s": plain[0], "peak_rss": plain[1]},
        "quantkit_gated": {"wall_s": gated[0], "peak_rss": gated[1]},
        "gate_s": gate_s, "quantize_s": target["timings"]["quantize_s"], "total_s": report["timings"]["total_s"],
        "metrics": target["metrics"], "help_s": help_time(),
    }


def print_table(r: dict) -> None:
    mib = 1024 * 1024
    bare = r["bare_oneshot"]
    print(f"model: {r['model']} ({r['parameters'] / 1e6:.1f}M parameters)")
    print(f"{'run':34} {'wall s':>8} {'peak RSS MiB':>13} {'wall ratio':>11} {'RSS ratio':>10}")
    for name, key in (("bare llmcompressor.oneshot FP8", "bare_oneshot"),
                      ("quantkit fp8 (--eval-windows 0)", "quantkit_no_gate"),
                      ("quantkit fp8 (with gate)", "quantkit_gated")):
        row = r[key]
        print(f"{name:34} {row['wall_s']:8.2f} {row['peak_rss'] / mib:13.0f} "
              f"{row['wall_s'] / bare['wall_s']:11.2f} {row['peak_rss'] / bare['peak_rss']:10.2f}")
    share = r["gate_s"] / r["total_s"]
    print(f"gate (baseline + artifact eval): {r['gate_s']:.2f}s of {r['total_s']:.2f}s in-process "
          f"({share:.0%}); quantize step {r['quantize_s']:.2f}s")
    m = r["metrics"]
    print(f"quality: ppl {m['ppl_base']:.3f} -> {m['ppl']:.3f} ({m['ppl_increase']:+.2%}), "
          f"KLD {m['kld_mean']:.5f}, top-1 {m['top1']:.2%}")
    print(f"quantkit --help: {r['help_s'] * 1000:.0f} ms (median of 5, includes Python start-up)")


if __name__ == "__main__":
    main()
