"""Benchmark: the KV table for every KV-cache type of vLLM, llama.cpp and mlx-lm on one model, and the time the
KV measurement adds to the gate's own.

The model (a checkpoint directory) is measured against itself: each type's own damage over the same weights and
the total are then the same numbers. One forward per type (quantkit.eval.kv.measure); the gate's own time is one
forward of the model over the same windows.

    python scripts/bench_kv.py [MODEL_DIR] [--windows 8] [--seq-len 512] [--json out.json]

Without MODEL_DIR a toy model is built under /tmp/quantkit-bench (preset `micro`).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?")
    parser.add_argument("--windows", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--json")
    args = parser.parse_args()

    from quantkit.engines.transformers import load_tokenizer
    from quantkit.eval import evaluate, kv, scorers
    from quantkit.eval.kv.measure import measure_types
    from quantkit.formats.gate import opened_for_kv
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.calibration import make_windows
    from quantkit.run.recipe import Calibration, Gate

    if args.model:
        model = Path(args.model)
    else:
        from quantkit.toy import make_toy_model

        model = make_toy_model(Path("/tmp/quantkit-bench/micro"), "micro")
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
    kv_s = time.time() - started
    full = kv.bf16_bytes_per_token(shape)
    print(f"\n{model.name}: head_dim {shape.head_dim}, {shape.kv_heads} KV heads, {shape.layers} layers; "
          f"{len(windows)} windows of {windows.shape[1]} tokens; 16-bit KV {full:,.0f} B/token")
    print(f"{'type':32} {'B/token':>9} {'vs16':>5} {'KLD':>9} {'Δppl':>8} {'top-1':>7}")
    for r in rows:
        print(f"{r.kind.name:32} {r.bytes_per_token:9,.0f} {r.bytes_per_token / full:5.0%} {r.own.kld_mean:9.5f} "
              f"{r.own.ppl_increase:+8.2%} {r.own.top1:7.2%}")
    print(f"\ngate forward {gate_s:.1f}s; {len(kinds)} KV types {kv_s:.1f}s "
          f"({kv_s / max(gate_s, 1e-9) / len(kinds):.2f}x the gate's forward per type)")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": str(model), "gate_s": gate_s, "kv_s": kv_s,
                                               "types": [r.as_dict(shape) for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
