#!/usr/bin/env python
"""Benchmark: peak memory and wall time of full quantkit runs at a real model size, against llama.cpp.

A synthetic Llama with Llama 3's vocabulary (random init, bf16 safetensors; default hidden 2048,
8 layers, ffn 8192, 32 heads / 8 KV heads, vocab 128256: 0.98B parameters, 1.96 GB) is built
locally with quantkit's toy BPE tokenizer. Each run is one process measured by /usr/bin/time
(wall seconds, peak RSS), with the same thread count and the same token counts:

  quantkit gguf Q4_K_M   `quantkit quantize --method gguf --gguf-type Q4_K_M` (imatrix auto from
                         N calibration windows, gate on E held-out windows)
  llama.cpp workflow     convert_hf_to_gguf.py --outtype bf16, llama-imatrix (N chunks), llama-quantize
                         --imatrix, llama-perplexity --kl-divergence-base on the bf16 file and
                         --kl-divergence on the Q4_K_M file (E chunks): wall summed, peak = max
  quantkit fp8 / gptq    `quantkit quantize --method fp8|gptq` with the same windows and gate, in RAM
                         and with --offload-dir (decoder layers on disk while llm-compressor works)
  quantkit gguf, bare    `--imatrix none --eval-windows 0` against llama.cpp's convert + llama-quantize
  bare-transformers      the same quantkit run in an interpreter that first imported transformers'
                         AutoConfig and AutoTokenizer (and so torch): what reading the configuration
                         and tokenizer through transformers would cost

Runs pass --no-gate: the gate is measured in full but not enforced (a random model's metrics mean
nothing); the memory and time are those of a gated run. llama.cpp's text files are the decoded
calibration / held-out windows, so both tools see the same text and the same number of tokens.

Usage: nice python scripts/bench_memory.py [--work DIR] [--threads 2]
       [--runs gguf,fp8,fp8-offload,gptq,gptq-offload,bare,bare-transformers]
       [--hidden 2048 --layers 8 --vocab 128256 --ffn 8192] [--model-dir DIR] [--calib 8 --eval 4 --seq-len 256] [--json out.json]
Needs scripts/build_llamacpp.sh to have run for the llama.cpp rows (they are skipped otherwise).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gguf import LLAMA, llama_convert, timed  # noqa: E402  (the shared llama.cpp helpers)

MIB = 1 << 20


def build_model(out: Path, hidden: int, layers: int, vocab: int, ffn: int) -> Path:
    """Random-init Llama in bf16 (std 0.02, norms 1) with quantkit's toy tokenizer.

    The weights are drawn one tensor at a time and written in shards of about 2 GB, so a model
    larger than RAM can be built (transformers' init would hold it whole in float32)."""
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantkit.toy import build_tokenizer, bundled_texts

    if (out / "config.json").exists():
        return out
    tok = build_tokenizer(bundled_texts(), 4096)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 256),
                      max_position_embeddings=4096, rms_norm_eps=1e-5, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id, tie_word_embeddings=False, dtype="bfloat16",
                      architectures=["LlamaForCausalLM"])
    with torch.device("meta"):
        shapes = {name: t.shape for name, t in LlamaForCausalLM(cfg).state_dict().items()}
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(0)
    shards, shard, size, last = [], {}, 0, next(reversed(shapes))
    for name, shape in shapes.items():
        weight = torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=gen).mul_(0.02)
        shard[name] = weight.to(torch.bfloat16)
        size += shard[name].nbytes
        if size >= 2 << 30 or name == last:
            shards.append(list(shard))
            save_file(shard, out / f"part-{len(shards)}.safetensors", metadata={"format": "pt"})
            shard, size = {}, 0
    write_shards_index(out, shards)
    cfg.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def write_shards_index(out: Path, shards: list[list[str]]) -> None:
    """Give the part files transformers' shard names and write model.safetensors.index.json."""
    weight_map = {}
    for i, names in enumerate(shards, 1):
        path = out / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        (out / f"part-{i}.safetensors").rename(path)
        weight_map.update(dict.fromkeys(names, path.name))
    index = {"metadata": {"total_size": sum(path.stat().st_size for path in out.glob("model-*.safetensors"))},
             "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def window_texts(model: Path, calib: int, evaluate: int, seq_len: int, work: Path) -> tuple[Path, Path]:
    """The calibration and held-out windows quantkit cuts, decoded to text for llama.cpp."""
    from transformers import AutoTokenizer

    from quantkit.run.calibration import make_windows
    from quantkit.run.recipe import Calibration

    tok = AutoTokenizer.from_pretrained(model)
    windows = make_windows(tok, Calibration(num_samples=calib, seq_len=seq_len, eval_windows=evaluate))
    paths = work / "calib.txt", work / "eval.txt"
    for path, ids in zip(paths, (windows.calib, windows.eval)):
        path.write_text("\n".join(tok.decode(w, skip_special_tokens=True) for w in ids.tolist()))
    return paths


def quantkit_run(model: Path, out: Path, args, *flags: str) -> dict:
    cmd = [sys.executable, "-m", "quantkit", "quantize", str(model), "-o", str(out), "--overwrite", "--no-gate",
           "--num-samples", str(args.calib), "--seq-len", str(args.seq_len), "--eval-windows", str(args.eval),
           "--json", str(out.parent / f"{out.name}.json"), *flags]
    wall, rss = timed(cmd)
    return {"wall_s": wall, "peak_rss": rss, "steps": report_steps(out.parent / f"{out.name}.json")}


def report_steps(path: Path) -> dict:
    """Seconds and peak RSS of the run's steps, from its quantkit.json (baseline, quantize, gate)."""
    report = json.loads(path.read_text())
    target = report["targets"][0]
    steps = {}
    if "baseline_s" in report["timings"]:  # not in lockstep: the base is scored beside the artifact, in the eval step
        steps["baseline"] = {"wall_s": report["timings"]["baseline_s"], "peak_rss": report["baseline"]["peak_rss_bytes"]}
    for step, timing in (("quantize", "quantize_s"), ("eval", "eval_s")):
        if step in target.get("peak_rss_by_step", {}):
            steps[step] = {"wall_s": target["timings"][timing], "peak_rss": target["peak_rss_by_step"][step]}
    return steps


def llama(tool: str, *argv: str) -> tuple[float, int]:
    return timed([str(LLAMA / "bin" / tool), *argv])


def llama_gguf_workflow(model: Path, work: Path, texts: tuple[Path, Path], args) -> dict:
    """convert (bf16) + llama-imatrix + llama-quantize --imatrix + llama-perplexity KLD base and compare."""
    bf16, imatrix, q4, base = work / "ll-bf16.gguf", work / "ll-imatrix.gguf", work / "ll-q4km.gguf", work / "ll.kld"
    t = str(args.threads)
    steps = {
        "convert": llama_convert(model, bf16, "bf16"),
        "imatrix": llama("llama-imatrix", "-m", str(bf16), "-f", str(texts[0]), "-c", str(args.seq_len),
                         "--chunks", str(args.calib), "-o", str(imatrix), "-t", t),
        "quantize": llama("llama-quantize", "--imatrix", str(imatrix), str(bf16), str(q4), "Q4_K_M", t),
        "kld_base": llama("llama-perplexity", "-m", str(bf16), "-f", str(texts[1]), "-c", str(args.seq_len),
                          "--chunks", str(args.eval), "--kl-divergence-base", str(base), "-t", t),
        "kld": llama("llama-perplexity", "-m", str(q4), "--kl-divergence-base", str(base), "--kl-divergence",
                     "-t", t),
    }
    return {"wall_s": sum(w for w, _ in steps.values()), "peak_rss": max(r for _, r in steps.values()),
            "steps": {k: {"wall_s": w, "peak_rss": r} for k, (w, r) in steps.items()}}


def llama_bare(model: Path, work: Path, args) -> dict:
    bf16, q4 = work / "ll-bare-bf16.gguf", work / "ll-bare-q4km.gguf"
    convert = llama_convert(model, bf16, "bf16")
    quantize = llama("llama-quantize", str(bf16), str(q4), "Q4_K_M", str(args.threads))
    return {"wall_s": convert[0] + quantize[0], "peak_rss": max(convert[1], quantize[1])}


def run_all(args) -> dict:
    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    model = build_model(args.model_dir or work / "model", args.hidden, args.layers, args.vocab, args.ffn or 4 * args.hidden)
    model_bytes = sum(f.stat().st_size for f in model.glob("*.safetensors"))
    have_llama = (LLAMA / "bin" / "llama-quantize").exists()
    texts = window_texts(model, args.calib, args.eval, args.seq_len, work)
    rows = {}
    runs = args.runs.split(",")
    if "gguf" in runs:
        rows["quantkit gguf Q4_K_M (imatrix, gate)"] = quantkit_run(model, work / "qk-q4km", args, "--method", "gguf")
        if have_llama:
            rows["llama.cpp workflow (convert, imatrix, quantize, KLD)"] = llama_gguf_workflow(model, work, texts, args)
    offload = work / "offload"
    offload.mkdir(exist_ok=True)
    for method in ("fp8", "gptq"):
        if method in runs:
            rows[f"quantkit {method} (gate)"] = quantkit_run(model, work / f"qk-{method}", args, "--method", method)
        if f"{method}-offload" in runs:
            rows[f"quantkit {method} (gate, --offload-dir)"] = quantkit_run(
                model, work / f"qk-{method}-offload", args, "--method", method, "--offload-dir", str(offload))
    if "bare" in runs:
        rows["quantkit gguf Q4_K_M, --imatrix none --eval-windows 0"] = timed_bare(model, work, args)
        if have_llama:
            rows["llama.cpp convert + llama-quantize"] = llama_bare(model, work, args)
    if "bare-transformers" in runs:
        rows["quantkit bare, transformers + torch imported"] = timed_bare(model, work, args, PRELOAD_TRANSFORMERS)
    return {"model": str(model), "model_bytes": model_bytes, "threads": args.threads, "calib": args.calib,
            "eval": args.eval, "seq_len": args.seq_len, "rows": rows}


PRELOAD_TRANSFORMERS = """
import runpy, sys
from transformers import AutoConfig, AutoTokenizer  # noqa: F401  (imports torch)
sys.argv = ["quantkit", *sys.argv[1:]]
runpy.run_module("quantkit", run_name="__main__")
"""


def timed_bare(model: Path, work: Path, args, preload: str | None = None) -> dict:
    out = work / ("qk-bare" if preload is None else "qk-bare-preloaded")
    run = ["-m", "quantkit"] if preload is None else ["-c", preload]
    cmd = [sys.executable, *run, "quantize", str(model), "-o", str(out), "--overwrite", "--method",
           "gguf", "--imatrix", "none", "--eval-windows", "0"]
    wall, rss = timed(cmd)
    return {"wall_s": wall, "peak_rss": rss}


def print_table(result: dict) -> None:
    model_bytes = result["model_bytes"]
    print(f"model: {result['model']} ({model_bytes / 1e9:.2f} GB bf16), {result['threads']} threads, "
          f"{result['calib']} calibration + {result['eval']} held-out windows of {result['seq_len']} tokens")
    print(f"{'run':58} {'wall s':>8} {'peak RSS MiB':>13} {'RSS / model':>12}")
    for name, row in result["rows"].items():
        print(f"{name:58} {row['wall_s']:8.1f} {row['peak_rss'] / MIB:13.0f} {row['peak_rss'] / model_bytes:12.2f}")
        for step, s in row.get("steps", {}).items():
            print(f"{'  ' + step:58} {s['wall_s']:8.1f} {s['peak_rss'] / MIB:13.0f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "quantkit-bench-memory")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", default="gguf,fp8,fp8-offload,gptq,gptq-offload,bare,bare-transformers")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--ffn", type=int, help="intermediate size (default 4 × hidden)")
    ap.add_argument("--model-dir", type=Path, help="where the model is built or found (default WORK/model)")
    ap.add_argument("--calib", type=int, default=8)
    ap.add_argument("--eval", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    result = run_all(args)
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
