#!/usr/bin/env python
"""Benchmark: HF -> GGUF k-quants with quantkit vs llama.cpp (convert_hf_to_gguf.py + llama-quantize).

One synthetic Llama (random init, ~150M parameters, bf16 safetensors, quantkit's toy BPE tokenizer)
is converted to each type by both tools with the same thread count. Reported per type and tool:
wall seconds and peak RSS (/usr/bin/time), tensors with identical bytes, and KLD / top-1 agreement
vs the F16 GGUF measured by llama-perplexity --kl-divergence on the same text.

llama.cpp's route is `convert_hf_to_gguf.py --outtype bf16` (bf16 keeps the source values, so both
tools quantize the same numbers) then `llama-quantize`. convert_hf_to_gguf.py refuses tokenizers
whose pre-tokenizer hash it does not know (the toy one); the bench patches get_vocab_base_pre to
return "gpt-2", which is what quantkit writes for it (see quantkit/gguf/vocab.py), and makes its
SentencePiece attempt raise FileNotFoundError as it does when sentencepiece is installed.

Usage: nice python scripts/bench_gguf.py [--types Q4_K_M Q6_K Q2_K] [--threads 1] [--json out.json]
Needs scripts/build_llamacpp.sh to have run.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LLAMA = ROOT / "third_party" / "llama.cpp"
CONVERT_WRAPPER = """
import sys
sys.path.insert(0, {src!r}); sys.path.insert(0, {src!r} + "/gguf-py")
sys.argv = ["convert_hf_to_gguf.py"] + {args!r}
import conversion.base as base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
def _no_spm(self):  # what it raises with sentencepiece installed and no tokenizer.model
    raise FileNotFoundError("tokenizer.model")
base.TextModel._set_vocab_sentencepiece = _no_spm
import runpy
runpy.run_path({src!r} + "/convert_hf_to_gguf.py", run_name="__main__")
"""
QUANTKIT_CMD = """
import sys
from quantkit.gguf.convert import convert
convert(sys.argv[1], sys.argv[2], sys.argv[3], threads=int(sys.argv[4]))
"""


def build_model(out: Path, layers: int = 12, hidden: int = 768, ffn: int = 2048, vocab: int = 32000) -> Path:
    """Random-init Llama (~150M params with the defaults), bf16, with quantkit's toy tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantkit.toy import bundled_texts, build_tokenizer

    if (out / "model.safetensors").exists():
        return out
    tok = build_tokenizer(bundled_texts(), 4096)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                      num_attention_heads=12, num_key_value_heads=4, max_position_embeddings=2048,
                      rms_norm_eps=1e-5, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


