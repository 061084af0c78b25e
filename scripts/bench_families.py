#!/usr/bin/env python
"""The family x method matrix: every architecture family quantkit has a tiny-model test for, through every method,
each cell the exit code, the consumer's proof and the seconds of the run.

A family is a module of tests/families/ (its `FAMILY` and `build(out)`: a tiny random checkpoint built from
transformers' own config class) or one of the older tiny families of tests/gguf/families.py. Each cell runs
`python -m quantkit quantize MODEL --method M ...` in a fresh process on the tiny calibration set of
tests/families/common.py (the loose gate: random weights; the gate is measured in full), then, where it wrote an
artifact, the proof its consumer owes it (tests/families/common.py):

  compressed-tensors, nf4   transformers reloads it strictly (an MoE artifact it cannot reload: quantkit's strict
                            reading of it, "read strictly")
  gguf                      llama-perplexity loads it and scores finite chunks (scripts/build_llamacpp.sh)
  mlx                       mlx-lm loads it and its logits follow quantkit's reading
  --serve                   fp8 and gptq artifacts: `quantkit serve-check` in vLLM (scripts/setup_engines.sh)

GGUF files equal to llama.cpp's own converter and llama-quantize are checked by the slow tests of each family
module (tests/families/test_*.py), not here. A cell reads `✅ 3.4 s reload` (passed, seconds, proof), `2 refused:
why` (exit 2 before work), `1 error: ...` (a quantkit bug) or `3 gate` (the loose gate failed).

    python scripts/bench_families.py --work /tmp/families --json docs/bench_families.json
    python scripts/bench_families.py --families seed_oss --json docs/bench_families.json --merge  # one row again
    python scripts/bench_families.py --render docs/bench_families.json   # the markdown table docs/models.md shows

Same machine, same settings for every cell (the process's own cores: torch's and quantkit's GGUF kernels' threads).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# column -> quantize flags
METHODS = {
    "fp8": ["--method", "fp8"],
    "fp8-block": ["--method", "fp8", "--scheme", "fp8-block"],
    "fp8-static": ["--method", "fp8", "--scheme", "fp8-static"],
    "gptq": ["--method", "gptq"],
    "awq": ["--method", "awq"],
    "autoround": ["--method", "autoround", "--iters", "2"],
    "smoothquant": ["--method", "smoothquant"],
    "nvfp4": ["--method", "nvfp4"],
    "mxfp4": ["--method", "mxfp4"],
    "nf4": ["--method", "nf4"],
    "gguf Q4_K_M": ["--method", "gguf", "--gguf-type", "Q4_K_M", "--imatrix", "none"],
    "gguf IQ4_XS": ["--method", "gguf", "--gguf-type", "IQ4_XS", "--imatrix", "none"],
    "gguf imatrix": ["--method", "gguf", "--gguf-type", "Q4_K_M", "--imatrix", "auto"],
    "gguf auto-precision": ["--method", "gguf", "--gguf-type", "Q4_K_M", "--imatrix", "auto", "--auto-precision"],
    "mlx": ["--method", "mlx", "--bits", "4"],
}
# the older families of tests/gguf/families.py: name in the matrix -> its builder's family name
OLDER = {"llama": "llama31", "gemma3_text": "gemma3", "phi3": "phi3", "mistral": "mistral", "mixtral": "mixtral",
         "qwen2": "qwen25", "qwen3moe": "qwen3moe"}
# the tokenizer a family's checkpoints ship where it is not the toy byte-level BPE (tests/gguf/families.build_family):
# Phi-3's SentencePiece tokenizer.model
TOKENIZERS = {"phi3": "spm"}


def family_builders() -> dict:
    """{family: build(out) -> Path}: the modules of tests/families/ with a FAMILY, the mixture-of-experts families,
    then the older families."""
    builders = {}
    for path in sorted((ROOT / "tests" / "families").glob("test_*.py")):
        module = importlib.import_module(f"tests.families.{path.stem}")
        if hasattr(module, "FAMILY") and hasattr(module, "build"):
            builders[module.FAMILY] = module.build
    builders.update(moe_builders())
    from tests.gguf.families import build_family

    for name, family in OLDER.items():
        builders.setdefault(name, lambda out, family=family: build_family(family, out, TOKENIZERS.get(family, "bpe")))
    return builders


def moe_builders() -> dict:
    """The MoE families of tests/families/test_moe.py (Qwen2-MoE's among its older ones), Llama 4's text model as
    tests/families/test_llama4.py builds it, and Granite 4's MoE variant as tests/families/test_granite.py does."""
    from tests.families import common, test_granite, test_llama4, test_moe

    names = [*test_moe.FAMILIES, *test_moe.REFUSED, "qwen2_moe"]
    builders = {name: (lambda out, name=name: test_moe.build(out, name)) for name in names}
    builders["llama4_text"] = lambda out: common.build(out, "Llama4TextConfig", test_llama4.ARCH, **test_llama4.SHAPE)
    builders["granitemoehybrid (MoE)"] = lambda out: test_granite.build(out, **test_granite.MOE)
    return builders


def run_cell(model: Path, flags: list[str], out: Path, log: Path, timeout: float) -> dict:
    from tests.families.common import CALIB, LOOSE_GATE

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "quantkit", "quantize", str(model), *flags, *CALIB, *LOOSE_GATE, "-o", str(out),
           "--overwrite", "--quiet"]
    start = time.perf_counter()
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout, cwd=ROOT)
        code, output = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        code, output = 124, f"timed out after {timeout:.0f} s {exc.stderr or ''}"
    seconds = time.perf_counter() - start
    log.write_text(output)
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    return {"exit": code, "seconds": round(seconds, 1), "message": (lines[0][len("error: "):] if lines else "")[:300]}


