#!/usr/bin/env python
"""Benchmark `--method auto`: its wall time against the chosen method run alone, and whether its choice is the
smallest candidate that passes, checked by running every candidate of its ladder to the end once.

    python scripts/bench_auto.py MODEL [--for vllm:L4 --for llama.cpp --for mlx] [--json out.json]
                                       [--num-samples 32] [--eval-windows 16] [--seq-len 128]
    python scripts/bench_auto.py MODEL --pad-vocab 262144 ...   # the same on a 262K-vocabulary shape of MODEL
    python scripts/bench_auto.py --render out.json   # the Markdown tables of a saved run

For each --for, one run of `quantkit quantize MODEL --method auto --for X`, then each candidate its ladder did
not skip before work (skipped: no kernel on the device, over the device's memory) as its own
`quantkit quantize` with the same gate (quantkit.run.auto.AUTO_GATE), calibration and held-out windows, written
as a one-target recipe so the options are exactly the candidate's. Every row runs in its own child process on the
same machine, one after another; wall time is the child's. The smallest candidate that passes alone, in the
ladder's order, should be the ladder's choice; the time goal is auto <= 2.5x the chosen method alone for vLLM and
<= 2x for llama.cpp (docs/auto.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GOALS = {"vllm": 2.5, "llama.cpp": 2.0}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", type=Path)
    parser.add_argument("--for", dest="destinations", action="append", default=[], metavar="ENGINE[:DEVICE]")
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--eval-windows", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--max-kld", type=float, help="the gate's mean-KLD bar for auto and every candidate "
                        "(default: AUTO_GATE's); a trained toy model passes the default bar even at 2 bits")
    parser.add_argument("--pad-vocab", type=int, metavar="N", help="benchmark MODEL with its vocabulary padded to N "
                        "entries (written once beside it as MODEL-vocabN): the shape of a 262K-vocabulary model, "
                        "its head and embeddings dominating the bytes, on a trained decoder")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--render", type=Path, help="print the tables of a saved --json run")
    return parser.parse_args(argv)


def recipe_text(target: dict, args: argparse.Namespace) -> str:
    """One target, the auto gate, the run's calibration: the same measurement for auto and each candidate."""
    from quantkit.run.auto import AUTO_GATE

    return json.dumps({"calibration": {"num_samples": args.num_samples, "eval_windows": args.eval_windows,
                                       "seq_len": args.seq_len},
                       "gate": {**AUTO_GATE, **({"max_kld": args.max_kld} if args.max_kld else {})},
                       "targets": [target]})


def run_quantize(model: Path, target: dict, args: argparse.Namespace, work: Path) -> dict:
    """One child `quantkit quantize` of a one-target recipe: exit code, wall seconds and its report."""
    recipe = work / f"{target['name']}.yaml"
    recipe.write_text(recipe_text(target, args))  # JSON is YAML
    out, report = work / target["name"], work / f"{target['name']}.json"
    command = [sys.executable, "-m", "quantkit", "quantize", str(model), "--recipe", str(recipe), "-o", str(out),
               "--json", str(report), "--quiet"]
    started = time.time()
    code = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"}).returncode
    seconds = round(time.time() - started, 1)
    data = json.loads(report.read_text()) if report.is_file() else {}
    return {"exit_code": code, "seconds": seconds, "targets": data.get("targets") or []}


