#!/usr/bin/env python
"""Benchmark: quantkit uses the memory that is there, before and after, against plain transformers and bare llm-compressor.

    python scripts/bench_resident.py [--cases a,b,c] [--before /path/to/older/checkout] [--work DIR] [--json out.json]

Three cases, synthetic Llama-shaped checkpoints (random weights, bf16, quantkit's toy tokenizer), every row one
child process measured from its start to its exit with os.wait4: wall seconds, peak RSS, and the bytes it wrote
to disk (ru_oublock x 512: the block writes Linux accounts to the process, /usr/bin/time's "file system
outputs"). Each quantkit row runs once with the checkout given as --before first on PYTHONPATH (the "before"
side) and once with this checkout (the "after" side); the peers use this checkout's windows.

  a  a 135M shape (hidden 576, 30 layers, ffn 1536, 9 heads / 3 KV heads, vocabulary 49152, tied), 16 held-out
     windows of 512 tokens:
       quantkit eval        `quantkit eval FP8 --against BASE --num-windows 16 --seq-len 512` on an fp8-dynamic
                            artifact of the base (written once by this checkout, `--eval-windows 0`)
       plain forwards       the base and the artifact loaded with transformers' from_pretrained, each run over the
                            same windows (batched as quantkit batches them): two forwards, nothing scored
       quantkit fp8, gated  `quantkit quantize BASE --method fp8 --eval-windows 16 --seq-len 512 --no-gate`
       bare llm-compressor  from_pretrained, a plain forward of the base, oneshot FP8_DYNAMIC (lm_head ignored), a
                            plain forward of the quantized model, save_pretrained(save_compressed=True)
  b  the same rows on a ~270M shape with a 262144-entry vocabulary (Gemma 3 270M's widths: hidden 640, 18 layers,
     ffn 2048, 4 heads / 1 KV head of 256, tied), 8 windows of 512 tokens; with the preflight's estimated peak of
     each quantkit row (the `peak about` of its placement line, and for quantize each step of quantkit.json's
     gate_placement.estimated_steps) against the measured one
  c  bounded: `quantkit quantize BASE --method gguf --gguf-type Q4_K_M --max-memory M --no-gate` with 8
     calibration and 4 held-out windows of 256 tokens on scripts/bench_memory.py's 1B shape (hidden 2048, 8 layers,
     ffn 8192, vocabulary 128256), M = half the model's bytes: the peak RSS against the bound

Random weights fail every gate, so quantize rows pass --no-gate: the gate is measured in full, not enforced. The
CPU's load (os.getloadavg) is recorded at each row's start: on a shared machine the ratios within one run are
what count.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "scripts"))

MIB = 2**20
SHAPES = {  # hidden, layers, ffn, heads, kv heads, head dim, vocab, tied, windows, seq_len
    "a": (576, 30, 1536, 9, 3, 64, 49152, True, 16, 512),
    "b": (640, 18, 2048, 4, 1, 256, 262144, True, 8, 512),
    "t": (128, 2, 256, 2, 1, 64, 4096, True, 2, 64),  # a smoke run of the script (tests/test_bench_resident.py)
}


# ---------------------------------------------------------------- models


def build_model(out: Path, shape: tuple) -> Path:
    """A random-init Llama of `shape` in bf16 (std 0.02) with quantkit's toy tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantkit.toy import build_tokenizer, bundled_texts

    if (out / "config.json").exists():
        return out
    hidden, layers, ffn, heads, kv, head_dim, vocab, tied = shape[:8]
    tokenizer = build_tokenizer(bundled_texts(), 4096)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim,
                         max_position_embeddings=4096, rms_norm_eps=1e-6, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=tied, dtype="bfloat16",
                         architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def built(out: Path, case: str) -> Path:
    """The case's model, built once by a child process: Linux counts the memory a child had before exec (its
    copy of the parent) in its peak RSS, so the parent never holds a model or torch."""
    if not (out / "config.json").exists():
        kind, shape = ("build-1b", []) if case == "1b" else ("build", [case])
        subprocess.run([sys.executable, __file__, "--worker", kind, str(out), *shape], check=True, cwd=HERE)
    return out


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


# ---------------------------------------------------------------- workers (child processes)


