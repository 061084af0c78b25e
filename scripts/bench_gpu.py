#!/usr/bin/env python
"""Benchmark: quantkit against bare llm-compressor on a device, the same scheme and tokens, in one run.

    python scripts/bench_gpu.py [--device cuda|cpu] [--shape 3b|8b|tiny|H,LAYERS,FFN,HEADS,KV,VOCAB]
                                [--methods gptq,fp8,awq,nvfp4,autoround] [--num-samples 64] [--seq-len 256]
                                [--eval-windows 16] [--nogate] [--time-limit 420] [--work DIR] [--json out.json]

A Llama of the given shape is built on the device with random weights (std 0.02, bf16; `3b`: Llama-3.2-3B's
hidden 3072, 28 layers, ffn 8192, 24 heads / 8 KV heads, vocab 128256, tied; `8b`: Llama-3.1-8B's; `tiny`,
the --device cpu default: hidden 256, 4 layers) with quantkit's toy BPE tokenizer. Random weights say nothing
about quality (every gate fails on them; quantkit runs pass --no-gate, so the gate is measured in full but not
enforced): the table is about time and memory. For each method, each row one child process:

  quantkit          `quantkit quantize MODEL --method M --device D --no-gate` with the calibration and the
                    held-out windows (baseline, quantize, save, reload, measure)
  quantkit no gate  the same with `--eval-windows 0` (--nogate)
  bare              llm-compressor `oneshot` on the model loaded on the device, then `save_pretrained
                    (save_compressed=True)`: what a user script does, on the same calibration windows

Schemes on both sides: gptq W4A16 symmetric (quantkit --symmetric), awq W4A16 asymmetric, autoround
W4A16 symmetric (quantkit --preset light; the bare AutoRoundModifier at the same 50 iterations, batch 8),
fp8-dynamic, nvfp4 W4A4; the int4 group size is the one quantkit's `group_size: auto` picks for the shape.
Then the gate alone, each in a child process, on the same held-out windows: two plain transformers forwards
(the model loaded once, windows batched) against quantkit's baseline + comparison with the model resident
and streamed (the base scored against itself: the same work as a gate).

Columns: wall seconds from process start to saved artifact, quantkit's phases from its quantkit.json
(baseline, quantize, eval) and the bare run's (load, oneshot, save), peak GPU memory and mean GPU
utilisation of the device while the row ran (nvidia-ml-py, sampled every 0.1 s; the device's whole use,
one row at a time), peak RSS (wait4), artifact bytes, and wall / the bare row's wall of the same method.
A GPU's first GPTQ compiles a Triton kernel: a tiny bare run warms it up before the rows.
--time-limit starts no row after that many seconds (the rest are listed as skipped), so one short run on a
borrowed GPU reports what it reached.

On an offline GPU machine, install the wheels shared/reference/gpu-device.md lists, then run this script.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # children import this checkout's quantkit
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {  # hidden, layers, ffn, heads, kv heads, vocab, tied
    "3b": (3072, 28, 8192, 24, 8, 128256, True),
    "8b": (4096, 32, 14336, 32, 8, 128256, False),
    "tiny": (256, 4, 704, 4, 2, 4096, False),
}
METHODS = ("gptq", "fp8", "awq", "nvfp4", "autoround")
QUANTKIT_FLAGS = {"gptq": ["--method", "gptq", "--symmetric"], "awq": ["--method", "awq"],
                  "autoround": ["--method", "autoround", "--preset", "light"], "fp8": ["--method", "fp8"],
                  "nvfp4": ["--method", "nvfp4"]}
LIGHT_ITERS = 50  # quantkit's autoround light preset (quantkit.methods.autoround), given to the bare modifier too


# ---------------------------------------------------------------- the model


def shape_of(text: str) -> tuple:
    if text in SHAPES:
        return SHAPES[text]
    hidden, layers, ffn, heads, kv, vocab = (int(v) for v in text.split(","))
    return hidden, layers, ffn, heads, kv, vocab, False


def build_model(out: Path, shape: tuple, device: str) -> Path:
    """A random-init Llama of `shape` in bf16, built on the device, with the toy tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantkit.toy import build_tokenizer, bundled_texts

    if (out / "config.json").exists():
        return out
    hidden, layers, ffn, heads, kv, vocab, tied = shape
    tokenizer = build_tokenizer(bundled_texts(), min(4096, vocab))
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=8192,
                         rms_norm_eps=1e-5, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=tied, dtype="bfloat16", architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


