"""Record what mlx_lm.server answers serve-check on the micro toy model, for tests/serve/test_recorded.py:
`python -m tests.serve.record_engine_response [OUT]` (default tests/data/serve/mlx_micro_mlx4.json).

The micro preset (quantkit.toy, the test suite's micro_model) is built and quantized with `quantkit quantize
--method mlx --bits 4`; mlx_lm.server (the mlx engine quantkit finds) serves the artifact, then the base, and is
asked what serve-check asks (quantkit.serve.check.engine_side with base_from "engine"): every next-token
prediction's top candidates on two held-out windows, greedy continuations of two prompts, one load round. The
JSON holds those answers as the engine gave them (candidates as [id, log-prob] pairs per position, [] where a
position was not scored) and the windows asked about; nothing computed from them."""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "data" / "serve" / "mlx_micro_mlx4.json"
WINDOWS, SEQ_LEN, SEED = 2, 24, 0
GENERATION = {"prompts": 2, "steps": 8, "load_steps": 8, "concurrencies": [1]}


def rows(topk) -> list[list[list]]:
    """Each position's candidates as the engine gave them: [[id, log-prob], ...] ([] where not scored)."""
    return [[[int(i), float(lp)] for i, lp in zip(ids, lps) if i >= 0] for ids, lps in zip(topk.ids, topk.logprobs)]


def held_out(model: Path):
    from quantkit.engines.transformers import load_tokenizer
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.run.calibration import make_windows
    from quantkit.run.recipe import Calibration

    tokenizer = load_tokenizer(check_model_dir(model), False)
    spec = Calibration(num_samples=0, seq_len=SEQ_LEN, eval_windows=WINDOWS, seed=SEED)
    return tokenizer, make_windows(tokenizer, spec).eval.numpy()


def record(root: Path) -> dict:
    from typer.testing import CliRunner

    from quantkit.cli.app import app
    from quantkit.serve import check
    from quantkit.toy import make_toy_model

    base = make_toy_model(root / "micro", "micro")
    artifact = root / "mlx4"
    result = CliRunner().invoke(app, ["quantize", str(base), "--method", "mlx", "--bits", "4", "-o", str(artifact),
                                      "--eval-windows", "0"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    tokenizer, windows = held_out(base)
    generation = check.Generation(GENERATION["prompts"], GENERATION["steps"], GENERATION["load_steps"],
                                  tuple(GENERATION["concurrencies"]))
    setup = check.plan(artifact, base, windows, "mlx", None, generation, "engine", None, "cpu", False)
    theirs = check.engine_side(setup, tokenizer, len(tokenizer), None, lambda m: print(m, file=sys.stderr))
    return {"recorded_with": "python -m tests.serve.record_engine_response", "engine": "mlx",
            "model": "quantkit.toy micro preset, seed 0", "artifact": "quantkit quantize --method mlx --bits 4",
            "windows": windows.tolist(), "generation": GENERATION, "version": theirs.version,
            "artifact_topk": rows(theirs.topk), "base_topk": rows(theirs.base_topk), "greedy": theirs.greedy,
            "load": [r.as_dict() for r in theirs.load]}


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else OUT
    with tempfile.TemporaryDirectory(prefix="quantkit-record-") as tmp:
        data = record(Path(tmp))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data) + "\n")
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