def held_out(model: str, windows: int, seq_len: int):
    """The held-out windows `quantkit eval` scores with these settings (its default text and seed)."""
    from quantkit.engines.transformers import load_tokenizer
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.calibration import make_windows
    from quantkit.run.recipe import Calibration

    calibration = Calibration(source="default", num_samples=0, seq_len=seq_len, seed=0, eval_windows=windows)
    return make_windows(load_tokenizer(check_model_dir(Path(model))), calibration).eval


def batch_of(model: str, seq_len: int) -> int:
    """Windows per batch: as quantkit's resident CPU forward batches them (quantkit.eval.stream.windows_per_group
    within quantkit.run.preflight.CPU_ACTIVATION_BYTES)."""
    from quantkit.eval.stream import windows_per_group
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.preflight import CPU_ACTIVATION_BYTES, text_shape

    return windows_per_group(text_shape(check_model_dir(Path(model))), seq_len, CPU_ACTIVATION_BYTES)


def forward(model, ids, batch: int) -> None:
    """The model over the windows, batched; the logits computed and dropped."""
    import torch

    with torch.inference_mode():
        for start in range(0, len(ids), batch):
            model(input_ids=ids[start:start + batch])  # the logits of every position, as a user script gets them


def worker_plain(base: str, artifact: str, windows: int, seq_len: int) -> dict:
    from transformers import AutoModelForCausalLM

    ids, batch = held_out(base, windows, seq_len), batch_of(base, seq_len)
    phases = {}
    for name, path in (("base", base), ("artifact", artifact)):
        started = time.time()
        model = AutoModelForCausalLM.from_pretrained(path, dtype="auto").eval()
        forward(model, ids, batch)
        phases[f"{name}_s"] = time.time() - started
        del model
    return phases


def worker_bare(base: str, out: str, windows: int, seq_len: int) -> dict:
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids, batch = held_out(base, windows, seq_len), batch_of(base, seq_len)
    phases, started = {}, time.time()
    model = AutoModelForCausalLM.from_pretrained(base, dtype="auto").eval()
    forward(model, ids, batch)
    phases["base_forward_s"] = time.time() - started
    started = time.time()
    oneshot(model=model, recipe=[QuantizationModifier(targets="Linear", scheme="FP8_DYNAMIC", ignore=["lm_head"])])
    phases["oneshot_s"] = time.time() - started
    started = time.time()
    forward(model, ids, batch)
    phases["fp8_forward_s"] = time.time() - started
    started = time.time()
    model.save_pretrained(out, save_compressed=True)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)
    phases["save_s"] = time.time() - started
    return phases


def worker(argv: list[str]) -> None:
    kind, out, *rest = argv
    if kind == "build":  # a model built in a child: the parent stays small (a child's peak RSS counts its parent's)
        build_model(Path(out), SHAPES[rest[0]])
        return
    if kind == "build-1b":
        from bench_memory import build_model as build_1b

        build_1b(Path(out), 2048, 8, 128256, 8192)
        return
    phases = worker_plain(*rest[:2], *map(int, rest[2:])) if kind == "plain" else worker_bare(rest[0], out, *map(int, rest[1:]))
    Path(out + ".phases.json").write_text(json.dumps({k: round(v, 2) for k, v in phases.items()}))


# ---------------------------------------------------------------- the parent: run and measure


def run_child(cmd: list[str], log: Path, tree: Path, timeout: float) -> dict:
    """wall seconds, peak RSS MiB, bytes written and exit code of one child run in `tree` (its quantkit first on
    the path: `python -m` puts the working directory before PYTHONPATH), the load when it started."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    load = os.getloadavg()[0]
    started = time.time()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=tree)
        deadline = started + timeout
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.time() > deadline:
                proc.kill()
                pid, status, usage = os.wait4(proc.pid, 0)
                break
            time.sleep(0.2)
    return {"wall_s": round(time.time() - started, 1), "peak_rss_mib": round(usage.ru_maxrss / 1024),
            "written_mb": round(usage.ru_oublock * 512 / 1e6, 1), "exit_code": os.waitstatus_to_exitcode(status),
            "load": round(load, 1)}


def placement_line(log: Path) -> str:
    lines = [ln.lstrip("· ") for ln in log.read_text(errors="replace").splitlines()
             if re.match(r"(· )?(gate|forwards): (resident|streamed)", ln)]
    return lines[-1] if lines else ""


def estimated_peak(line: str) -> float | None:
    """The preflight's peak in MiB from a placement line ("peak about 1.23 GiB" / "... 830.0 MiB")."""
    found = re.search(r"peak (?:about|at about) ([0-9.]+) (GiB|MiB)", line)
    if not found:
        return None
    return float(found.group(1)) * (1024 if found.group(2) == "GiB" else 1)


