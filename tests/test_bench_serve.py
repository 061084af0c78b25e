"""scripts/bench_serve.py: its table from serve-check's numbers, and (slow) a run on a small trained model in
vLLM and llama-server, after which no server is left."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from quantkit.serve import engines, llama_server, vllm_server
from tests.util import REPO, subprocess_env

SCRIPT = REPO / "scripts" / "bench_serve.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_serve", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script is executed
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def serve_result(failed: list[str] | None = None) -> dict:
    """A serve-check --json result with the fields the table reads."""
    agreement = {"positions": 10, "kld_lower_bound": 0.001, "kld_lower_bound_p99": 0.01, "tail_mass": 0.25,
                 "top1": 0.9}
    load = [{"concurrency": c, "requests": c, "prompt_tokens": 64, "tokens": 8, "ttft_s": 0.1 * c,
             "prefill_tok_s": 640.0 / c, "decode_tok_s": 50.0, "throughput_tok_s": 50.0 * c} for c in (1, 8)]
    return {"engine": {"name": "vllm", "version": "0.32.0", "device": "x (cpu)"}, "logprobs": 20,
            "logprobs_normalized": True, "windows": {"scored": 10}, "vs_base": agreement,
            "vs_reading": {**agreement, "kld_lower_bound": 0.0002}, "reading_vs_base_kld": 0.002,
            "ppl": {"ppl": 12.5, "ppl_exact": True, "targets_outside": 0}, "ppl_reading": 12.4, "ppl_base": 12.0,
            "greedy": {"identical_share": 0.75}, "load": load, "failed": failed or [],
            "checks": [{"name": "reading_kld", "value": 0.0002}]}


def test_every_format_names_its_engine_once(bench):
    assert len(set(bench.FORMAT_NAMES)) == len(bench.FORMATS)
    assert {f.engine for f in bench.FORMATS} == set(engines.ENGINES)


def test_verdict_in_words(bench):
    refused = "warning: x\nerror: vLLM's CPU build refuses NVFP4 (vLLM: no kernel)\nhint: elsewhere\n"
    assert bench.verdict(0, serve_result(), "") == "passes"
    assert bench.verdict(3, serve_result(["reading_kld"]), "") == "fails: reading_kld"
    assert bench.verdict(2, None, refused) == "refused: vLLM's CPU build refuses NVFP4 (vLLM: no kernel)"
    assert bench.verdict(1, None, "error: internal error: boom\n").startswith("error (exit 1): internal error")


def test_the_table_shows_both_readings_and_the_load_test(bench):
    served = {"format": "fp8", "engine": "vllm", "gate": {"kld_mean": 0.0021, "ppl": 12.3},
              "serve": bench.serve_numbers(serve_result()), "verdict": "passes"}
    refused = {"format": "nvfp4", "engine": "vllm", "gate": {"kld_mean": 0.05, "ppl": 14.0}, "serve": None,
               "verdict": "refused: no kernel"}
    text = bench.render({"settings": {"concurrency": "1,8", "logprobs": 20}, "rows": [served, refused]})
    header, rule, fp8, nvfp4 = text.splitlines()
    assert "k=20" in header and "c=8: TTFT s" in header and rule.count("---") == header.count("|") - 1
    assert fp8.split(" | ")[2:8] == ["0.0021", "0.001 (tail 0.25)", "0.0002", "0.900", "12.30 / 12.50", "0.75"]
    assert "0.100 · 640/50" in fp8 and "0.800 · 80/50" in fp8 and fp8.endswith("| passes |")
    assert nvfp4.endswith("| refused: no kernel |") and nvfp4.count("–") == 7


def test_a_run_with_a_left_over_server_is_not_ok(bench):
    row = {"verdict": "passes", "leftover_processes": []}
    assert bench.row_ok(row) and bench.row_ok({**row, "verdict": "refused: no kernel"})
    assert not bench.row_ok({**row, "leftover_processes": ["llama-server -m x.gguf"]})
    assert bench.row_ok({**row, "verdict": "quantkit refused (exit 2): fp8 can tile no layer of this model"})
    assert not bench.row_ok({**row, "verdict": "fails: reading_kld"})
    assert not bench.row_ok({**row, "verdict": "quantize failed (exit 1): internal error"})


def test_records_for_the_measured_table(bench):
    """--records turns a run into quantkit.serve.measured's records: the engine's own reason for a refusal,
    nothing for a format quantkit refused for this model, and no record from a run that did not finish."""
    served = {"format": "fp8", "engine": "vllm", "flags": ["--method", "fp8"], "verdict": "passes",
              "serve": bench.serve_numbers(serve_result())}
    refused = {"format": "nf4", "engine": "vllm", "flags": ["--method", "nf4"], "serve": None,
               "verdict": "refused: vLLM serves bitsandbytes on NVIDIA GPUs", "engine_says": "Unknown method"}
    tiled = {"format": "fp8-block", "engine": "vllm", "flags": ["--method", "fp8", "--scheme", "fp8-block"],
             "verdict": "quantkit refused (exit 2): fp8 can tile no layer of this model"}
    assert bench.records({"rows": [served, refused, tiled]}).splitlines() == [
        "    bench('fp8', 'fp8', '--method fp8', VLLM, 'serves', 0.0002),",
        "    bench('nf4', 'nf4', '--method nf4', VLLM, 'refused: Unknown method'),"]
    with pytest.raises(SystemExit, match="fix the rule"):
        bench.records({"rows": [{**refused, "engine_says": "serves"}]})
    with pytest.raises(SystemExit, match="not a measured result"):
        bench.records({"rows": [{**served, "verdict": "fails: reading_kld"}]})


def test_the_engines_reason_in_one_sentence(bench):
    said = ("vllm exited before it was ready (exit code 1): ValueError: Failed to find a kernel that can implement "
            "the NVFP4 linear layer. Reasons: CutlassNvFp4 requires CUDA.")
    assert bench.engine_reason(said) == "ValueError: Failed to find a kernel that can implement the NVFP4 linear layer"
    assert bench.engine_reason("no kernel") == "no kernel"
    failed = ("vllm failed while serving (POST http://127.0.0.1:1/v1/completions: HTTP 500: EngineCore encountered an "
              "issue. See stack trace (above) for the root cause.): RuntimeError: narrow() cannot be applied to a "
              "0-dim tensor.")
    assert bench.engine_reason(failed) == "RuntimeError: narrow() cannot be applied to a 0-dim tensor"


def test_unknown_formats_are_refused(bench):
    with pytest.raises(SystemExit):
        bench.parse_args(["--formats", "fp8,int3"])


@pytest.mark.slow
def test_bench_serve_on_a_small_model(bench, tmp_path):
    """fp8 in vLLM and Q8_0 in llama-server: both served as gated, the table printed, nothing left running."""
    for finder, name, variable in ((vllm_server.find, "vLLM", "QUANTKIT_VLLM"),
                                   (llama_server.find, "llama-server", "QUANTKIT_LLAMA_CPP")):
        if finder() is None:
            pytest.skip(f"{name} is not installed: scripts/setup_engines.sh (or set QUANTKIT_ENGINES / {variable})")
    from quantkit.toy import make_toy_model

    model = make_toy_model(tmp_path / "base", "micro", steps=150)
    work, out = tmp_path / "work", tmp_path / "bench.json"
    cmd = [sys.executable, str(SCRIPT), "--model", str(model), "--work", str(work), "--formats", "fp8,gguf-Q8_0",
           "--num-samples", "16", "--seq-len", "64", "--eval-windows", "2", "--num-windows", "2",
           "--gen-prompts", "2", "--load-tokens", "8", "--concurrency", "1,2", "--json", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=subprocess_env(), timeout=1800)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "| format | engine | gate KLD |" in done.stdout and "c=2: TTFT s" in done.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [(r["format"], r["engine"], r["verdict"]) for r in rows] == [
        ("fp8", "vllm", "passes"), ("gguf-Q8_0", "llama.cpp", "passes")]
    for row in rows:
        assert row["serve"]["kld_vs_reading"] < 0.01 and row["gate"]["kld_mean"] >= 0
        assert set(row["serve"]["load"]) == {"1", "2"} and row["leftover_processes"] == []
    assert bench.live_processes_naming(str((work / "artifacts").resolve())) == {}


@pytest.mark.parametrize("reference", ["bench_serve_reference.json", "bench_serve_mlx_reference.json"])
def test_the_measured_table_is_the_reference_runs(bench, reference):
    """quantkit.serve.measured's rows are what the benchmark runs kept in docs/ say: each format's result as
    scripts/bench_serve.py reads it, and where it served, its reading KLD to two significant figures."""
    from quantkit.serve import measured

    run = json.loads((REPO / "docs" / reference).read_text())
    rows = {r.format: r for r in measured.BENCH_ROWS}
    compared = 0
    for row in run["rows"]:
        result = bench.record_result(row)
        if result is None:  # quantkit refused the format for that model: its row comes from another model
            assert rows[row["format"]].model != measured.REFERENCE
            continue
        record = rows[row["format"]]
        kld = row["serve"]["kld_vs_reading"] if result == "serves" else None
        assert record.flags == " ".join(row["flags"]), row["format"]
        # the engine's reason as the run recorded it; the table may add where it failed, in parentheses
        assert record.result == result or record.result.startswith(result + " ("), row["format"]
        assert record.reading_kld == (None if kld is None else float(f"{kld:.2g}")), row["format"]
        compared += 1
    assert compared == len(run["rows"]) - sum(bench.record_result(r) is None for r in run["rows"]) > 0
