"""Benchmark: the KV table for every KV-cache type of vLLM, llama.cpp and mlx-lm on one model, the time the
KV measurement adds to the gate's own, and quantkit's llama.cpp KV simulation against llama-perplexity.

The model (a checkpoint directory) is measured against itself: each type's own damage over the same weights and
the total are then the same numbers. One forward per type (quantkit.eval.kv.measure); the gate's own time is one
forward of the model over the same windows.

    python scripts/bench_kv.py [MODEL_DIR] [--windows 8] [--seq-len 512] [--json out.json]
    python scripts/bench_kv.py MODEL_DIR --pad-vocab 262144 ...   # the same on a 262K-vocabulary shape of MODEL
    python scripts/bench_kv.py MODEL_DIR --gated --llama-cpp --json out.json   # also the two sections below
    python scripts/bench_kv.py MODEL_DIR --gated --keep-table --json out.json   # the gated runs again only
    python scripts/bench_kv.py --render out.json                   # the markdown tables of a run

--gated: one gated `quantkit quantize` per engine (llama.cpp: gguf Q8_0, mlx-lm: mlx 8-bit, vLLM: fp8), each run
three times one after another on the same calibration and held-out windows: without --kv-cache, with
--kv-cache auto (smallest first, stopping at the first that passes) and with --kv-cache all; the report's
timings give the gate's own seconds (eval_s) and the KV measurement's (kv_cache_s).
--llama-cpp: the model converted to an F16 GGUF; for each -ctk/-ctv pair (rotation on, and off for q4_0),
llama-perplexity --kl-divergence with that cache against its f16-cache run, and quantkit's simulated KL divergence
on the same tokens and positions (quantkit.eval.llamacpp.chunk_windows).

Without MODEL_DIR a toy model is built under /tmp/quantkit-bench (preset `micro`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GATED = {"llama.cpp": ["--method", "gguf", "--gguf-type", "Q8_0"], "mlx": ["--method", "mlx", "--bits", "8"],
         "vllm": ["--method", "fp8"]}
PAIRS = [("q8_0", "q8_0", True), ("q5_1", "q5_1", True), ("q4_0", "q4_0", True), ("q4_0", "q4_0", False),
         ("q8_0", "q4_0", True), ("iq4_nl", "iq4_nl", True)]
LLAMA_CTX, LLAMA_CHUNKS = 256, 8


def every_type(shape) -> list:
    """Every type each engine offers that this model's shape takes, rotation on and off for llama.cpp."""
    from quantkit.errors import UnsupportedError
    from quantkit.eval import kv

    kinds = []
    for engine in ("vllm", "llama.cpp", "mlx"):
        for name in kv.offered(engine, shape):
            try:
                kinds.append(kv.parse_one(name, shape))
            except UnsupportedError as exc:
                print(f"skipped {name}: {exc.message}")
    for name in ("llama.cpp:q4_0:norot", "llama.cpp:q8_0/q4_0:norot"):
        kinds.append(kv.parse_one(name, shape))
    return kinds


def kv_table(model: Path, args) -> dict:
    """Every type measured in this process on the model against itself, and the gate forward's seconds."""
    from quantkit.engines.transformers import load_tokenizer
    from quantkit.eval import evaluate, kv, scorers
    from quantkit.eval.kv.measure import measure_types
    from quantkit.formats.gate import opened_for_kv
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.calibration import make_windows
    from quantkit.run.recipe import Calibration, Gate

    info = check_model_dir(model)
    tokenizer = load_tokenizer(info, False)
    windows = make_windows(tokenizer, Calibration(num_samples=0, seq_len=args.seq_len, eval_windows=args.windows)).eval
    shape = kv.shape_of(info.config)
    started = time.time()
    baseline = evaluate.compute_baseline(scorers.checkpoint_scorer(model), windows, spill=False)
    gate_s = time.time() - started
    kinds = every_type(shape)
    started = time.time()
    reading, loaded = opened_for_kv(model, model, "cpu")
    rows = measure_types(reading, loaded, windows, baseline, kinds, shape, Gate(), progress=print)
    return {"shape": {"head_dim": shape.head_dim, "kv_heads": shape.kv_heads, "layers": shape.layers},
            "bf16_bytes_per_token": kv.bf16_bytes_per_token(shape), "windows": len(windows),
            "seq_len": windows.shape[1], "gate_forward_s": gate_s, "kv_s": time.time() - started,
            "types": [r.as_dict(shape) for r in rows]}