def quantkit_eval_row(side: str, tree: Path, base: Path, artifact: Path, windows: int, seq_len: int, work: Path,
                      timeout: float) -> dict:
    log = work / f"eval-{side}.log"
    cmd = [sys.executable, "-m", "quantkit", "eval", str(artifact), "--against", str(base), "--num-windows",
           str(windows), "--seq-len", str(seq_len), "--json", str(work / f"eval-{side}.json")]
    row = {"row": f"quantkit eval ({side})", **run_child(cmd, log, tree, timeout)}
    row["placement"] = placement_line(log)
    row["estimated_peak_mib"] = estimated_peak(row["placement"])
    if row["exit_code"] == 0:
        row["kld_mean"] = json.loads((work / f"eval-{side}.json").read_text())["metrics"]["kld_mean"]
    return row


def quantkit_quantize_row(side: str, tree: Path, base: Path, work: Path, flags: list[str], timeout: float,
                          name: str) -> dict:
    out, log = work / f"{name}-{side}", work / f"{name}-{side}.log"
    cmd = [sys.executable, "-m", "quantkit", "quantize", str(base), "-o", str(out), "--overwrite", "--no-gate",
           "--json", str(out) + ".json", *flags]
    row = {"row": f"quantkit {name} ({side})", **run_child(cmd, log, tree, timeout)}
    row["placement"] = placement_line(log)
    row["estimated_peak_mib"] = estimated_peak(row["placement"])
    if row["exit_code"] == 0:
        report = json.loads(Path(str(out) + ".json").read_text())
        target = report["targets"][0]
        row["artifact_mb"] = round(folder_bytes(out) / 1e6, 1)
        row["steps"] = {"baseline": report.get("baseline", {}).get("peak_rss_bytes"),
                        **target.get("peak_rss_by_step", {})}
        row["steps"] = {k: round(v / MIB) for k, v in row["steps"].items() if v}
        row["seconds"] = {**{k: v for k, v in report["timings"].items() if k == "baseline_s"},
                          **{k: v for k, v in target["timings"].items() if k in ("quantize_s", "eval_s")}}
        estimate = (report.get("gate_placement") or {}).get("estimated_steps")
        if estimate:
            row["estimated_steps_mib"] = {k: round(v / MIB) for k, v in estimate.items()}
            row["estimated_peak_mib"] = round(report["gate_placement"]["estimated_peak_rss_bytes"] / MIB)
    else:
        row["error"] = log.read_text(errors="replace").strip().splitlines()[-2:]
    return row


def peer_row(kind: str, base: Path, artifact: Path, windows: int, seq_len: int, work: Path, timeout: float) -> dict:
    out = work / f"{kind}-peer"
    cmd = [sys.executable, __file__, "--worker", kind, str(out), str(base), *([str(artifact)] if kind == "plain" else []),
           str(windows), str(seq_len)]
    label = {"plain": "two plain transformers forwards", "bare": "bare llm-compressor fp8 + two plain forwards"}[kind]
    row = {"row": label, **run_child(cmd, work / f"{kind}-peer.log", HERE, timeout)}
    if row["exit_code"] == 0:
        row["phases"] = json.loads(Path(str(out) + ".phases.json").read_text())
        if kind == "bare":
            row["artifact_mb"] = round(folder_bytes(out) / 1e6, 1)
    return row


