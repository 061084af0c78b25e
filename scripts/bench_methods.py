#!/usr/bin/env python
"""Benchmark quantkit's methods and schemes against bare peers doing the same work, in one run.

    python scripts/bench_methods.py MODEL [--num-samples 32] [--seq-len 128] [--eval-windows 16]
                                          [--methods gptq,awq,smoothquant,nf4] [--json out.json]
                                          [--extras] [--iters N] [--variants quantkit,oneshot,...]
                                          [--device cpu|cuda] [--rotate none,hadamard,spinquant]

MODEL is normally the reference model (scripts/train_reference_model.py). For each method:
  * quantkit  - `quantkit quantize MODEL --method M --no-gate` (the whole gated pipeline: load,
                windows, baseline, quantize, save, reload, measure);
  * oneshot   - bare `llmcompressor.oneshot` with llm-compressor's own preset scheme for the
                same thing (W4A16 / W4A16_ASYM / W8A8), on the same calibration windows; the int4
                presets at the group size quantkit's group_size auto picks for the model (128, else
                64 or 32: a preset's 128 cannot quantize a width such as 576); for nf4, bare
                transformers `from_pretrained(quantization_config=...)`;
  * rtn       - round-to-nearest with the same weight format (QuantizationModifier), no data;
  * autoround-lib (autoround only) - the auto-round library itself (`AutoRound(...)`, what its command
                line runs) on the same calibration windows, same bits, group size, symmetry, iterations
                and batch size, saved through its `llm_compressor` export (compressed-tensors, as quantkit
                writes) and scored the same way.
With --extras, also quantkit's other settings of the same format: gptq --symmetric (what the bare
W4A16 preset does), autoround's light preset and autoround --asymmetric. autoround's bare run is llm-compressor's
AutoRoundModifier with its defaults (200 iterations, batch 8) or --iters, torch.compile off on every
side (on CPU it compiles longer than it tunes). --variants keeps only the named variants.
The compressed-tensors schemes fp8-block, nvfp4, nvfp4-a16, mxfp4 and fp8-kv (fp8-dynamic with --kv-cache
fp8) run against bare `oneshot` with llm-compressor's preset (FP8_BLOCK, NVFP4, NVFP4A16, MXFP4A16,
FP8_DYNAMIC + the same kv_cache_scheme), calibrated only where quantkit calibrates.
--device cuda runs every variant's quantization on the GPU (quantkit `--device cuda`, the library with
device_map cuda, llm-compressor's pipeline onloads each layer to the GPU by itself); scoring stays on the CPU.
--rotate runs every method once per rotation: quantkit with `--rotate R`, the bare oneshot with the same
llm-compressor transform modifier first in its recipe (hadamard: QuIPModifier, random Hadamard on every Linear's
input but lm_head; spinquant: SpinQuantModifier R1+R2, random Hadamard), on the same windows.
Each variant runs in its own child process: wall time and peak RSS (wait4) are the child's.
Every artifact is then reloaded from disk and scored by the same evaluator against one
baseline on the same held-out windows, so quality numbers are comparable across rows.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the worker children import this checkout's quantkit

METHODS = ("gptq", "awq", "smoothquant", "nf4")  # the default; autoround is opt-in (minutes per run)
# method -> {variant: llm-compressor preset scheme (None: not applicable)}
PRESETS = {
    "gptq": {"oneshot": "W4A16", "rtn": "W4A16"},
    "awq": {"oneshot": "W4A16_ASYM", "rtn": "W4A16_ASYM"},
    "smoothquant": {"oneshot": "W8A8", "rtn": "W8A8"},
    "nf4": {"oneshot": "bnb-nf4", "rtn": None},
    "autoround": {"oneshot": "W4A16", "rtn": "W4A16"},
    "fp8-block": {"oneshot": "FP8_BLOCK", "rtn": None},
    "nvfp4": {"oneshot": "NVFP4", "rtn": None},
    "nvfp4-a16": {"oneshot": "NVFP4A16", "rtn": None},
    "mxfp4": {"oneshot": "MXFP4A16", "rtn": None},
    "fp8-kv": {"oneshot": "FP8_DYNAMIC", "rtn": None},
    "fp8": {"oneshot": "FP8_DYNAMIC", "rtn": None},
}
# bench entry -> quantkit flags, where the entry is a scheme rather than a method's default
QUANTKIT_FLAGS = {"fp8-block": ["--method", "fp8", "--scheme", "fp8-block"],
                  "nvfp4-a16": ["--method", "nvfp4", "--scheme", "a16"],
                  "fp8-kv": ["--method", "fp8", "--kv-cache", "fp8"]}
PRESET_ONLY = ("fp8-block", "nvfp4", "nvfp4-a16", "mxfp4", "fp8-kv", "fp8")  # one QuantizationModifier with the preset
DATA_FREE = ("fp8-block", "nvfp4-a16", "mxfp4", "fp8")  # presets that need no calibration data
# method -> {quantkit variant: extra flags} (--extras)
EXTRAS = {"gptq": {"quantkit-sym": ["--symmetric"]},
          "autoround": {"quantkit-light": ["--preset", "light"], "quantkit-asym": ["--asymmetric"]}}
# method -> symmetric: bare int4 presets built at the model's group size, W4A16 (True) or W4A16_ASYM (False)
W4A16 = {"gptq": True, "autoround": True, "awq": False}


# ---------------------------------------------------------------- workers (child processes)


def windows_for(model: str, args):
    from quantkit.engines.transformers import load_tokenizer
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.calibration import make_windows
    from quantkit.run.recipe import Calibration

    tokenizer = load_tokenizer(check_model_dir(Path(model)))
    spec = Calibration(num_samples=args.num_samples, seq_len=args.seq_len, eval_windows=args.eval_windows)
    return tokenizer, make_windows(tokenizer, spec)


def model_group_size(model_dir: str) -> int:
    """The group size quantkit's group_size auto picks for the model (what the bare W4A16 runs use)."""
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.methods.gptq import auto_group_size

    return auto_group_size(check_model_dir(Path(model_dir)))[0]