def run_quantize(model: Path, engine: str, kv_cache: str | None, args, work: Path) -> dict:
    out = work / f"{engine}-{kv_cache or 'none'}".replace(".", "")
    command = [sys.executable, "-m", "quantkit", "quantize", str(model), *GATED[engine], "-o", str(out),
               "--num-samples", str(args.num_samples), "--seq-len", str(args.seq_len), "--eval-windows",
               str(args.windows), "--json", str(out) + ".json"]
    command += ["--kv-cache", kv_cache, "--kv-engine", engine] if kv_cache else []
    started = time.time()
    done = subprocess.run(command, capture_output=True, text=True)
    wall = time.time() - started
    if done.returncode not in (0, 3):
        raise SystemExit(f"{' '.join(command)}: exit {done.returncode}\n{done.stderr[-3000:]}")
    target = json.loads(Path(str(out) + ".json").read_text())["targets"][0]
    section = target["details"].get("kv_cache_types") or {}
    types = section.get("types") or []
    report = json.loads(Path(str(out) + ".json").read_text())
    return {"engine": engine, "kv_cache": kv_cache or "", "exit": done.returncode, "wall_s": round(wall, 1),
            "baseline_s": report["timings"].get("baseline_s"),
            "eval_s": target["timings"].get("eval_s"), "kv_cache_s": target["timings"].get("kv_cache_s"),
            "measured": sum(1 for t in types if t.get("status") != "unneeded"), "offered": len(types),
            "chosen": section.get("chosen")}


def gated(model: Path, args) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="bench-kv-") as work:
        return [run_quantize(model, engine, kv_cache, args, Path(work))
                for engine in GATED for kv_cache in (None, "auto", "all")]


def llama_agreement(model: Path) -> list[dict]:
    """Per -ctk/-ctv pair: llama-perplexity's KL divergence and quantkit's simulated one on the same tokens."""
    from quantkit.engines.transformers import load_tokenizer
    from quantkit.eval import kv
    from quantkit.eval import llamacpp as llama
    from quantkit.eval.artifacts import load_gguf_into_base
    from quantkit.eval.kv.measure import second_half_kld
    from quantkit.gguf.convert import convert
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.calibration import load_texts

    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-kv-llama-") as tmp:
        gguf, text_file, base = Path(tmp) / "model-F16.gguf", Path(tmp) / "text.txt", Path(tmp) / "base.kld"
        convert(model, gguf, "F16")
        tokenizer = load_tokenizer(check_model_dir(model), False)
        text = "\n\n".join(load_texts("default", tokenizer, chat_template=False, text_field="text"))[:400_000]
        text_file.write_text(text)
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        windows = llama.chunk_windows(ids, llama.added_bos(gguf), LLAMA_CTX, LLAMA_CHUNKS)
        llama.run_perplexity(["-m", gguf, "-f", text_file, "--kl-divergence-base", base, "-ctk", "f16", "-ctv", "f16",
                              "-fa", "on"], LLAMA_CTX, LLAMA_CHUNKS)
        net = load_gguf_into_base(gguf, model)
        shape = kv.shape_of(net.config)
        for k_type, v_type, rotation in PAIRS:
            env = {} if rotation else {"LLAMA_ATTN_ROT_DISABLE": "1"}
            engine = llama.kl_divergence(gguf, text_file, base, LLAMA_CTX, LLAMA_CHUNKS,
                                         ["-ctk", k_type, "-ctv", v_type, "-fa", "on"], env)
            ours = second_half_kld(net, windows, kv.llamacpp_type(k_type, v_type, shape, rotation))
            rows.append({"k": k_type, "v": v_type, "rotation": rotation, "llama_cpp_kld": engine,
                         "quantkit_kld": ours, "relative": ours / engine - 1 if engine else None})
            print(rows[-1])
    return rows


def machine() -> str:
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else ""
    simd = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{platform.machine()} ({simd}), {os.cpu_count()} CPUs, no GPU"