def case_rows(case: str, args, work: Path) -> dict:
    shape = SHAPES[case]
    windows, seq_len = shape[8], shape[9]
    work.mkdir(parents=True, exist_ok=True)
    base = built(work / "base", case)
    artifact = work / "fp8"
    if not (artifact / "config.json").exists():
        subprocess.run([sys.executable, "-m", "quantkit", "quantize", str(base), "--method", "fp8", "-o", str(artifact),
                        "--eval-windows", "0", "--overwrite"], check=True, capture_output=True,
                       env={**os.environ, "PYTHONPATH": str(HERE)}, cwd=HERE)
    rows = []
    sides = [("before", args.before)] if args.before else []
    sides.append(("after", HERE))
    rows.append(peer_row("plain", base, artifact, windows, seq_len, work, args.timeout))
    for side, tree in sides:
        rows.append(quantkit_eval_row(side, tree, base, artifact, windows, seq_len, work, args.timeout))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    rows.append(peer_row("bare", base, artifact, windows, seq_len, work, args.timeout))
    for side, tree in sides:
        flags = ["--method", "fp8", "--eval-windows", str(windows), "--seq-len", str(seq_len)]
        rows.append(quantkit_quantize_row(side, tree, base, work, flags, args.timeout, "fp8"))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return {"case": case, "model_mb": round(folder_bytes(base) / 1e6, 1),
            "weights_mb": round(sum(p.stat().st_size for p in base.glob("*.safetensors")) / 1e6, 1),
            "artifact_mb": round(folder_bytes(artifact) / 1e6, 1), "windows": windows, "seq_len": seq_len,
            "rows": rows}


def bounded_rows(args, work: Path) -> dict:
    work.mkdir(parents=True, exist_ok=True)
    base = built(work / "base", "1b")
    weights = sum(p.stat().st_size for p in base.glob("*.safetensors"))
    bound = weights // 2
    flags = ["--method", "gguf", "--gguf-type", "Q4_K_M", "--num-samples", "8", "--eval-windows", "4", "--seq-len",
             "256", "--max-memory", str(bound)]
    sides = ([("before", args.before)] if args.before else []) + [("after", HERE)]
    rows = [quantkit_quantize_row(side, tree, base, work, flags, args.timeout * 3, "gguf-bounded") for side, tree in sides]
    return {"case": "c", "weights_mb": round(weights / 1e6, 1), "bound_mib": round(bound / MIB), "rows": rows}


# ---------------------------------------------------------------- output


def print_case(result: dict) -> None:
    print(f"\ncase {result['case']}: weights {result['weights_mb']} MB"
          + (f", fp8 artifact {result['artifact_mb']} MB, {result['windows']} x {result['seq_len']} held-out tokens"
             if "windows" in result else f", --max-memory {result['bound_mib']} MiB"))
    rows = result["rows"]
    reference = {r["row"]: r for r in rows}
    plain = reference.get("two plain transformers forwards", {})
    bare = reference.get("bare llm-compressor fp8 + two plain forwards", {})
    print("| run | wall s | ratio | peak RSS MiB | RSS / weights | estimated MiB | written MB | load |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if r.get("exit_code"):
            print(f"| {r['row']} | {r['wall_s']} | exit {r['exit_code']} | | | | | {r['load']} |")
            continue
        peer = plain if "eval" in r["row"] else bare if "fp8" in r["row"] else {}
        ratio = f"{r['wall_s'] / peer['wall_s']:.2f}" if peer.get("wall_s") and peer is not r else ""
        estimate = r.get("estimated_peak_mib")
        print(f"| {r['row']} | {r['wall_s']} | {ratio} | {r['peak_rss_mib']} "
              f"| {r['peak_rss_mib'] * MIB / (result['weights_mb'] * 1e6):.2f} | {estimate or ''} "
              f"| {r['written_mb']} | {r['load']} |")
    for r in rows:
        if r.get("placement"):
            print(f"  {r['row']}: {r['placement']}")
        if r.get("estimated_steps_mib"):
            print(f"  {r['row']}: estimated steps {r['estimated_steps_mib']}, measured {r.get('steps')}")


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="a,b,c")
    parser.add_argument("--before", type=Path, help="an older quantkit checkout, run as the 'before' side")
    parser.add_argument("--before-cases", default="a,b", help="cases the before side runs (c: once, it is long)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "quantkit-bench-resident")
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    results = []
    for case in args.cases.split(","):
        before = args.before if case in args.before_cases else None
        case_args = argparse.Namespace(**{**vars(args), "before": before})
        result = bounded_rows(case_args, args.work / "c") if case == "c" else case_rows(case, case_args, args.work / case)
        results.append(result)
        print_case(result)
        if args.json:
            args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