def bench_destination(model: Path, destination: str, args: argparse.Namespace, work: Path) -> dict:
    auto = run_quantize(model, {"name": "auto", "method": "auto", "for": destination}, args, work)
    ladder = auto["targets"][0]["details"]["auto"] if auto["targets"] else None
    if ladder is None:
        return {"for": destination, "auto": auto, "error": "auto wrote no report"}
    alone = []
    for index, row in enumerate(ladder["ladder"]):
        if row["status"] == "skipped" and row["seconds"] is None and "failed the gate" not in row["why"]:
            continue  # skipped before work: not a candidate on this device
        if row["candidate"].endswith("+ guide"):
            continue
        result = run_quantize(model, {"name": f"c{index}", "method": row["method"], "options": row["options"]},
                              args, work)
        alone.append({"candidate": row["candidate"], "passed": result["exit_code"] == 0,
                      "exit_code": result["exit_code"], "seconds": result["seconds"],
                      "kld_mean": ((result["targets"] or [{}])[0].get("metrics") or {}).get("kld_mean")})
    smallest = next((a["candidate"] for a in alone if a["passed"]), None)
    chosen = next((a for a in alone if a["candidate"] == ladder["chosen"]), None)
    return {"for": destination, "auto_seconds": auto["seconds"], "auto_exit_code": auto["exit_code"],
            "chosen": ladder["chosen"], "smallest_passing_alone": smallest, "choice_is_smallest": smallest == ladder["chosen"],
            "chosen_alone_seconds": chosen["seconds"] if chosen else None,
            "ratio": round(auto["seconds"] / chosen["seconds"], 2) if chosen else None,
            "measured_by_auto": sum(1 for r in ladder["ladder"] if r["seconds"] is not None),
            "ladder": ladder["ladder"], "alone": alone}


def padded(model: Path, vocab: int) -> Path:
    """MODEL with embeddings and head grown to `vocab` rows: the new rows (ids the tokenizer never produces, as a
    real model's unused ids) drawn N(0, 0.02), the trained rows as they are."""
    out = model.with_name(f"{model.name}-vocab{vocab}")
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model)
    torch.manual_seed(0)
    net.resize_token_embeddings(vocab, mean_resizing=False)
    with torch.no_grad():
        for table in (net.get_input_embeddings(), net.get_output_embeddings()):
            table.weight[len(tokenizer):].normal_(0, 0.02)
    net.config.vocab_size = vocab
    net.to(torch.bfloat16).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def render(data: dict) -> str:
    lines = [f"Model: {data['model']}; {data['machine']}; calibration {data['num_samples']} x {data['seq_len']} "
             f"tokens, {data['eval_windows']} held-out windows; gate max KLD {data.get('max_kld') or 'as AUTO_GATE'}.",
             "",
             "| --for | auto (s) | chosen | chosen alone (s) | ratio | goal | measured by auto / candidates | "
             "smallest passing alone | same |", "|---|---|---|---|---|---|---|---|---|"]
    for row in data["rows"]:
        goal = GOALS.get(row["for"].partition(":")[0])
        lines.append(f"| `{row['for']}` | {row['auto_seconds']} | {row['chosen']} | {row['chosen_alone_seconds']} | "
                     f"{row['ratio']}x | {f'<= {goal}x' if goal else '—'} | {row['measured_by_auto']} / "
                     f"{len(row['alone'])} | {row['smallest_passing_alone']} | {'yes' if row['choice_is_smallest'] else 'NO'} |")
    for row in data["rows"]:
        lines += ["", f"Ladder for `{row['for']}` (auto's verdicts; alone: each candidate run to the end):", "",
                  "| candidate | auto | KLD | alone | KLD alone | s alone |", "|---|---|---|---|---|---|"]
        alone = {a["candidate"]: a for a in row["alone"]}
        for r in row["ladder"]:
            a = alone.get(r["candidate"])
            kld = f"{r['kld_mean']:.4g}" if r["kld_mean"] is not None else ""
            lines.append(f"| {r['candidate']} | {r['status']} | {kld} | "
                         + (f"{'pass' if a['passed'] else 'fail'} | {a['kld_mean']:.4g} | {a['seconds']} |"
                            if a and a["kld_mean"] is not None else "— | | |"))
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.render:
        print(render(json.loads(args.render.read_text())))
        return 0
    import platform

    destinations = args.destinations or ["vllm:L4", "llama.cpp", "mlx"]
    model = padded(args.model, args.pad_vocab) if args.pad_vocab else args.model
    data = {"model": str(model), "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
            "num_samples": args.num_samples, "eval_windows": args.eval_windows, "seq_len": args.seq_len,
            "max_kld": args.max_kld, "rows": []}
    with tempfile.TemporaryDirectory(prefix="bench-auto-") as tmp:
        for destination in destinations:
            work = Path(tmp) / destination.replace(":", "-")
            work.mkdir()
            data["rows"].append(bench_destination(model, destination, args, work))
            if args.json:  # after each destination: a long run keeps what it measured
                args.json.write_text(json.dumps(data, indent=1))
    print(render(data))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