def render(data: dict) -> str:
    table = data["table"]
    lines = [f"Model: {data['model']}; {data['machine']}; head_dim {table['shape']['head_dim']}, "
             f"{table['shape']['kv_heads']} KV heads, {table['shape']['layers']} layers; {table['windows']} windows "
             f"of {table['seq_len']} tokens; 16-bit KV {table['bf16_bytes_per_token']:,.0f} B/token.", "",
             "| KV type | bytes/token | vs 16-bit | KLD | Δppl | top-1 | left 16-bit |",
             "|---|---:|---:|---:|---:|---:|---|"]
    for t in table["types"]:
        lines.append(f"| `{t['type']}` | {t['bytes_per_token']:,.0f} | {1 - t['saving']:.0%} | "
                     f"{t['own']['kld_mean']:.3g} | {t['own']['ppl_increase']:+.2%} | {t['own']['top1']:.1%} | "
                     f"{', '.join(map(str, t['skipped_layers'])) or '—'} |")
    lines += ["", f"{len(table['types'])} types in {table['kv_s']:.1f} s; one forward of the model over the same "
              f"windows {table['gate_forward_s']:.1f} s."]
    if data.get("gated"):
        lines += ["", gated_table(data["gated"])]
    if data.get("llama_cpp"):
        lines += ["", "| -ctk / -ctv | rotation | llama-perplexity KLD | quantkit simulated KLD | difference |",
                  "|---|---|---:|---:|---:|"]
        for r in data["llama_cpp"]:
            diff = f"{r['relative']:+.0%}" if r["relative"] is not None else ""
            lines.append(f"| {r['k']} / {r['v']} | {'on' if r['rotation'] else 'off (LLAMA_ATTN_ROT_DISABLE=1)'} | "
                         f"{r['llama_cpp_kld']:.3g} | {r['quantkit_kld']:.3g} | {diff} |")
    return "\n".join(lines)


def added_s(row: dict, plain: dict) -> float:
    """What --kv-cache adds to the run's gated target: its eval and KV seconds over the plain run's eval."""
    return (row["eval_s"] or 0) + (row["kv_cache_s"] or 0) - (plain["eval_s"] or 0)


def gated_table(rows: list[dict]) -> str:
    """The gated runs: the gate's own seconds (the base's baseline and the artifact's eval, the plain run's), the
    KV measurement's, and what --kv-cache adds to the run over the plain run (the gate's eval keeps the artifact's
    reading for the types, so it grows)."""
    lines = ["| engine (method) | --kv-cache | exit | baseline s | gate eval s | KV s | added s | added / gate "
             "(baseline + eval) | added / gate eval | measured / offered | chosen | wall s |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|"]
    plain = {r["engine"]: r for r in rows if not r["kv_cache"]}
    for r in rows:
        method, base = " ".join(GATED[r["engine"]][1::2][:2]), plain[r["engine"]]
        gate = (base.get("baseline_s") or 0) + (base["eval_s"] or 0)
        added = added_s(r, base) if r["kv_cache"] else None
        ratios = f"{added / gate:.2f}x | {added / base['eval_s']:.2f}x" if added is not None and gate else " | "
        counts = f"{r['measured']} / {r['offered']}" if r["kv_cache"] else ""
        lines.append(f"| {r['engine']} ({method}) | {r['kv_cache'] or '—'} | {r['exit']} | "
                     f"{r.get('baseline_s') or 0:.1f} | {r['eval_s'] or 0:.1f} | {r['kv_cache_s'] or 0:.1f} | "
                     f"{'' if added is None else f'{added:.1f}'} | {ratios} | {counts} | {r['chosen'] or ''} | "
                     f"{r['wall_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--num-samples", type=int, default=32, help="--gated: calibration windows")
    parser.add_argument("--pad-vocab", type=int, metavar="N", help="MODEL with its vocabulary padded to N entries "
                        "(scripts/bench_auto.py's padding, written once beside it)")
    parser.add_argument("--gated", action="store_true")
    parser.add_argument("--llama-cpp", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--keep-table", action="store_true", help="take the KV table (and the llama.cpp agreement) "
                        "from the --json file of an earlier run of the same model; measure only what is asked")
    parser.add_argument("--render", metavar="JSON")
    args = parser.parse_args()
    if args.render:
        print(render(json.loads(Path(args.render).read_text())))
        return
    if args.model:
        model = Path(args.model)
    else:
        from quantkit.toy import make_toy_model

        model = make_toy_model(Path("/tmp/quantkit-bench/micro"), "micro")
    if args.pad_vocab:
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_auto import padded

        model = padded(model, args.pad_vocab)
    earlier = json.loads(Path(args.json).read_text()) if args.keep_table else {}
    data = {"model": model.name + (f" (vocabulary padded to {args.pad_vocab})" if args.pad_vocab else ""),
            "machine": machine(), "table": earlier.get("table") or kv_table(model, args)}
    if earlier.get("llama_cpp") and not args.llama_cpp:
        data["llama_cpp"] = earlier["llama_cpp"]
    if args.gated:
        data["gated"] = gated(model, args)
    if args.llama_cpp:
        data["llama_cpp"] = llama_agreement(model)
    print(render(data))
    if args.json:
        Path(args.json).write_text(json.dumps(data, indent=1))


if __name__ == "__main__":
    main()