def w4a16_groups(model_dir: str, symmetric: bool) -> dict:
    """llm-compressor's W4A16 / W4A16_ASYM preset (int4, static) at the model's group size."""
    from quantkit.engines.llmcompressor import llmc

    weights = llmc.weight_args(4, model_group_size(model_dir), symmetric)
    return {"group_0": {"targets": ["Linear"], "weights": weights}}


def rotation_recipe(rotate: str) -> list:
    """The transform modifier quantkit's --rotate puts first (quantkit.engines.llmcompressor.llmc.rotation_modifiers)."""
    from llmcompressor.modifiers.transform import QuIPModifier, SpinQuantModifier

    if rotate == "hadamard":
        return [QuIPModifier(rotations=["v"], transform_type="random-hadamard", ignore=["lm_head"])]
    if rotate == "spinquant":
        return [SpinQuantModifier(rotations=["R1", "R2"], transform_type="random-hadamard")]
    return []


def oneshot_recipe(method: str, variant: str, model_dir: str, args) -> list:
    return rotation_recipe(args.rotate) + method_recipe(method, variant, model_dir, args)


def peer_ignore(model_dir: str) -> list[str]:
    """What the bare recipes leave 16-bit: lm_head, and a mixture of experts' routers, as llm-compressor's own MoE
    examples do (`re:.*mlp.gate$`) and quantkit keeps them (the family's expert layout's router pattern)."""
    from quantkit.arch.moe import moe_layout
    from quantkit.io.checkpoint import read_config

    layout = moe_layout(read_config(Path(model_dir)))
    return ["lm_head"] + ([f"re:{layout.router}"] if layout is not None else [])


def method_recipe(method: str, variant: str, model_dir: str, args) -> list:
    from llmcompressor.modifiers.autoround import AutoRoundModifier
    from llmcompressor.modifiers.gptq import GPTQModifier
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from llmcompressor.modifiers.transform.smoothquant import SmoothQuantModifier

    scheme, ignore = PRESETS[method][variant], peer_ignore(model_dir)
    if method in PRESET_ONLY:
        from quantkit.engines.llmcompressor.llmc import kv_cache_scheme

        return [QuantizationModifier(targets="Linear", scheme=scheme, ignore=ignore,
                                     kv_cache_scheme=kv_cache_scheme("fp8" if method == "fp8-kv" else None))]
    given = ({"config_groups": w4a16_groups(model_dir, W4A16[method])} if method in W4A16
             else {"targets": "Linear", "scheme": scheme})
    if variant == "rtn":
        return [QuantizationModifier(**given, ignore=ignore)]
    if method == "gptq":
        return [GPTQModifier(**given, ignore=ignore)]
    if method == "autoround":
        tuning = {"iters": args.iters} if args.iters else {}
        return [AutoRoundModifier(**given, ignore=ignore, enable_torch_compile=False, **tuning)]
    if method == "awq":
        return [AWQModifier(), QuantizationModifier(**given, ignore=ignore)]
    return [SmoothQuantModifier(smoothing_strength=0.8),
            GPTQModifier(targets="Linear", scheme=scheme, ignore=ignore)]