def prove(column: str, out: Path, work: Path, serve: bool) -> str:
    """The consumer's proof of a written artifact: its name, or 'not checked: why' / 'FAILED: what'."""
    from tests.families import common

    try:
        if column.startswith("gguf"):
            common.assert_llama_perplexity_runs(next(out.glob("*.gguf")), work)
            return "llama.cpp"
        if column == "mlx":
            common.assert_mlx_lm_reads_as_quantkit(out)
            return "mlx-lm"
        if experts_read(out):  # an MoE artifact transformers' reload may not take: quantkit's strict reading
            return "read strictly"
        common.assert_strict_reload(out)
        if serve and column in ("fp8", "gptq"):
            from typer.testing import CliRunner

            from quantkit.cli.app import app

            def cli(*args):
                return CliRunner().invoke(app, [str(a) for a in args], catch_exceptions=False)

            common.assert_serves_as_read(cli, out, work, "vllm")
            return "reload, vLLM"
        return "reload"
    except AssertionError as exc:
        return f"FAILED: {failure_text(exc)}"
    except BaseException as exc:  # pytest.skip raises an exception of its own
        if type(exc).__name__ == "Skipped":
            return f"not checked: {exc}"
        if isinstance(exc, Exception):  # the consumer's own failure: the cell says so, the matrix goes on
            return f"FAILED: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
        raise


def experts_read(out: Path) -> bool:
    """Whether `out` is an MoE compressed-tensors artifact transformers does not reload strictly and the gate's own
    reading (quantkit.eval.experts, which refuses a missing, unexpected or misshapen tensor) opens it."""
    from quantkit.eval import experts
    from quantkit.formats.gate import artifact_reading
    from tests.families import common

    if not experts.reads(out):
        return False
    try:
        common.assert_strict_reload(out)
        return False
    except Exception:  # noqa: BLE001  keys left over, or its loading fails (fp8-block experts, ERNIE's tied FP4 head)
        artifact_reading(out).open()
        return True


def failure_text(exc: AssertionError) -> str:
    """A failed proof in one line: the command's `error:` line where the assertion carries its output, else the
    assertion's first line."""
    lines = str(exc).splitlines()
    errors = [line.removeprefix("error: ") for line in lines if line.startswith("error:")]
    return (errors or lines or [type(exc).__name__])[0][:200]