# ---------------------------------------------------------------- workers (child processes)


def windows_for(model: str, args):
    from quantkit.engines.transformers import load_tokenizer
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.calibration import make_windows
    from quantkit.run.recipe import Calibration

    tokenizer = load_tokenizer(check_model_dir(Path(model)))
    spec = Calibration(num_samples=args.num_samples, seq_len=args.seq_len, eval_windows=args.eval_windows)
    return tokenizer, make_windows(tokenizer, spec)


def bare_recipe(method: str, model: str) -> list:
    """llm-compressor's modifiers for the same scheme quantkit writes (bench_methods' presets)."""
    from argparse import Namespace

    from bench_methods import oneshot_recipe

    if method == "fp8":
        from llmcompressor.modifiers.quantization import QuantizationModifier

        return [QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])]
    return oneshot_recipe(method, "oneshot", model, Namespace(iters=LIGHT_ITERS))


def worker_bare(model: str, out: str, method: str, args) -> dict:
    """Load on the device, oneshot, save compressed; the phases' seconds."""
    import torch
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    from quantkit.methods.awq import cpu_pin_memory_guard

    tokenizer, windows = windows_for(model, args)
    phases, started = {}, time.time()
    loaded = AutoModelForCausalLM.from_pretrained(model, dtype="auto", device_map=args.device)
    phases["load_s"] = time.time() - started
    data = {} if method in ("fp8",) else dict(dataset=windows.calib_dataset(), num_calibration_samples=len(windows.calib),
                                              max_seq_length=args.seq_len)
    started = time.time()
    with cpu_pin_memory_guard():  # llm-compressor 0.14's AWQ pins memory, which fails on a machine without a GPU
        oneshot(model=loaded, recipe=bare_recipe(method, model), tokenizer=tokenizer, **data)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    phases["oneshot_s"] = time.time() - started
    started = time.time()
    loaded.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)
    phases["save_s"] = time.time() - started
    return phases


def worker_gate(model: str, mode: str, args) -> dict:
    """The gate's work on the held-out windows: `plain` two transformers forwards (the model loaded once,
    windows batched as the resident gate batches them), `resident` / `streamed` quantkit's baseline and
    comparison of the base against itself (resident: the baseline's log-probs in memory, as a run with
    room for them keeps them; streamed: in a file)."""
    import torch
    from transformers import AutoModelForCausalLM

    from quantkit.eval import evaluate, scorers
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.preflight import GPU_ACTIVATION_BYTES, text_shape

    _tokenizer, windows = windows_for(model, args)
    ids, info = windows.eval, check_model_dir(Path(model))
    cuda = args.device == "cuda"
    activation = GPU_ACTIVATION_BYTES if cuda else scorers.ACTIVATION_BYTES
    started = time.time()
    if mode == "plain":
        from quantkit.eval.stream import windows_per_group

        loaded = AutoModelForCausalLM.from_pretrained(model, dtype="auto", device_map=args.device).eval()
        batch = windows_per_group(text_shape(info), ids.shape[1], activation)
        with torch.inference_mode():
            for _ in range(2):
                for start in range(0, len(ids), batch):
                    loaded(input_ids=ids[start:start + batch].to(args.device)).logits.float()
        if cuda:
            torch.cuda.synchronize()
        return {"gate_s": time.time() - started}
    placement = scorers.Placement(mode == "resident", args.device, activation, spill=mode != "resident")
    baseline = evaluate.compute_baseline(scorers.base_scorer(info, device=args.device, placement=placement), ids,
                                         spill=placement.spill)
    middle = time.time()
    metrics = evaluate.compare(scorers.base_scorer(info, device=args.device, placement=placement), ids, baseline)
    assert metrics.kld_mean < 1e-5, metrics  # the base against itself
    return {"baseline_s": middle - started, "eval_s": time.time() - middle, "gate_s": time.time() - started}


def worker(argv: list[str]) -> None:
    kind, model, out, what = argv[:4]
    args = parse_args(argv[4:])
    phases = worker_bare(model, out, what, args) if kind == "bare" else worker_gate(model, what, args)
    Path(out + ".phases.json").write_text(json.dumps({k: round(v, 2) for k, v in phases.items()}))


# ---------------------------------------------------------------- parent: run and measure