def worker_llmcompressor(model_dir: str, out: str, method: str, variant: str, args) -> None:
    """Bare llm-compressor: load, oneshot, save compressed (what a user script would do)."""
    from llmcompressor import oneshot
    from transformers import AutoModelForCausalLM

    from quantkit.methods.awq import cpu_pin_memory_guard

    tokenizer, windows = windows_for(model_dir, args)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    data = {} if variant == "rtn" or method in DATA_FREE else dict(dataset=windows.calib_dataset(), num_calibration_samples=len(windows.calib),
                                            max_seq_length=args.seq_len)
    # AWQ cannot run on a CPU-only machine without this (llm-compressor 0.14.0.1 pins memory).
    with cpu_pin_memory_guard():
        oneshot(model=model, recipe=oneshot_recipe(method, variant, model_dir, args), tokenizer=tokenizer, **data)
    model.save_pretrained(out, save_compressed=True)
    tokenizer.save_pretrained(out)


def worker_autoround_lib(model_dir: str, out: str, args) -> None:
    """The auto-round library on the same windows: W4A16 symmetric at the model's group size, 200
    iterations (or --iters), batch 8, seed 42 (or --seed), on --device, torch.compile off; saved through its
    `llm_compressor` export (compressed-tensors pack-quantized, as quantkit writes)."""
    import torch
    from auto_round import AutoRound
    from transformers import AutoModelForCausalLM

    tokenizer, windows = windows_for(model_dir, args)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype="auto")
    dataset = [torch.as_tensor(w).reshape(1, -1) for w in windows.calib]
    tuning = {"iters": args.iters} if args.iters else {}
    rounder = AutoRound(model, tokenizer=tokenizer, bits=4, group_size=model_group_size(model_dir), sym=True,
                        dataset=dataset, nsamples=len(dataset), seqlen=args.seq_len, batch_size=8, seed=args.seed,
                        device_map=args.device, enable_torch_compile=False, **tuning)
    # its compressed-tensors export: int4 weights with scales in the model's dtype, loaded as quantkit's are
    _model, folder = rounder.quantize_and_save(f"{out}.lib", format="llm_compressor")  # it adds a subfolder
    shutil.move(folder if isinstance(folder, str) else folder[0], out)  # one format: the folder itself


def worker_bnb(model_dir: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, quantization_config=config,
                                                 device_map="cpu")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(model_dir).save_pretrained(out)


def worker(argv: list[str]) -> None:
    kind, model_dir, out, method, variant = argv[:5]
    args = parse_args(argv[5:])
    if kind == "bnb":
        worker_bnb(model_dir, out)
    elif kind == "autoround-lib":
        worker_autoround_lib(model_dir, out, args)
    else:
        worker_llmcompressor(model_dir, out, method, variant, args)


# ---------------------------------------------------------------- parent: run and measure


def run_child(cmd: list[str], log: Path) -> tuple[float, int, int]:
    """Run a child; (wall seconds, peak RSS bytes, exit code), from wait4."""
    started = time.time()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return time.time() - started, usage.ru_maxrss * 1024, proc.returncode


def calib_flags(args) -> list[str]:
    return ["--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len),
            "--eval-windows", str(args.eval_windows)]


def variant_command(model: str, out: Path, method: str, variant: str, args, rotate: str = "none") -> list[str]:
    rotation = ["--rotate", rotate] if rotate != "none" else []
    if variant.startswith("quantkit"):
        # quantkit-nogate: --eval-windows 0, the same work as the bare engine (for the overhead ratio); its
        # calibration windows are then the first ones, which the benchmark scores on: its time is reported only
        flags = calib_flags(args)[:-1] + ["0"] if variant == "quantkit-nogate" else calib_flags(args)
        return [sys.executable, "-m", "quantkit", "quantize", model, *QUANTKIT_FLAGS.get(method, ["--method", method]),
                "--no-gate", *flags, *EXTRAS.get(method, {}).get(variant, []), *iters_flags(method, variant, args),
                "--device", args.device, *rotation,
                "-o", str(out), "--json", str(out) + ".report.json"]
    kind = {"nf4": "bnb"}.get(method, "autoround-lib" if variant == "autoround-lib" else "llmc")
    return [sys.executable, __file__, "--worker", kind, model, str(out), method, variant, model, *calib_flags(args),
            *iters_flags(method, variant, args), "--seed", str(args.seed), "--device", args.device, *rotation]


def iters_flags(method: str, variant: str, args) -> list[str]:
    """--iters for every autoround variant, quantkit's and the bare ones (the light preset keeps its own)."""
    return ["--iters", str(args.iters)] if method == "autoround" and args.iters and variant != "quantkit-light" else []


