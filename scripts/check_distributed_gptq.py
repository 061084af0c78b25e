#!/usr/bin/env python
"""Check: does llm-compressor's distributed GPTQ (torchrun, gloo on CPU) give the single-process result?

It runs the same GPTQ W4A16 oneshot on quantkit's tiny toy model (random init, 16 windows of 64 random
tokens, sequential pipeline) in one process, in one process on the first 8 windows only, in two
torchrun ranks left to llm-compressor, and in two ranks the way `quantkit quantize` runs under
torchrun (quantkit.engines.llmcompressor.distributed: each rank given its own half of the windows, and a barrier after
GPTQ hands the quantized weights over). It prints each decoder Linear's relative weight error
||W_q - W|| / ||W|| against the base (for the two-rank runs, rank 0's weights: the rank that saves).

With llm-compressor 0.14.0.1 the run left to it matches the second column: its own split of an
identical dataset builds the sampler on the split but the DataLoader on the whole set, so both ranks
calibrate on the first 8 windows. quantkit's run matches the first column; without its barrier, the
second layer's numbers change from run to run (CPU weights are shared between ranks and nobody waits
for the owning rank to write them).

  --load plain     every rank loads the model itself (what a plain from_pretrained gives)
  --load shared    compressed-tensors' load_offloaded_model: rank 0 loads, the weights are shared

Usage: python scripts/check_distributed_gptq.py [--work DIR] [--load plain|shared]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def quantize(model_dir: Path, out: Path, load: str, windows: int, split: str) -> None:
    """One oneshot GPTQ run (in this process, one of torchrun's ranks or the only one); weights to out."""
    import torch
    import torch.distributed as dist
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.gptq import GPTQModifier
    from transformers import AutoModelForCausalLM

    from quantkit.engines.llmcompressor.distributed import ranks_from, synchronized

    launch = ranks_from(os.environ)
    if launch.distributed:
        dist.init_process_group("gloo")
    if load == "shared":
        from compressed_tensors.offload import load_offloaded_model

        with load_offloaded_model():
            model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, device_map="cpu",
                                                         max_memory={"cpu": 8 << 30})
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ranks = launch if split == "quantkit" else ranks_from({})  # llm-compressor: one Ranks() and its own split
    ids = torch.randint(5, 500, (16, 64), generator=torch.Generator().manual_seed(2))[:windows][ranks.share(windows)]
    data = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": torch.ones_like(ids).tolist()})
    with synchronized(ranks):
        oneshot(model=model, dataset=data, recipe=GPTQModifier(targets="Linear", scheme="W4A16", ignore=["lm_head"]),
                num_calibration_samples=len(ids), max_seq_length=64, shuffle_calibration_samples=False,
                pipeline="sequential")
    if launch.is_main:
        torch.save({k: v.clone() for k, v in model.state_dict().items() if k.endswith("proj.weight")}, out)
    if launch.distributed:
        dist.destroy_process_group()


def relative_errors(base_dir: Path, weights: Path) -> dict[str, float]:
    import torch
    from safetensors.torch import load_file

    base = load_file(base_dir / "model.safetensors")
    quantized = torch.load(weights)
    return {name: float((w.float() - base[name].float()).norm() / base[name].float().norm())
            for name, w in sorted(quantized.items())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "quantkit-distributed-check")
    ap.add_argument("--load", choices=("plain", "shared"), default="plain")
    ap.add_argument("--rank-run", type=Path, help=argparse.SUPPRESS)  # internal: one run, weights to this file
    ap.add_argument("--windows", type=int, default=16, help=argparse.SUPPRESS)
    ap.add_argument("--split", choices=("llmcompressor", "quantkit"), default="llmcompressor", help=argparse.SUPPRESS)
    args = ap.parse_args()
    model_dir = args.work / "tiny"
    if args.rank_run:
        quantize(model_dir, args.rank_run, args.load, args.windows, args.split)
        return 0
    from quantkit.toy import make_toy_model

    args.work.mkdir(parents=True, exist_ok=True)
    if not (model_dir / "config.json").exists():
        make_toy_model(model_dir, "tiny", steps=0)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    runs = {"1 process": ([sys.executable], 16, "llmcompressor"),
            "1 process, 8 windows": ([sys.executable], 8, "llmcompressor"),
            "2 ranks, llm-compressor": (torchrun, 16, "llmcompressor"), "2 ranks, quantkit": (torchrun, 16, "quantkit")}
    errors = {}
    for label, (launcher, windows, split) in runs.items():
        weights = args.work / f"{label.replace(' ', '-').replace(',', '')}.pt"
        subprocess.run([*launcher, __file__, "--work", str(args.work), "--load", args.load, "--windows",
                        str(windows), "--split", split, "--rank-run", str(weights)], check=True, env=env,
                       capture_output=True)
        errors[label] = relative_errors(model_dir, weights)
    print(f"GPTQ W4A16 on 16 windows, relative weight error per Linear (--load {args.load})")
    print(f"{'module':28}" + "".join(f"{label:>25}" for label in runs))
    for name in errors["1 process"]:
        short = name.removeprefix("model.").removesuffix(".weight").replace("self_attn.", "").replace("mlp.", "")
        print(f"{short:28}" + "".join(f"{errors[label][name]:25.3f}" for label in runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
