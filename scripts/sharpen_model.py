#!/usr/bin/env python
"""Copy a Llama checkpoint into one that quantization visibly hurts (quantkit.toy.sharpen).

    python scripts/sharpen_model.py SRC DST [--logit-scale 16] [--dtype bfloat16]

A toy model trained for a few hundred steps has flat next-token distributions, so rounding barely
moves them; real models have peaked ones. Scaling the final norm by --logit-scale (a power of two:
exact in bfloat16) sharpens every distribution, and 4 seeded input channels per attention block
get 16x activations against 1/16 weight columns (function preserving). The fallback benchmarks in
docs/methods.md use the width-576 reference model sharpened this way.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from quantkit.toy import sharpen


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--logit-scale", type=float, default=16.0)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="bfloat16")
    args = parser.parse_args(argv)
    sharpen(args.src, args.dst, logit_scale=args.logit_scale, dtype=args.dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
