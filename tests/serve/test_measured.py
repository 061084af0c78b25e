"""The measured format x engine table: docs/serving.md shows it as the code renders it, its expected rows say
what the methods' runtime tables say, and `quantkit plan` prints it for the formats it plans."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantkit.methods import autoround, awq, fp8, gguf, gptq, mlx, mxfp4, nf4, nvfp4, smoothquant
from quantkit.serve import measured

DOCS = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
TABLE_HEADER = "| format | quantize flags | engine |"
# EXPECTED key -> (the runtime table it states, the device kind, the runtimes' name prefix)
RUNTIME_TABLES = {
    "fp8": (fp8.RUNTIMES, "cuda", "vLLM"),
    "fp8-block": (fp8.BLOCK_RUNTIMES, "cuda", "vLLM"),
    "gptq": (gptq.RUNTIMES, "cuda", "vLLM"),
    "smoothquant": (smoothquant.RUNTIMES, "cuda", "vLLM"),
    "nvfp4": (nvfp4.RUNTIMES, "cuda", "vLLM"),
    "nvfp4-a16": (nvfp4.runtimes(nvfp4.Options(scheme="a16")), "cuda", "vLLM"),
    "mxfp4": (mxfp4.RUNTIMES, "cuda", "vLLM"),
    "nf4": (nf4.RUNTIMES, "cuda", "vLLM"),
    "gguf-cuda": (gguf.RUNTIMES, "cuda", "llama.cpp"),
    "gguf-apple": (gguf.RUNTIMES, "apple", "llama.cpp"),
    "mlx-apple": (mlx.RUNTIMES, "apple", "mlx-lm"),
}


def docs_table(header: str) -> list[str]:
    """docs/serving.md's table lines from the one starting with `header` to the first non-table line."""
    section = header + DOCS.read_text().split(header, 1)[1]
    table = []
    for line in section.splitlines():
        if not line.startswith("|"):
            break
        table.append(line)
    return table


def test_docs_table_is_the_rendered_one():
    """docs/serving.md's measured table equals measured.markdown_table() (print it to update the page)."""
    assert docs_table(TABLE_HEADER) == measured.markdown_table()


@pytest.mark.parametrize("key", sorted(RUNTIME_TABLES))
def test_expected_rows_say_what_the_runtime_tables_say(key):
    runtimes, kind, prefix = RUNTIME_TABLES[key]
    assert measured.EXPECTED[key] == measured.expected_text([r for r in runtimes if r.name.startswith(prefix)], kind)


def test_awq_and_autoround_run_on_gptqs_runtimes():
    assert awq.METHOD.runtimes == autoround.METHOD.runtimes == gptq.RUNTIMES


def test_each_record_is_complete_and_unique():
    keys = [(r.format, r.engine, r.device, r.model) for r in measured.MEASURED]
    assert len(keys) == len(set(keys))
    for r in measured.MEASURED:
        assert r.outcome in ("serves", "refused", "not measured") and r.date == measured.DATE
        if r.outcome == "not measured":
            assert r.expected and r.reading_kld is None and not r.command
        else:
            assert r.command and r.model and r.device == measured.CPU
        assert (r.reading_kld is not None) == (r.outcome == "serves")


def test_the_gpu_rows_the_cpu_could_not_measure():
    gpu = {r.format for r in measured.MEASURED if r.device == measured.GPU and r.engine == measured.VLLM_GPU}
    assert {"fp8", "fp8-kv", "fp8-block", "gptq", "awq", "autoround-light", "nvfp4", "mxfp4"} <= gpu
    assert all(r.result == measured.NO_GPU for r in measured.MEASURED if r.device == measured.GPU)


def test_summary_names_engines_refusals_and_what_was_not_measured():
    line = measured.summary("fp8")
    assert line.startswith(f"loads in: {measured.VLLM} on {measured.CPU} (fp8, fp8-kv")
    assert f"refused by: {measured.VLLM} on {measured.CPU} (fp8-static" in line
    assert f"not measured: {measured.VLLM_GPU} on {measured.GPU} (fp8" in line
    assert measured.summary("no-such-method") == "no engine measured"


def test_plan_prints_and_writes_what_was_measured(cli, micro_model, tmp_path):
    out = tmp_path / "plan.json"
    result = cli("plan", micro_model, "--method", "nvfp4", "--method", "gguf", "--json", out)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    start = lines.index("Measured in the engines (serve-check; docs/serving.md):")
    assert lines[start + 1] == f"  nvfp4: {measured.summary('nvfp4')}"
    assert lines[start + 2] == f"  gguf: {measured.summary('gguf')}"
    assert "refused by" in lines[start + 1] and lines[start + 2].startswith(f"  gguf: loads in: {measured.LLAMA}")
    formats = {row["method"]: row for row in json.loads(out.read_text())["formats"]}
    assert "measured" not in formats["source"]
    assert formats["gguf"]["measured_summary"] == measured.summary("gguf")
    assert [r["format"] for r in formats["nvfp4"]["measured"]] == [r.format for r in measured.for_method("nvfp4")]
    assert all(r["outcome"] in ("serves", "refused", "not measured") for r in formats["gguf"]["measured"])