def timed(cmd: list[str], cwd: Path | None = None) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of a command, via /usr/bin/time."""
    out = subprocess.run(["/usr/bin/time", "-f", "QKTIME %e %M", *cmd], capture_output=True, text=True, cwd=cwd)
    if out.returncode != 0:
        raise RuntimeError(f"{cmd[0]} failed:\n{out.stderr[-3000:]}")
    wall, rss = re.findall(r"QKTIME ([0-9.]+) (\d+)", out.stderr)[-1]
    return float(wall), int(rss) * 1024


def quantkit_run(model: Path, out: Path, gguf_type: str, threads: int) -> tuple[float, int]:
    return timed([sys.executable, "-c", QUANTKIT_CMD, str(model), str(out), gguf_type, str(threads)], cwd=ROOT)


def llama_convert(model: Path, out: Path, outtype: str) -> tuple[float, int]:
    code = CONVERT_WRAPPER.format(src=str(LLAMA / "src"), args=[str(model), "--outfile", str(out), "--outtype", outtype])
    return timed([sys.executable, "-c", code])


def llama_run(bf16: Path, out: Path, gguf_type: str, threads: int) -> tuple[float, int]:
    return timed([str(LLAMA / "bin" / "llama-quantize"), str(bf16), str(out), gguf_type, str(threads)])


def identical(a: Path, b: Path) -> tuple[int, int]:
    import gguf
    import numpy as np

    ta = {t.name: (t.tensor_type, np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(str(a)).tensors}
    tb = {t.name: (t.tensor_type, np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(str(b)).tensors}
    return sum(1 for n in ta if n in tb and ta[n] == tb[n]), len(ta)


def kld(model: Path, base: Path, threads: int) -> dict:
    exe = str(LLAMA / "bin" / "llama-perplexity")
    out = subprocess.run([exe, "-m", str(model), "--kl-divergence-base", str(base), "--kl-divergence",
                          "-t", str(threads)], capture_output=True, text=True)
    text = out.stdout + out.stderr
    mean = re.search(r"Mean\s+KLD:\s+([-0-9.eE+]+)", text)
    top = re.search(r"Same top p:\s+([0-9.]+)", text)
    return {"kld": float(mean.group(1)) if mean else None, "top1": float(top.group(1)) / 100 if top else None}


def make_kld_base(f16: Path, work: Path, threads: int, ctx: int, chunks: int) -> Path:
    from quantkit.toy import bundled_texts

    text = work / "text.txt"
    text.write_text("\n\n".join(bundled_texts()))
    base = work / "base.kld"
    subprocess.run([str(LLAMA / "bin" / "llama-perplexity"), "-m", str(f16), "-f", str(text), "-c", str(ctx),
                    "--chunks", str(chunks), "--kl-divergence-base", str(base), "-t", str(threads)],
                   check=True, capture_output=True)
    return base


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--types", nargs="+", default=["Q4_K_M", "Q6_K", "Q2_K"])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--model", type=Path, default=Path(tempfile.gettempdir()) / "quantkit-bench" / "llama150m")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=8)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not (LLAMA / "bin" / "llama-quantize").exists():
        print("llama.cpp not built: run scripts/build_llamacpp.sh", file=sys.stderr)
        return 2
    model = build_model(args.model)
    work = args.model.parent / "work"
    work.mkdir(exist_ok=True)
    f16 = work / "f16.gguf"
    quantkit_run(model, f16, "F16", args.threads)
    base = make_kld_base(f16, work, args.threads, args.ctx, args.chunks)
    bf16 = work / "llama-bf16.gguf"
    conv_wall, conv_rss = llama_convert(model, bf16, "bf16")
    rows = []
    for t in args.types:
        ours, theirs = work / f"quantkit-{t}.gguf", work / f"llama-{t}.gguf"
        q_wall, q_rss = quantkit_run(model, ours, t, args.threads)
        l_wall, l_rss = llama_run(bf16, theirs, t, args.threads)
        same, total = identical(ours, theirs)
        rows.append({"type": t, "quantkit_s": q_wall, "quantkit_rss_mib": q_rss / 2**20,
                     "llama_s": conv_wall + l_wall, "llama_convert_s": conv_wall, "llama_quantize_s": l_wall,
                     "llama_rss_mib": max(conv_rss, l_rss) / 2**20, "identical": f"{same}/{total}",
                     "quantkit": kld(ours, base, args.threads), "llama": kld(theirs, base, args.threads),
                     "bytes": ours.stat().st_size})
        print_row(rows[-1])
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "model": str(model), "rows": rows}, indent=2))
    return 0


def print_row(r: dict) -> None:
    if not hasattr(print_row, "header"):
        print_row.header = True
        print(f"{'type':8} {'quantkit s':>10} {'RSS MiB':>8} {'llama s':>8} {'(conv+q)':>13} {'RSS MiB':>8} "
              f"{'identical':>9} {'KLD qk':>9} {'KLD llama':>9} {'top1 qk':>8} {'top1 ll':>8}")
    fmt = lambda v: "n/a" if v is None else f"{v:.5f}"  # noqa: E731
    print(f"{r['type']:8} {r['quantkit_s']:10.1f} {r['quantkit_rss_mib']:8.0f} {r['llama_s']:8.1f} "
          f"{r['llama_convert_s']:6.1f}+{r['llama_quantize_s']:<6.1f} {r['llama_rss_mib']:8.0f} {r['identical']:>9} "
          f"{fmt(r['quantkit']['kld']):>9} {fmt(r['llama']['kld']):>9} {fmt(r['quantkit']['top1']):>8} "
          f"{fmt(r['llama']['top1']):>8}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
