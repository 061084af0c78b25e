#!/usr/bin/env python
"""Train the `reference` toy model (quantkit.toy) deterministically on CPU.

    python scripts/train_reference_model.py OUT [--steps N] [--seed S]

Used by slow tests and scripts/bench_methods.py. A few hundred CPU steps give a model whose
weights are still close to Gaussian and whose activations have no outlier channels, so 4-bit
rounding barely moves its perplexity (RTN W4 g128: +0.1%). Real LLMs are sensitive because a few
residual channels carry activations 10-100x the median (the SmoothQuant/AWQ observation). So
after training, `inject_outlier_channels` reproduces that, exactly preserving the function: for
a few seeded channels j of every input_layernorm / post_attention_layernorm, the norm weight
w[j] is multiplied by F and the columns j of the linears it feeds (q/k/v, gate/up) are divided
by F. F is a power of two, so in bfloat16 both edits are exact and the 16-bit model computes the
same logits; only quantization sees the difference (small weight columns meeting large
activations), as it does in real models.

Same seed and steps give the same weights on the same machine (torch.use_deterministic_algorithms);
another processor's CPU kernels round differently, so its model, and every figure measured on it,
differs slightly (width-576 preset: base perplexity 232.6 on one machine, 236.9 on another).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="output checkpoint directory")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the preset's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--preset", default="reference", help="quantkit.toy preset name")
    parser.add_argument("--outlier-channels", type=int, default=4, help="outlier channels per norm (0: none)")
    parser.add_argument("--outlier-factor", type=float, default=16.0, help="power of two")
    return parser.parse_args(argv)


# norm name suffix -> the linears (same layer) whose input it produces
NORM_CONSUMERS = {
    "input_layernorm": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "post_attention_layernorm": ("mlp.gate_proj", "mlp.up_proj"),
}


def inject_outlier_channels(model_dir: Path, channels: int, factor: float, seed: int = 0) -> dict:
    """Rescale seeded channels of each norm by `factor` and the consuming weight columns by
    1/factor, in place in model.safetensors. Returns {norm name: channels}."""
    import torch
    from safetensors.torch import load_file, save_file

    if math.log2(factor) % 1:
        raise SystemExit("--outlier-factor must be a power of two (exact in bfloat16)")
    path = model_dir / "model.safetensors"
    tensors = load_file(path)
    gen = torch.Generator().manual_seed(seed)
    chosen = {}
    for norm_name in sorted(n for n in tensors if n.endswith("layernorm.weight")):
        prefix, kind = norm_name[: -len(".weight")].rsplit(".", 1)
        idx = torch.randperm(tensors[norm_name].numel(), generator=gen)[:channels]
        tensors[norm_name][idx] *= factor
        for consumer in NORM_CONSUMERS[kind]:
            tensors[f"{prefix}.{consumer}.weight"][:, idx] /= factor
        chosen[norm_name] = sorted(idx.tolist())
    save_file(tensors, path, metadata={"format": "pt"})
    return chosen


def main(argv: list[str] | None = None) -> int:
    import torch

    from quantkit.toy import make_toy_model

    args = parse_args(sys.argv[1:] if argv is None else argv)
    torch.use_deterministic_algorithms(True)
    started = time.time()
    out = make_toy_model(args.out, preset=args.preset, seed=args.seed, steps=args.steps)
    summary = json.loads((out / "toy_model.json").read_text())
    if args.outlier_channels:
        chosen = inject_outlier_channels(out, args.outlier_channels, args.outlier_factor, args.seed)
        summary["outliers"] = {"factor": args.outlier_factor, "channels": chosen}
        (out / "toy_model.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"wrote {out}: preset {args.preset}, {summary['train_steps']} steps, "
          f"final loss {summary['final_loss']:.3f}, {time.time() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
