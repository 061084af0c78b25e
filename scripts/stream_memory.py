"""Peak RSS of the gate's forwards, streamed layer by layer vs. the model loaded whole.

    python scripts/stream_memory.py build DIR [--layers 8]  # synthetic Llama: hidden 1024, vocab 128256, bf16
    python scripts/stream_memory.py measure DIR     # one fresh process per (phase, path); prints a table

Phases: `baseline` scores the bf16 checkpoint (in memory: quantkit.engines.transformers.load_model as the pipeline
loads it; streamed: quantkit.eval.scorers.checkpoint_scorer); `gguf` compares a Q8_0 .gguf of it with the
baseline (in memory: artifacts.load_gguf_into_base, a whole float32 model; streamed:
scorers.gguf_scorer). Every number is the process's RSS (quantkit.io.memory.PeakTracker); `before` is
the RSS when the measured phase starts (interpreter, torch, the baseline arrays for `gguf`).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

MIB = 1024 * 1024


def build(out: Path, layers: int = 8, hidden: int = 1024, vocab: int = 128256) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from quantkit.toy import build_tokenizer, bundled_texts

    tokenizer = build_tokenizer(bundled_texts(), 512)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=4096,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def windows(n: int, seq_len: int):
    import torch

    return torch.randint(0, 128000, (n, seq_len), generator=torch.Generator().manual_seed(0))


def one(model_dir: Path, phase: str, path: str, n: int, seq_len: int) -> dict:
    import gc

    from quantkit.engines.transformers import load_model
    from quantkit.eval import evaluate, scorers
    from quantkit.eval.artifacts import load_gguf_into_base
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.io.memory import PeakTracker, current_rss

    w = windows(n, seq_len)
    baseline = evaluate.compute_baseline(scorers.checkpoint_scorer(model_dir), w) if phase == "gguf" else None
    gc.collect()
    before = current_rss()
    with PeakTracker() as t:
        if phase == "baseline":
            scorer = (scorers.checkpoint_scorer(model_dir) if path == "streamed"
                      else evaluate.model_scorer(load_model(check_model_dir(model_dir))))
            result = evaluate.compute_baseline(scorer, w).ppl
        else:
            gguf = model_dir / "q8_0.gguf"
            scorer = (scorers.gguf_scorer(gguf, model_dir) if path == "streamed"
                      else evaluate.model_scorer(load_gguf_into_base(gguf, model_dir)))
            result = evaluate.compare(scorer, w, baseline).kld_mean
    return {"phase": phase, "path": path, "before_mib": before // MIB, "peak_mib": t.peak_rss // MIB,
            "seconds": t.seconds, "result": result}


def measure(model_dir: Path, n: int, seq_len: int) -> None:
    from quantkit.gguf.convert import convert

    if not (model_dir / "q8_0.gguf").exists():
        convert(model_dir, model_dir / "q8_0.gguf", "Q8_0")
    print(f"{'phase':9} {'path':9} {'before MiB':>10} {'peak MiB':>9} {'s':>7}  result")
    for phase in ("baseline", "gguf"):
        for path in ("memory", "streamed"):
            cmd = [sys.executable, __file__, "one", str(model_dir), phase, path, str(n), str(seq_len)]
            row = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.splitlines()[-1])
            print(f"{phase:9} {path:9} {row['before_mib']:>10} {row['peak_mib']:>9} {row['seconds']:>7.1f}  "
                  f"{row['result']:.6g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["build", "measure", "one"])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("rest", nargs="*")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    args = parser.parse_args()
    if args.command == "build":
        build(args.model_dir, args.layers)
    elif args.command == "measure":
        measure(args.model_dir, args.windows, args.seq_len)
    else:
        phase, path, n, seq_len = args.rest
        print(json.dumps(one(args.model_dir, phase, path, int(n), int(seq_len))))


if __name__ == "__main__":
    main()