def cell_text(cell: dict, reasons: dict[str, int] | None = None) -> str:
    """A cell: `✅ seconds proof`, `2 refused: why` (with `reasons`: `2 refused [n]`, the why numbered in it, each
    distinct why once), `3 gate`, or `1 error: what`."""
    if cell["exit"] == 0:
        return f"✅ {cell['seconds']:.1f} s {cell['proof']}"
    if cell["exit"] == 2:
        if reasons is None:
            return f"2 refused: {cell['message']}"
        return f"2 refused [{reasons.setdefault(cell['message'], len(reasons) + 1)}]"
    if cell["exit"] == 3:
        return "3 gate"
    return f"{cell['exit']} error: {cell['message']}"


def render(result: dict) -> list[str]:
    """The markdown matrix, then each refusal's reason once, numbered as its cells cite it."""
    columns, reasons = list(result["methods"]), {}
    lines = ["| family | " + " | ".join(f"`{c}`" for c in columns) + " |", "|---" * (len(columns) + 1) + "|"]
    for family, cells in result["families"].items():
        row = " | ".join(cell_text(cells[c], reasons) if c in cells else "—" for c in columns)
        lines.append(f"| `{family}` | {row} |")
    if reasons:
        lines += ["", "Refusals (exit 2 before work):", ""]
        lines += [f"- [{number}] {message}" for message, number in reasons.items()]
    return lines


BEGIN = "<!-- measured: family-matrix (python scripts/bench_families.py --render docs/bench_families.json --page docs/models.md) -->"
END = "<!-- end measured -->"


def measured_block(text: str) -> list[str]:
    """The lines of a page between BEGIN and END (the matrix as last rendered there)."""
    lines = text.splitlines()
    return lines[lines.index(BEGIN) + 1:lines.index(END)]


def with_block(text: str, table: list[str]) -> str:
    """`text` with the lines between BEGIN and END replaced by `table`."""
    lines = text.splitlines()
    return "\n".join(lines[:lines.index(BEGIN) + 1] + table + lines[lines.index(END):]) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", help="comma-separated (default: all)")
    ap.add_argument("--methods", help="comma-separated columns (default: all): " + ", ".join(METHODS))
    ap.add_argument("--serve", action="store_true", help="serve-check fp8 and gptq artifacts in vLLM")
    ap.add_argument("--work", type=Path, default=Path("/tmp/quantkit-bench-families"))
    ap.add_argument("--json", type=Path)
    ap.add_argument("--merge", action="store_true",
                    help="keep the other families' rows of an existing --json file (run a few families again)")
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--render", type=Path, help="print the markdown table of a saved JSON and exit")
    ap.add_argument("--page", type=Path, help="with --render: write the table into this page's measured block")
    args = ap.parse_args()
    if args.render:
        table = render(json.loads(args.render.read_text()))
        if args.page:
            args.page.write_text(with_block(args.page.read_text(), table))
        else:
            print("\n".join(table))
        return 0
    builders = family_builders()
    families = args.families.split(",") if args.families else list(builders)
    methods = args.methods.split(",") if args.methods else list(METHODS)
    result = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs", "date": time.strftime("%Y-%m-%d"),
              "methods": methods, "families": {}}
    if args.merge and args.json and args.json.exists():  # the saved rows and columns kept, these cells run again
        saved = json.loads(args.json.read_text())
        result["families"] = saved["families"]
        result["methods"] = list(dict.fromkeys([*saved["methods"], *methods]))
    for family in families:
        model = builders[family](args.work / family / "model")
        cells = result["families"].setdefault(family, {})
        for column in methods:
            out = args.work / family / column.replace(" ", "-")
            cells[column] = cell = run_cell(model, METHODS[column], out, out.with_suffix(".log"), args.timeout)
            if cell["exit"] == 0:
                cell["proof"] = prove(column, out, args.work / family, args.serve)
            print(f"{family:>18} {column:>20}: {cell_text(cell)}", file=sys.stderr, flush=True)
        if args.json:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
    print("\n".join(render(result)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
