"""The serving plan: KV cache and weight sizes, which runtime serves a format on a device, and the
verdicts `quantkit plan` and the model cards print."""

from __future__ import annotations

import json

import pytest

from quantkit.methods import get_method, runtimes_for
from quantkit.run.serving import (
    DEVICES,
    GB,
    KV_SHARE,
    OVERHEAD,
    device,
    fit,
    kv_bytes_per_token,
    runtime_for,
)


def test_kv_cache_per_token_counts_k_and_v_of_every_layer():
    config = {"num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2, "hidden_size": 896}
    assert kv_bytes_per_token(config) == 2 * 24 * 2 * 64 * 2  # head_dim from hidden / heads
    assert kv_bytes_per_token({**config, "head_dim": 128}, "fp8") == 2 * 24 * 2 * 128
    assert kv_bytes_per_token({"text_config": config}) == kv_bytes_per_token(config)  # a VLM's language model


@pytest.mark.parametrize("method, name, expected", [
    ("fp8", "H100", "vLLM: FP8 W8A8 (CUTLASS)"),
    ("fp8", "A100-80G", "vLLM: FP8 Marlin, weights only"),
    ("fp8", "T4", None),
    ("fp8", "M3-Max-64G", None),
    ("gptq", "H100", "vLLM: Machete WNA16"),
    ("gptq", "T4", "vLLM: Marlin WNA16"),
    ("awq", "V100-32G", None),
    ("smoothquant", "cpu-64G", "vLLM CPU backend: INT8 W8A8"),
    ("nf4", "V100-32G", "vLLM: bitsandbytes"),
    ("nf4", "M2-16G", "transformers + bitsandbytes"),
    ("gguf", "M3-Max-64G", "llama.cpp / Ollama: Metal"),
    ("gguf", "cpu", "llama.cpp / Ollama: CPU"),
])
def test_the_runtime_follows_the_kernels_compute_capability(method, name, expected):
    runtime = runtime_for(get_method(method), device(name, 8 * GB))
    assert (runtime.name if runtime else None) == expected


def test_verdicts():
    runtimes = runtimes_for(get_method("gptq"), get_method("gptq").options())
    l4 = DEVICES["L4"]  # 24 GB x 0.90 usable, compute capability 8.9
    small = fit(4 * GB, 100_000, 4096, runtimes, l4)
    assert small.verdict == "fits" and small.runtime == "vLLM: Marlin WNA16"
    assert small.needs == small.weights + small.kv and small.weights == int(4 * GB * (1 + OVERHEAD))
    assert small.kv_tokens == int((l4.usable_bytes - small.weights) / (100_000 * (1 + OVERHEAD)))
    tight = fit(15 * GB, 100_000, 4096, runtimes, l4)  # the weights leave under 40% to the KV cache
    assert tight.kv_room < KV_SHARE and tight.verdict == "tight"
    assert fit(15 * GB, 2_000_000, 8192, runtimes, l4).verdict == "too small"
    fp8 = get_method("fp8")
    assert fit(1 * GB, 1, 1, runtimes_for(fp8, fp8.options()), DEVICES["M3-Max-64G"]).verdict == "no runtime"


def test_unknown_device_is_bad_input(cli, micro_model):
    result = cli("plan", micro_model, "--gpu", "H800")
    assert result.exit_code == 2 and "unknown device 'H800'" in result.stderr and "RTX4090" in result.stderr


def test_plan_json_sizes_every_format(cli, micro_model, tmp_path):
    """Weights by the precision plan; the gguf row by the exact per-tensor mixture, so it matches the
    written file's tensor data."""
    result = cli("plan", micro_model, "--gpu", "T4", "--gpu", "cpu-2G", "--context", "2048", "--batch", "2",
                 "--kv-cache", "fp8", "--json", "-")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    rows = {row["method"]: row for row in data["formats"]}
    from quantkit.methods import METHODS

    assert list(rows) == ["source", *METHODS]
    assert data["kv_bytes_per_token"] == kv_bytes_per_token(json.loads((micro_model / "config.json").read_text()), "fp8")
    assert rows["gptq"]["weights_bytes"] < rows["fp8"]["weights_bytes"] < rows["source"]["weights_bytes"]
    t4 = {row: rows[row]["devices"][0] for row in rows}
    assert t4["fp8"]["verdict"] == "no runtime" and t4["gptq"]["runtime"] == "vLLM: Marlin WNA16"
    assert all(row["devices"][1]["device"] == "cpu-2G" for row in rows.values())
    out = tmp_path / "gguf"
    assert cli("quantize", micro_model, "--method", "gguf", "--imatrix", "none", "--eval-windows", "0",
               "-o", out).exit_code == 0
    from gguf import GGUFReader

    (written,) = out.glob("*.gguf")
    tensor_bytes = sum(int(t.n_bytes) for t in GGUFReader(written).tensors)
    assert abs(rows["gguf"]["weights_bytes"] - tensor_bytes) <= 0.01 * tensor_bytes
    card = (out / "README.md").read_text()
    assert "## Serving" in card and f"`llama-server -m {written.name}" in card
    serving = json.loads((out / "quantkit.json").read_text())["targets"][0]["details"]["serving"]
    assert serving["devices"]["M3-Max-64G"] == {"verdict": "fits", "runtime": "llama.cpp / Ollama: Metal"}


def test_plan_prints_a_table_and_the_serve_commands(cli, micro_model):
    result = cli("plan", micro_model, "--method", "gptq", "--method", "gguf")
    assert result.exit_code == 0, result.output
    assert "serving plan" in result.stdout and "vllm serve OUT" in result.stdout and "llama-server" in result.stdout
    assert "vLLM docs" in result.stdout  # the sources of the figures


def test_vllm_cpu_serves_no_quantized_experts(cli, micro_model, tmp_path):
    """vLLM's CPU kernels have no fused-MoE path for quantized experts: the plan of an MoE model marks its
    compressed-tensors artifacts so on a CPU (and says why), as it serves them on a GPU; a dense model's are served
    there (fp8 dynamic by torch's scaled_mm, int4 weights by CPUWNA16, int8 W8A8)."""
    from quantkit.run.serving import EXPERTS_REFUSED
    from tests.families import test_moe

    moe = test_moe.build(tmp_path / "qwen3_moe", "qwen3_moe")
    methods = ["fp8", "gptq", "smoothquant", "gguf"]

    def cells(model) -> dict[str, dict]:
        result = cli("plan", model, "--gpu", "L4", "--gpu", "cpu-64G", *(a for m in methods for a in ("-m", m)),
                     "--json", "-")
        assert result.exit_code == 0, result.output
        return {row["method"]: row["devices"] for row in json.loads(result.stdout)["formats"]}

    dense, experts = cells(micro_model), cells(moe)
    assert [dense[m][1]["runtime"] for m in methods] == [
        "vLLM CPU backend: FP8 W8A8 dynamic (torch scaled_mm)", "vLLM CPU backend: WNA16",
        "vLLM CPU backend: INT8 W8A8", "llama.cpp / Ollama: CPU"]
    for method in ("fp8", "gptq", "smoothquant"):
        l4, cpu = experts[method]
        assert l4["runtime"].startswith("vLLM: ") and l4["refused"] == ""
        assert cpu["verdict"] == "no runtime" and cpu["refused"] == EXPERTS_REFUSED
    assert experts["gguf"][1]["runtime"] == "llama.cpp / Ollama: CPU"
    printed = cli("plan", moe, "--gpu", "cpu-64G", "-m", "gptq")
    assert EXPERTS_REFUSED in printed.stdout
