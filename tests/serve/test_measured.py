"""The measured format x engine table: docs/serving.md shows it as the code renders it, its expected rows say
what vLLM, llama.cpp and mlx-lm name for each format, and `quantkit plan` prints it for the formats it plans."""

from __future__ import annotations

import json
from pathlib import Path


from quantkit.methods import autoround, awq, gptq, runtimes_for
from quantkit.serve import measured

DOCS = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
TABLE_HEADER = "| format | quantize flags | engine |"
# What the unmeasured rows must say: the kernels vLLM (0.32: each scheme's get_min_capability), llama.cpp and
# mlx-lm name for each format on each device, written out here rather than derived from quantkit's runtime tables.
EXPECTED_ROWS = {
    "fp8": "vLLM: FP8 W8A8 (CUTLASS), compute capability 8.9+; vLLM: FP8 Marlin, weights only, 8.0+",
    "fp8-block": "vLLM: FP8 block W8A8 (CUTLASS blockwise / Triton), compute capability 8.9+; "
                 "vLLM: FP8 Marlin block, weights only, 8.0+",
    "gptq": "vLLM: Machete WNA16, compute capability 9.0+; vLLM: Marlin WNA16, 7.5+",
    "smoothquant": "vLLM: INT8 W8A8 (CUTLASS), compute capability 7.5+",
    "nvfp4": "vLLM: NVFP4 W4A4 (CUTLASS FP4), compute capability 10.0+; vLLM: Marlin FP4, weights only, 7.5+",
    "nvfp4-a16": "vLLM: Marlin FP4, weights only, compute capability 7.5+",
    "mxfp4": "vLLM: Marlin FP4 (MXFP4), weights only, compute capability 7.5+",
    "nf4": "vLLM: bitsandbytes, compute capability 7.0+",
    "gguf-cuda": "llama.cpp / Ollama: CUDA, compute capability 5.0+",
    "gguf-apple": "llama.cpp / Ollama: Metal",
    "mlx-apple": "mlx-lm: Metal",
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


def test_expected_rows_name_each_formats_kernels():
    assert measured.EXPECTED == EXPECTED_ROWS
    for r in measured.MEASURED:
        if r.outcome == "not measured":
            assert r.expected in EXPECTED_ROWS.values()


def test_awq_and_autoround_run_on_gptqs_runtimes():
    assert (runtimes_for(awq.METHOD, awq.Options()) == runtimes_for(autoround.METHOD, autoround.Options())
            == runtimes_for(gptq.METHOD, gptq.Options()))


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
