"""Benchmark: the model-free MoE path's memory against the checkpoint's size, and against llm-compressor's own
model_free_ptq on the same checkpoint and scheme.

A synthetic MoE checkpoint (quantkit.toy_moe, preset `wide`, more experts with --experts) is written once; then, each
in its own process, `quantkit quantize --eval-windows 0` (no gate: the quantization alone) and llm-compressor's
model_free_ptq (its shards as written, max_workers 1 and 2) quantize it with each scheme; wall time and peak RSS come
from os.wait4. The table shows each run's peak RSS beside the checkpoint's bytes.

    python scripts/bench_model_free_moe.py [--kind deepseek_v3] [--experts 64] [--schemes fp8-block,nvfp4-a16,mxfp4]
        [--work DIR] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_fp8 import timed

QUANTKIT_ARGS = {"fp8-block": ["--method", "fp8", "--scheme", "fp8-block"],
                 "nvfp4-a16": ["--method", "nvfp4", "--scheme", "a16"], "mxfp4": ["--method", "mxfp4"]}
BARE = """
import json, sys
from llmcompressor.entrypoints.model_free import model_free_ptq
from quantkit.engines.llmcompressor import model_free_moe
from quantkit.io.checkpoint import check_model_dir
from quantkit.methods import ignore_patterns
model, out, scheme, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
info = check_model_dir(__import__("pathlib").Path(model))
if scheme == "fp8-block":
    from compressed_tensors.quantization import QuantizationScheme
    from quantkit.methods import fp8
    chosen = QuantizationScheme(**fp8.block_scheme_config()["group_0"])
else:
    chosen = model_free_moe.preset_scheme({"nvfp4-a16": "NVFP4A16", "mxfp4": "MXFP4A16"}[scheme])
ignore = ignore_patterns(info, [])
kept = model_free_moe.written_ignore(info, ignore, model_free_moe.quantized_modules(info, ignore))
model_free_ptq(model, out, config=model_free_moe.model_free_config(chosen, [*kept, "model.embed_tokens"]),
               max_workers=workers, device="cpu")
"""


def checkpoint_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.glob("*.safetensors"))


def run_all(kind: str, experts: int, schemes: list[str], work: Path) -> dict:
    from quantkit.toy_moe import build_moe

    model = work / f"{kind}-{experts}"
    if not (model / "config.json").is_file():
        build_moe(kind, model, "wide", experts=experts)
    bare = work / "bare.py"
    bare.write_text(BARE)
    rows = []
    for scheme in schemes:
        out = work / f"quantkit-{scheme}"
        wall, rss = timed([sys.executable, "-m", "quantkit", "quantize", str(model), *QUANTKIT_ARGS[scheme], "-o",
                           str(out), "--overwrite", "--eval-windows", "0", "--num-samples", "0"])
        rows.append({"scheme": scheme, "tool": "quantkit", "wall_s": wall, "peak_rss": rss,
                     "artifact_bytes": checkpoint_bytes(out)})
        shutil.rmtree(out)
        for workers in (1, 2):
            out = work / f"bare-{scheme}-{workers}"
            wall, rss = timed([sys.executable, str(bare), str(model), str(out), scheme, str(workers)])
            rows.append({"scheme": scheme, "tool": f"model_free_ptq max_workers={workers}", "wall_s": wall,
                         "peak_rss": rss, "artifact_bytes": checkpoint_bytes(out)})
            shutil.rmtree(out)
    files = sorted(model.glob("*.safetensors"))
    return {"kind": kind, "experts": experts, "model_bytes": checkpoint_bytes(model), "shards": len(files),
            "largest_shard_bytes": max(f.stat().st_size for f in files), "cores": os.cpu_count(), "rows": rows}


def print_table(r: dict) -> None:
    mib = 2**20
    print(f"{r['kind']}, {r['experts']} experts: {r['model_bytes'] / mib:.0f} MiB of bf16 weights in {r['shards']} "
          f"shard(s), the largest {r['largest_shard_bytes'] / mib:.0f} MiB; {r['cores']} cores")
    print("| scheme | tool | wall s | peak RSS MiB | peak RSS / model | artifact MiB |")
    print("|---|---|---|---|---|---|")
    for row in r["rows"]:
        print(f"| {row['scheme']} | {row['tool']} | {row['wall_s']:.1f} | {row['peak_rss'] / mib:.0f} | "
              f"{row['peak_rss'] / r['model_bytes']:.2f} | {row['artifact_bytes'] / mib:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kind", default="deepseek_v3", choices=("deepseek_v3", "qwen3_moe"))
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--schemes", default="fp8-block,nvfp4-a16,mxfp4")
    parser.add_argument("--work", help="keep the checkpoint here (default: a temporary directory, removed)")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--render", help="print the table of an earlier --json instead of running")
    args = parser.parse_args()
    if args.render:
        print_table(json.loads(Path(args.render).read_text()))
        return
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="quantkit-bench-moe-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        results = run_all(args.kind, args.experts, args.schemes.split(","), work)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    print_table(results)
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
