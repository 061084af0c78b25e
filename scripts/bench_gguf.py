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

Optional third tool: auto-round's GGUF export, when `import auto_round` works (skipped with a printed
reason otherwise). It runs in its own process with HF_HUB_OFFLINE=1 on the local model dir as
`AutoRound(model, iters=0, disable_opt_rtn=True).quantize_and_save(dir, format="gguf:q4_k_m")`: its
plain-RTN mode, the same no-imatrix setting as the other two. Its default iters=0 mode ("opt-RTN")
wants a calibration set and, offline, fails fetching NeelNanda/pile-10k (--autoround-opt-rtn runs it
anyway). auto-round converts with its own vendored copy of llama.cpp's conversion/ package, which has
the same two tokenizer problems as convert_hf_to_gguf.py, so the bench applies the same two runtime
shims to that copy (in the child process; nothing on disk is changed). A failure is reported as its
last error line in place of the numbers. Same wall / peak RSS / KLD / top-1 columns, plus tensors
byte-identical to llama-quantize's file and tensors whose type differs from it.

Usage: nice python scripts/bench_gguf.py [--types Q4_K_M Q6_K Q2_K] [--threads 1] [--json out.json]
       [--model DIR (an existing HF dir is used as is)] [--work DIR] [--no-autoround]
Needs scripts/build_llamacpp.sh to have run.
"""

from __future__ import annotations

import argparse
import json
import os
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
AUTOROUND_CMD = """
import sys
model_dir, out_dir, fmt, threads, opt_rtn = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5] == "1"
import torch
torch.set_num_threads(threads)
from auto_round import AutoRound
from auto_round.export.export_to_gguf.llama_cpp_conversion import get_conversion
base = sys.modules[get_conversion(model_path=model_dir).module.__name__ + ".base"]  # its vendored conversion/
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
def _no_spm(self):
    raise FileNotFoundError("tokenizer.model")
base.TextModel._set_vocab_sentencepiece = _no_spm
kw = {} if opt_rtn else {"disable_opt_rtn": True}
AutoRound(model_dir, iters=0, device_map="cpu", **kw).quantize_and_save(out_dir, format=fmt)
"""


def build_model(out: Path, layers: int = 12, hidden: int = 768, ffn: int = 2048, vocab: int = 32000) -> Path:
    """Random-init Llama (~150M params with the defaults), bf16, with quantkit's toy tokenizer."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantkit.toy import build_tokenizer, bundled_texts

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


def timed(cmd: list[str], cwd: Path | None = None, env: dict | None = None) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes) of a command, via /usr/bin/time."""
    out = subprocess.run(["/usr/bin/time", "-f", "QKTIME %e %M", *cmd], capture_output=True, text=True, cwd=cwd,
                         env=env)
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


def autoround_available() -> str | None:
    """None when auto-round imports, else the reason it does not."""
    out = subprocess.run([sys.executable, "-c", "import auto_round"], capture_output=True, text=True)
    if out.returncode == 0:
        return None
    lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit {out.returncode}"


def autoround_run(model: Path, out_dir: Path, gguf_type: str, threads: int,
                  opt_rtn: bool = False) -> tuple[float, int, Path]:
    """(wall, peak RSS, .gguf path); RuntimeError whose message is auto-round's last error line on failure."""
    import shutil

    shutil.rmtree(out_dir, ignore_errors=True)
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    cmd = [sys.executable, "-c", AUTOROUND_CMD, str(model), str(out_dir), "gguf:" + gguf_type.lower(), str(threads),
           "1" if opt_rtn else "0"]
    try:
        wall, rss = timed(cmd, env=env)
    except RuntimeError as e:
        lines = [ln for ln in str(e).splitlines()[1:] if ln.strip() and not ln.startswith(("QKTIME", "Command exited"))]
        errs = [ln for ln in lines if re.match(r"^\w[\w.]*(Error|Exception|Exit)\b", ln) or " ERROR " in ln]
        raise RuntimeError(re.sub(r"\x1b\[[0-9;]*m", "", (errs or lines or ["?"])[-1]).strip()) from None
    files = sorted(out_dir.rglob("*.gguf"))
    if not files:
        raise RuntimeError(f"no .gguf written under {out_dir}")
    return wall, rss, files[0]


def identical(a: Path, b: Path) -> tuple[int, int, int]:
    """(tensors with identical type and bytes, tensors in a, tensors whose type differs between a and b)."""
    import gguf
    import numpy as np

    ta = {t.name: (t.tensor_type, np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(str(a)).tensors}
    tb = {t.name: (t.tensor_type, np.asarray(t.data).tobytes()) for t in gguf.GGUFReader(str(b)).tensors}
    same = sum(1 for n in ta if n in tb and ta[n] == tb[n])
    types = sum(1 for n in ta if n not in tb or ta[n][0] != tb[n][0])
    return same, len(ta), types


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
    ap.add_argument("--work", type=Path, help="scratch dir (default: MODEL/../work)")
    ap.add_argument("--no-autoround", action="store_true", help="skip the auto-round column group")
    ap.add_argument("--autoround-opt-rtn", action="store_true",
                    help="auto-round's default iters=0 mode (opt-RTN, needs its calibration set) instead of plain RTN")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not (LLAMA / "bin" / "llama-quantize").exists():
        print("llama.cpp not built: run scripts/build_llamacpp.sh", file=sys.stderr)
        return 2
    model = build_model(args.model)
    work = args.work or args.model.parent / "work"
    work.mkdir(parents=True, exist_ok=True)
    ar_skip = "--no-autoround" if args.no_autoround else autoround_available()
    if ar_skip:
        print(f"auto-round: skipped ({ar_skip})", flush=True)
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
        same, total, _ = identical(ours, theirs)
        rows.append({"type": t, "quantkit_s": q_wall, "quantkit_rss_mib": q_rss / 2**20,
                     "llama_s": conv_wall + l_wall, "llama_convert_s": conv_wall, "llama_quantize_s": l_wall,
                     "llama_rss_mib": max(conv_rss, l_rss) / 2**20, "identical": f"{same}/{total}",
                     "quantkit": kld(ours, base, args.threads), "llama": kld(theirs, base, args.threads),
                     "bytes": ours.stat().st_size})
        if not ar_skip:
            rows[-1]["autoround"] = autoround_row(model, work / f"autoround-{t}", theirs, base, t, args)
        print_row(rows[-1])
    if args.json:
        args.json.write_text(json.dumps({"threads": args.threads, "model": str(model), "rows": rows}, indent=2))
    return 0


def autoround_row(model: Path, out_dir: Path, llama_file: Path, base: Path, t: str, args) -> dict:
    try:
        wall, rss, path = autoround_run(model, out_dir, t, args.threads, args.autoround_opt_rtn)
    except RuntimeError as e:
        return {"error": str(e)}
    same, total, types = identical(path, llama_file)
    return {"s": wall, "rss_mib": rss / 2**20, "identical": f"{same}/{total}", "type_differs": types,
            "bytes": path.stat().st_size, "file": str(path), **kld(path, base, args.threads)}


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
    ar = r.get("autoround")
    if ar and "error" in ar:
        print(f"{'':8} auto-round failed: {ar['error']}", flush=True)
    elif ar:
        print(f"{'':8} auto-round {ar['s']:.1f} s, {ar['rss_mib']:.0f} MiB, identical to llama.cpp {ar['identical']} "
              f"(type differs: {ar['type_differs']}), KLD {fmt(ar['kld'])}, top1 {fmt(ar['top1'])}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
