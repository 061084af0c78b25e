#!/usr/bin/env python
"""Benchmark: every method's peak memory against the model's bytes on a large-vocabulary shape.

A Gemma 3 270M-shaped model (random init, bf16: hidden 640, 18 layers with sliding-window layers, ffn 2048,
4 heads / 1 KV head, head_dim 256, tied embeddings, vocabulary 262144: 536 MB, most of it the embedding table)
is built locally with quantkit's toy tokenizer, or taken from --model-dir. Each run is one process of
`quantkit quantize MODEL --method M --no-gate` (the gate measured in full, not enforced: a random model's
metrics mean nothing) with the same 8 calibration and 4 held-out windows of 256 tokens, measured by
/usr/bin/time (wall seconds, peak RSS); the fallback row gates fp8 at --max-kld 1e-4 so the guide runs its
steps; the eval row is `quantkit eval` of the fp8 artifact against the base. Each row prints the report's
per-step peaks and the preflight's estimated peak beside the measured one.

The runs import this checkout's quantkit; with --before CHECKOUT each is made a second time with that
checkout's quantkit first on the path, the same model and flags.

Usage: nice python scripts/bench_memory_methods.py [--work DIR] [--model-dir DIR] [--before CHECKOUT]
       [--runs nf4,fp8,mlx,gguf,gptq,smoothquant,awq,fallback,eval] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]  # this checkout: its quantkit is the one measured as "after"
FLAGS = ["--num-samples", "8", "--seq-len", "256", "--eval-windows", "4", "--overwrite"]
RUNS = ("nf4", "fp8", "mlx", "gguf", "gptq", "smoothquant", "awq", "fallback", "eval")


def build_model(out: Path) -> Path:
    """The Gemma 3 270M shape with random weights and quantkit's toy tokenizer."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from quantkit.toy import build_tokenizer, bundled_texts

    if (out / "config.json").exists():
        return out
    tok = build_tokenizer(bundled_texts(), 4096)
    cfg = Gemma3TextConfig(vocab_size=262144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18,
                           num_attention_heads=4, num_key_value_heads=1, head_dim=256, sliding_window=512,
                           max_position_embeddings=32768, tie_word_embeddings=True, bos_token_id=tok.bos_token_id,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, dtype="bfloat16",
                           architectures=["Gemma3ForCausalLM"])
    torch.manual_seed(0)
    Gemma3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def command(run: str, model: Path, out: Path) -> list[str]:
    """The quantkit arguments of one run."""
    if run == "eval":
        return ["eval", str(out / "fp8"), "--against", str(model), "--num-windows", "4", "--seq-len", "256"]
    if run == "fallback":
        return ["quantize", str(model), "-o", str(out / run), "--method", "fp8", "--fallback", "--max-kld", "0.0001",
                *FLAGS]
    return ["quantize", str(model), "-o", str(out / run), "--method", run, "--no-gate", *FLAGS]


def measured(args: list[str], code: Path, report: Path) -> dict:
    """Wall seconds, peak RSS and the report's peaks of one quantkit process, `code`'s quantkit imported."""
    env = {**os.environ, "PYTHONPATH": f"{code}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    timed = ["/usr/bin/time", "-f", "%e %M", sys.executable, "-m", "quantkit", *args, "--json", str(report)]
    done = subprocess.run(timed, capture_output=True, text=True, env=env, cwd=code)
    wall, kb = done.stderr.strip().splitlines()[-1].split()
    row = {"rc": done.returncode, "wall_s": float(wall), "peak_rss_bytes": int(kb) * 1024}
    if report.exists():
        data = json.loads(report.read_text())
        target = (data.get("targets") or [{}])[0]
        row["by_step"] = target.get("peak_rss_by_step", {})
        placement = data.get("gate_placement") or data.get("placement") or {}
        row["estimated_peak_rss_bytes"] = placement.get("estimated_peak_rss_bytes")
    return row


def table(rows: list[dict], model_bytes: int) -> str:
    lines = ["| run | code | exit | wall s | peak RSS GiB | RSS / model bytes | estimated GiB | per step (GiB) |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        est = r.get("estimated_peak_rss_bytes")
        steps = ", ".join(f"{k} {v / 2**30:.2f}" for k, v in r.get("by_step", {}).items())
        lines.append(f"| {r['run']} | {r['code']} | {r['rc']} | {r['wall_s']:.0f} | {r['peak_rss_bytes'] / 2**30:.2f} | "
                     f"{r['peak_rss_bytes'] / model_bytes:.2f} | {est / 2**30 if est else float('nan'):.2f} | {steps} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "quantkit-bench-memory-methods")
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--before", type=Path, help="an older checkout, run the same way")
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    model = build_model(args.model_dir or args.work / "model")
    model_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    rows = []
    for run in args.runs.split(","):
        for name, code in [("after", HERE), *([("before", args.before.resolve())] if args.before else [])]:
            out = args.work / name
            out.mkdir(parents=True, exist_ok=True)
            row = measured(command(run, model, out), code, args.work / f"{run}-{name}.json")
            rows.append({"run": run, "code": name, **row})
            print(json.dumps(rows[-1]), flush=True)
    print(f"model: {model} ({model_bytes / 1e6:.1f} MB of weights)\n\n{table(rows, model_bytes)}")
    if args.json:
        args.json.write_text(json.dumps({"model_bytes": model_bytes, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