def score(artifact: Path, model: str, windows, baseline) -> dict:
    from quantkit.eval import evaluate
    from quantkit.formats.gate import load_artifact

    candidate = load_artifact(artifact, Path(model))
    metrics = evaluate.compare(evaluate.model_scorer(candidate), windows.eval, baseline)
    return metrics.as_dict()


def bench_variant(model: str, method: str, variant: str, args, work: Path, windows, baseline,
                  rotate: str = "none") -> dict:
    out = work / f"{method}-{variant}-{rotate}"
    wall, rss, code = run_child(variant_command(model, out, method, variant, args, rotate), work / f"{out.name}.log")
    label = method if rotate == "none" else f"{method} +{rotate}"
    row = {"method": label, "variant": variant, "rotate": rotate, "wall_s": round(wall, 1),
           "peak_rss_mib": round(rss / 2**20), "exit_code": code}
    if code != 0:
        return {**row, "error": (work / f"{out.name}.log").read_text()[-400:]}
    if variant.startswith("quantkit"):
        report = json.loads(Path(str(out) + ".report.json").read_text())
        row["quantize_s"] = report["targets"][0]["timings"]["quantize_s"]
        kv = report["targets"][0]["details"].get("kv_cache")
        if kv:
            row["kv_only_kld"] = kv["kld_mean"]
    row["bytes"] = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    if variant == "quantkit-nogate":  # calibrated on the first windows, the ones scored here: its time only
        return row
    return {**row, **score(out, model, windows, baseline)}


def variants(method: str, extras: bool = False, only: str | None = None) -> list[str]:
    extra = list(EXTRAS.get(method, {})) if extras else []
    lib = ["autoround-lib"] if method == "autoround" else []
    every = ["quantkit", "quantkit-nogate", *extra] + [v for v, scheme in PRESETS[method].items() if scheme] + lib
    return [v for v in every if only is None or v in only.split(",")]


def run(args) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from quantkit.eval import evaluate

    _, windows = windows_for(args.model, args)
    base = AutoModelForCausalLM.from_pretrained(args.model, dtype="auto").eval()
    baseline = evaluate.compute_baseline(evaluate.model_scorer(base), windows.eval)
    del base
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-methods-") as tmp:
        for method in args.methods.split(","):
            for rotate in args.rotate.split(","):
                for variant in variants(method, args.extras, args.variants):
                    rows.append(bench_variant(args.model, method, variant, args, Path(tmp), windows, baseline, rotate))
                    print(format_row(rows[-1]), file=sys.stderr, flush=True)
    return rows


# ---------------------------------------------------------------- output


HEADER = ("| method | tool | wall s | quantize s | peak RSS MiB | weights MB | ppl (base) | ppl | Δppl | KLD mean | top-1 |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")


def format_row(r: dict) -> str:
    if r.get("exit_code"):
        failed = f"failed (exit {r['exit_code']})"
        return f"| {r['method']} | {r['variant']} | {r['wall_s']} | | {r['peak_rss_mib']} | {failed} |"
    ran = (f"| {r['method']} | {r['variant']} | {r['wall_s']:.1f} | {r.get('quantize_s', '')} | {r['peak_rss_mib']} "
           f"| {r['bytes'] / 1e6:.2f} |")
    if "kld_mean" not in r:
        return f"{ran} not scored: calibrated on the scored windows | | | | |"
    return (f"{ran} {r['ppl_base']:.3f} | {r['ppl']:.3f} | {100 * r['ppl_increase']:+.2f}% | {r['kld_mean']:.5f} "
            f"| {100 * r['top1']:.2f}% |")


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--num-samples", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--eval-windows", type=int, default=16)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--json", dest="json_path", default=None)
    parser.add_argument("--extras", action="store_true", help="also gptq --symmetric, autoround's light preset and autoround --asymmetric")
    parser.add_argument("--iters", type=int, default=None, help="autoround's iterations on every side (default 200)")
    parser.add_argument("--seed", type=int, default=42, help="the auto-round library's seed (autoround-lib; quantkit "
                        "and llm-compressor's modifier use 42): two seeds show the run-to-run spread")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the variants quantize "
                        "(scoring stays on the CPU)")
    parser.add_argument("--variants", default=None, help="only these variants (comma-separated)")
    parser.add_argument("--rotate", default="none", help="rotations to run each method with, comma-separated: none, "
                        "hadamard, spinquant (a worker takes one)")
    return parser.parse_args(argv)


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(sys.argv[2:])
        return 0
    args = parse_args(sys.argv[1:])
    rows = run(args)
    print(HEADER)
    for row in rows:
        print(format_row(row))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
