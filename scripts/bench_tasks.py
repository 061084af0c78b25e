#!/usr/bin/env python
"""Task accuracy in the gate: base vs. artifact per method on a local multiple-choice task, and the
time the task gate adds to the perplexity/KL gate, in one run.

    python scripts/bench_tasks.py MODEL [--methods fp8,gptq,nf4,gguf] [--samples 200] [--limit N]
                                        [--num-samples 32] [--seq-len 128] [--eval-windows 16]
                                        [--json out.json]

MODEL is normally the reference model (scripts/train_reference_model.py). The task is
quantkit.toy.make_continuation_task (which ending is the sentence's own, 4 choices, from the bundled
text), run through lm-evaluation-harness offline. Each method's artifact is written by
`quantkit quantize MODEL --method M --no-gate` (gguf: Q4_K_M); then, in this process, each artifact
is read back as the gate reads it and measured twice, each timed on its own: the perplexity/KL gate
(quantkit.formats.gate.evaluate_artifact on the held-out windows) and the task gate (lm-eval on
quantkit's forward of the artifact, quantkit.eval.tasks). The base is scored once for each.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

METHODS = {"fp8": [], "gptq": ["--bits", "4"], "nf4": [], "gguf": ["--gguf-type", "Q4_K_M"]}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--samples", type=int, default=200, help="task items written")
    parser.add_argument("--limit", type=int, default=None, help="task items scored (lm-eval --limit)")
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--eval-windows", type=int, default=16)
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def quantize(model: str, method: str, out: Path, args) -> Path:
    cmd = [sys.executable, "-m", "quantkit", "quantize", model, "--method", method, *METHODS[method], "-o", str(out),
           "--no-gate", "--quiet", "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len),
           "--eval-windows", "1"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return next(out.glob("*.gguf")) if method == "gguf" else out


def timed(fn):
    started = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - started


def main(argv: list[str] | None = None) -> None:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    from quantkit.engines.transformers import load_tokenizer
    from quantkit.eval import evaluate, scorers, tasks
    from quantkit.formats import gate
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.calibration import make_windows
    from quantkit.eval.tasks import TaskGate
    from quantkit.run.recipe import Calibration
    from quantkit.toy import make_continuation_task

    info = check_model_dir(Path(args.model))
    tokenizer = load_tokenizer(info)
    windows = make_windows(tokenizer, Calibration(num_samples=0, seq_len=args.seq_len,
                                                  eval_windows=args.eval_windows)).eval
    with tempfile.TemporaryDirectory() as tmp:
        gate = [TaskGate(file=str(make_continuation_task(Path(tmp) / "task", samples=args.samples)))]
        length = tasks.max_context(info.config)
        baseline, base_gate_s = timed(lambda: evaluate.compute_baseline(scorers.base_scorer(info), windows))
        base_scores, base_task_s = timed(lambda: tasks.base_scores(scorers.base_logits(info), tokenizer, length,
                                                                   gate, args.limit))
        rows = [{"method": "base", "ppl_kld_gate_s": base_gate_s, "task_gate_s": base_task_s,
                 **next(iter(base_scores.values())).__dict__}]
        for method in args.methods.split(","):
            artifact, quantize_s = timed(lambda: quantize(args.model, method, Path(tmp) / method, args))
            metrics, gate_s = timed(lambda: gate.evaluate_artifact(artifact, info.path, windows, baseline))
            (result,), task_s = timed(lambda: tasks.score_tasks(
                gate.artifact_logits(artifact, info.path), tokenizer, length, gate, args.limit, base_scores))
            rows.append({"method": method, "quantize_s": quantize_s, "ppl_kld_gate_s": gate_s, "task_gate_s": task_s,
                         "ppl_increase": metrics.ppl_increase, "kld_mean": metrics.kld_mean, **result.as_dict()})
    print_table(rows, args)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=2) + "\n")


def print_table(rows: list[dict], args) -> None:
    print(f"task: quantkit_continuation ({rows[0]['samples']} items, acc); gate windows: {args.eval_windows} x "
          f"{args.seq_len} tokens")
    print("| method | acc ± stderr | recovery | Δppl | KLD mean | ppl/KLD gate s | task gate s | task / ppl-KLD |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        value, stderr = (r["value"], r["stderr"]) if r["method"] == "base" else (r["score"], r["stderr"])
        recovery = "—" if r["method"] == "base" else f"{r['recovery']:.3f}"
        ppl = "—" if r["method"] == "base" else f"{r['ppl_increase']:+.2%}"
        kld = "—" if r["method"] == "base" else f"{r['kld_mean']:.4f}"
        print(f"| {r['method']} | {value:.3f} ± {stderr:.3f} | {recovery} | {ppl} | {kld} | "
              f"{r['ppl_kld_gate_s']:.1f} | {r['task_gate_s']:.1f} | {r['task_gate_s'] / r['ppl_kld_gate_s']:.1f}x |")


if __name__ == "__main__":
    main()