class GpuSampler:
    """Peak memory used and mean utilisation of GPU 0 while inside (nvidia-ml-py); nothing without a GPU."""

    def __init__(self, device: str):
        self.handle, self.samples, self.peak, self._stop = None, [], 0, threading.Event()
        if device == "cuda":
            try:
                import pynvml

                pynvml.nvmlInit()
                self.nvml, self.handle = pynvml, pynvml.nvmlDeviceGetHandleByIndex(0)
            except Exception:  # noqa: BLE001 - no NVML: the GPU columns stay empty
                self.handle = None

    def _sample(self) -> None:
        while not self._stop.wait(0.1):
            self.samples.append(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu)
            self.peak = max(self.peak, self.nvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def __enter__(self):
        if self.handle is not None:
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.handle is not None:
            self.thread.join()

    def columns(self) -> dict:
        if self.handle is None or not self.samples:
            return {}
        return {"gpu_peak_mib": round(self.peak / 2**20), "gpu_util_pct": round(sum(self.samples) / len(self.samples))}


def run_child(cmd: list[str], log: Path, device: str) -> dict:
    """wall seconds, peak RSS, exit code and the GPU columns of one child."""
    started = time.time()
    with open(log, "w") as fh, GpuSampler(device) as gpu:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    return {"wall_s": round(time.time() - started, 1), "peak_rss_mib": round(usage.ru_maxrss / 1024),
            "exit_code": os.waitstatus_to_exitcode(status), **gpu.columns()}


def calib_flags(args, gate: bool = True) -> list[str]:
    return ["--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len),
            "--eval-windows", str(args.eval_windows if gate else 0)]


def common_flags(args) -> list[str]:
    return ["--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len), "--eval-windows",
            str(args.eval_windows), "--device", args.device]


def quantkit_row(model: Path, method: str, gate: bool, args, work: Path) -> dict:
    out = work / f"{method}-quantkit{'' if gate else '-nogate'}"
    cmd = [sys.executable, "-m", "quantkit", "quantize", str(model), *QUANTKIT_FLAGS[method], "--no-gate",
           *calib_flags(args, gate), "--device", args.device, "-o", str(out), "--overwrite",
           "--json", str(out) + ".report.json"]
    row = {"method": method, "tool": "quantkit" if gate else "quantkit, no gate",
           **run_child(cmd, work / f"{out.name}.log", args.device)}
    if row["exit_code"] == 0:
        report = json.loads(Path(str(out) + ".report.json").read_text())
        timings = {**report["timings"], **report["targets"][0]["timings"]}
        row["phases"] = {k: timings[k] for k in ("baseline_s", "quantize_s", "eval_s") if k in timings}
        row["gate"] = (report.get("gate_placement") or {}).get("resident")
        row["bytes"] = artifact_bytes(out)
    return row


def bare_row(model: Path, method: str, args, work: Path) -> dict:
    out = work / f"{method}-bare"
    cmd = [sys.executable, __file__, "--worker", "bare", str(model), str(out), method, str(model), *common_flags(args)]
    row = {"method": method, "tool": "bare llm-compressor", **run_child(cmd, work / f"{out.name}.log", args.device)}
    if row["exit_code"] == 0:
        row["phases"] = json.loads(Path(str(out) + ".phases.json").read_text())
        row["bytes"] = artifact_bytes(out)
    return row


def gate_row(model: Path, mode: str, args, work: Path) -> dict:
    out = work / f"gate-{mode}"
    cmd = [sys.executable, __file__, "--worker", "gate", str(model), str(out), mode, str(model), *common_flags(args)]
    tool = {"plain": "two plain transformers forwards", "resident": "quantkit gate, resident",
            "streamed": "quantkit gate, streamed"}[mode]
    row = {"method": "gate", "tool": tool, **run_child(cmd, work / f"{out.name}.log", args.device)}
    if row["exit_code"] == 0:
        row["phases"] = json.loads(Path(str(out) + ".phases.json").read_text())
    return row


def artifact_bytes(out: Path) -> int:
    return sum(p.stat().st_size for p in out.glob("*.safetensors"))


def warm_up(args, work: Path) -> None:
    """A tiny bare GPTQ run on the device: a GPU's first GPTQ compiles a Triton kernel."""
    if args.device != "cuda":
        return
    tiny = build_model(work / "warmup-model", SHAPES["tiny"], args.device)
    bare_row(tiny, "gptq", argparse.Namespace(**{**vars(args), "num_samples": 4}), work)


def rows_for(model: Path, args, work: Path) -> list:
    """(label, thunk) of every row, in the order they run."""
    rows = []
    for method in args.methods.split(","):
        rows.append((f"{method} bare", lambda m=method: bare_row(model, m, args, work)))
        rows.append((f"{method} quantkit", lambda m=method: quantkit_row(model, m, True, args, work)))
        if args.nogate:
            rows.append((f"{method} no gate", lambda m=method: quantkit_row(model, m, False, args, work)))
    for mode in ("plain", "resident", "streamed"):
        rows.append((f"gate {mode}", lambda m=mode: gate_row(model, m, args, work)))
    return rows


def run(args) -> list[dict]:
    started = time.time()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    model = build_model(work / f"model-{args.shape}", shape_of(args.shape), args.device)
    print(f"model {args.shape} built in {time.time() - started:.1f} s (random weights)", file=sys.stderr, flush=True)
    warm_up(args, work)
    results = []
    for label, thunk in rows_for(model, args, work):
        if args.time_limit and time.time() - started > args.time_limit:
            results.append({"method": label.split()[0], "tool": label, "skipped": f"past --time-limit {args.time_limit}"})
            continue
        results.append(thunk())
        print(format_row(results[-1], results), file=sys.stderr, flush=True)
    return add_ratios(results)


def add_ratios(rows: list[dict]) -> list[dict]:
    """Each row's wall over its method's bare row (the gate rows: over the plain forwards)."""
    reference = {r["method"]: r for r in rows if r.get("tool") in ("bare llm-compressor", "two plain transformers forwards")}
    for r in rows:
        ref = reference.get(r["method"])
        if ref and "wall_s" in r and "wall_s" in ref and not r.get("exit_code") and not ref.get("exit_code"):
            key = "gate_s" if r["method"] == "gate" else "wall_s"
            mine, theirs = (r.get("phases") or {}).get(key, r["wall_s"]), (ref.get("phases") or {}).get(key, ref["wall_s"])
            r["ratio"] = round(mine / theirs, 2) if theirs else None
    return rows


# ---------------------------------------------------------------- output

HEADER = ("| method | tool | wall s | phases s | peak GPU MiB | GPU util % | peak RSS MiB | artifact MB | ratio |\n"
          "|---|---|---:|---|---:|---:|---:|---:|---:|")


def format_row(r: dict, _rows=None) -> str:
    if "skipped" in r:
        return f"| {r['method']} | {r['tool']} | skipped: {r['skipped']} | | | | | | |"
    if r.get("exit_code"):
        return f"| {r['method']} | {r['tool']} | {r['wall_s']} | failed (exit {r['exit_code']}) | | | | | |"
    phases = ", ".join(f"{k.removesuffix('_s')} {v:.1f}" for k, v in (r.get("phases") or {}).items())
    if r.get("gate") is not None:
        phases += f" (gate {'resident' if r['gate'] else 'streamed'})"
    size = f"{r['bytes'] / 1e6:.1f}" if r.get("bytes") else ""
    return (f"| {r['method']} | {r['tool']} | {r['wall_s']:.1f} | {phases} | {r.get('gpu_peak_mib', '')} "
            f"| {r.get('gpu_util_pct', '')} | {r['peak_rss_mib']} | {size} | {r.get('ratio') or ''} |")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_arg", nargs="?", help=argparse.SUPPRESS)  # workers' copy of the model path
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--shape", default=None, help="3b, 8b, tiny or H,LAYERS,FFN,HEADS,KV,VOCAB (cpu: tiny)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--num-samples", type=int, default=64)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--eval-windows", type=int, default=16)
    parser.add_argument("--nogate", action="store_true", help="also quantkit with --eval-windows 0")
    parser.add_argument("--time-limit", type=float, default=None, help="start no row after this many seconds")
    parser.add_argument("--work", default=None, help="folder for the model and artifacts (default: a temporary one)")
    parser.add_argument("--json", dest="json_path", default=None)
    args = parser.parse_args(argv)
    args.shape = args.shape or ("3b" if args.device == "cuda" else "tiny")
    return args


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
        return 0
    args = parse_args(sys.argv[1:])
    rows = run(args)
    print(f"shape {args.shape}, device {args.device}, {args.num_samples} x {args.seq_len} calibration tokens, "
          f"{args.eval_windows} held-out windows; random weights (time and memory only)")
    print(HEADER)
    for row in rows:
        print(format_row(row))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
