"""--kv-cache on quantize and eval: bad input is exit 2 before work naming the rule; a measured type's row, the
chosen type and its serve flags in the report and the model card."""

import json

import pytest

from tests.util import FAST_CALIB, leftovers


@pytest.mark.parametrize("spec, message", [
    ("vllm:turboquant_k3v4_nc", "CPU backend has no turboquant_k3v4_nc"),
    ("vllm:nope", "is not one of"),
    ("q3_k", "unknown KV-cache type"),
    ("mlx:4g48", "mx.quantize takes"),
])
def test_eval_refuses_before_work(cli, micro_model, spec, message):
    result = cli("eval", micro_model, "--against", micro_model, "--kv-cache", spec, "--kv-engine", "vllm-cpu")
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert "baseline:" not in result.stderr  # nothing measured


def test_quantized_v_needs_flash_attention():
    from quantkit.errors import UnsupportedError
    from quantkit.eval import kv

    shape = kv.Shape(head_dim=64, kv_heads=2, layers=2)
    with pytest.raises(UnsupportedError, match="needs flash attention"):
        kv.parse_one("llama.cpp:q8_0/q4_0", shape, flash_attention=False)
    with pytest.raises(UnsupportedError, match="head dimension"):
        kv.parse_one("vllm:turboquant_4bit_nc", kv.Shape(head_dim=96, kv_heads=2, layers=8))
    with pytest.raises(UnsupportedError, match="hybrid"):
        kv.parse_one("vllm:turboquant_4bit_nc", kv.Shape(head_dim=64, kv_heads=2, layers=8, hybrid=True))


def test_quantize_refuses_a_type_its_engine_lacks(cli, micro_model, tmp_path):
    result = cli("quantize", micro_model, "--method", "gguf", "--gguf-type", "Q8_0", "-o", tmp_path / "out",
                 *FAST_CALIB, "--kv-cache", "vllm:fp8")
    assert result.exit_code == 2, result.output
    assert "served by llama.cpp" in result.stderr
    assert leftovers(tmp_path, "out") == []


def test_auto_offers_each_engines_types():
    from quantkit.eval import kv

    shape = kv.Shape(head_dim=64, kv_heads=2, layers=8)
    assert [k.name for k in kv.parse("auto", shape, "vllm", cpu=True)] == ["vllm:fp8", "vllm:fp8_e5m2"]
    names = [k.name for k in kv.parse("auto", shape, "llama.cpp")]
    assert "llama.cpp:q4_0" in names and "llama.cpp:q8_0/q4_0" in names
    assert [k.name for k in kv.parse("auto", shape, "mlx")] == [f"mlx:{b}" for b in (2, 3, 4, 5, 6, 8)]


@pytest.mark.slow
def test_eval_measures_types_and_chooses_the_smallest(cli, micro_model, tmp_path):
    out = tmp_path / "m.json"
    result = cli("eval", micro_model, "--against", micro_model, "--num-windows", "2", "--seq-len", "128",
                 "--kv-cache", "mlx:8,mlx:4", "--json", out)
    assert result.exit_code == 0, result.output
    assert "KV cache of" in result.stdout
    section = json.loads(out.read_text())["kv_cache"]
    rows = {r["type"]: r for r in section["types"]}
    assert rows["mlx:4"]["bytes_per_token"] < rows["mlx:8"]["bytes_per_token"]
    assert 0 < rows["mlx:8"]["own"]["kld_mean"] < rows["mlx:4"]["own"]["kld_mean"]
    assert rows["mlx:8"]["total"]["kld_mean"] == pytest.approx(rows["mlx:8"]["own"]["kld_mean"], rel=0.05)
    assert section["chosen"] == "mlx:4" and section["serve_flags"] == ["--kv-bits", "4"]
    assert "the artifact with a 16-bit cache on" not in result.stderr  # the gate's reading of it, kept


def test_serve_command_carries_the_chosen_flags():
    from quantkit.formats import gguf, mlx
    from quantkit.run.serving import with_kv_flags

    assert with_kv_flags(gguf.serve_command("m.gguf"), ["-ctk", "q8_0", "-ctv", "q4_0", "-fa", "on"]).startswith(
        "llama-server -m m.gguf -ctk q8_0 -ctv q4_0 -fa on (or: ollama")
    assert with_kv_flags(mlx.serve_command("."), ["--kv-bits", "4"]).endswith("mlx_lm.server --model . --kv-bits 4)")
    assert with_kv_flags("vllm serve .", ["--kv-cache-dtype", "fp8"]) == "vllm serve . --kv-cache-dtype fp8"
    assert with_kv_flags("vllm serve . --kv-cache-dtype fp8", ["--kv-cache-dtype", "fp8_e5m2"]).count("fp8") == 1


def test_plan_takes_a_kv_type_and_a_measured_report(cli, micro_model, tmp_path):
    report = tmp_path / "m.json"
    section = {"chosen": "mlx:4", "types": [
        {"type": t, "passed": ok, "bytes_per_token": b, "serve_flags": ["--kv-bits", t[-1]], "total": {"kld_mean": k}}
        for t, ok, b, k in (("mlx:8", True, 1000, 1e-4), ("mlx:4", True, 600, 1e-3), ("mlx:2", False, 400, 0.1))]}
    report.write_text(json.dumps({"name": "m", "kv_cache": section}))
    out = tmp_path / "plan.json"
    result = cli("plan", micro_model, "--gpu", "L4", "--method", "mlx", "--kv-report", report, "--batch", "2",
                 "--json", out)
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["measured_kv"][0]["types"]
    assert [r["type"] for r in rows] == ["mlx:8", "mlx:4"]  # the failing type is not planned
    assert rows[1]["max_context"]["L4"] > rows[0]["max_context"]["L4"] > 0
    typed = cli("plan", micro_model, "--gpu", "L4", "--kv-cache", "llama.cpp:q4_0", "--json", out)
    assert typed.exit_code == 0, typed.output
    assert json.loads(out.read_text())["kv_bytes_per_token"] == 2 * 2 * 2 * 64 * 18 // 32  # K+V, 2 layers, 2 heads
    assert cli("plan", micro_model, "--kv-cache", "bogus").exit_code == 2


def test_quantize_routes_kv_cache_values():
    """--kv-cache fp8 stays the method option (calibrated scales); any other value is the gate's measurement."""
    from quantkit.cli.quantize import kv_cache_flags
    from quantkit.errors import InputError
    from quantkit.run.recipe import Gate, MethodOptions

    options, gate = kv_cache_flags(MethodOptions(kv_cache="fp8"), None)
    assert options.kv_cache == "fp8" and gate == {}
    options, gate = kv_cache_flags(MethodOptions(kv_cache="auto"), "vllm")
    assert options.kv_cache is None and gate == {"kv_cache": "auto", "kv_engine": "vllm"}
    assert Gate(**gate).kv_cache == "auto"
    with pytest.raises(InputError, match="--kv-engine"):
        kv_cache_flags(MethodOptions(), "vllm")
    options, gate = kv_cache_flags(MethodOptions(kv_cache="mlx:4"), None, 256)
    assert gate == {"kv_cache": "mlx:4", "kv_engine": None, "kv_context": 256} and Gate(**gate).kv_context == 256
    with pytest.raises(InputError, match="--kv-context"):
        kv_cache_flags(MethodOptions(), None, 256)
    with pytest.raises(ValueError, match="kv_context"):
        Gate(kv_context=256)


def test_quantize_kv_context_refused_before_work(cli, micro_model, tmp_path):
    """--kv-context without --kv-cache types, and windows longer than the text holds: exit 2, nothing written."""
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "fp8", "-o", out, *FAST_CALIB, "--kv-context", "256")
    assert result.exit_code == 2 and "--kv-context" in result.stderr, result.output
    result = cli("quantize", micro_model, "--method", "fp8", "-o", out, *FAST_CALIB, "--kv-cache", "mlx:4",
                 "--kv-context", "100000000")
    assert result.exit_code == 2, result.output
    assert "baseline" not in result.stderr and leftovers(tmp_path, "out") == []


def test_quantize_measures_kv_types_at_kv_context(cli, micro_model, tmp_path):
    """The KV-cache types measured on windows of --kv-context tokens (the base scored again on them), the gate's
    own reading on its seq_len windows."""
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "gguf", "--gguf-type", "Q8_0", "-o", out, *FAST_CALIB,
                 "--kv-cache", "llama.cpp:q4_0", "--kv-context", "128")
    assert result.exit_code == 0, result.output
    report = json.loads((out / "quantkit.json").read_text())
    (target,) = report["targets"]
    section = target["details"]["kv_cache_types"]
    assert section["context"] == 128 and report["recipe"]["gate"]["kv_context"] == 128
    (row,) = section["types"]
    assert row["type"] == "llama.cpp:q4_0" and row["own"]["kld_mean"] > 0
    assert "windows of 128 tokens" in result.stderr
    assert "the artifact with a 16-bit cache on" in result.stderr  # not the gate's windows: scored for the types


def test_quantize_compares_the_types_with_the_gates_own_reading(cli, micro_model, tmp_path):
    """On the gate's windows the types are compared with the artifact's reading the gate kept as it measured it:
    no forward of its own for a 16-bit cache; the type's own damage is measured against it."""
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "gguf", "--gguf-type", "Q8_0", "-o", out, *FAST_CALIB,
                 "--kv-cache", "llama.cpp:q4_0")
    assert result.exit_code == 0, result.output
    (row,) = json.loads((out / "quantkit.json").read_text())["targets"][0]["details"]["kv_cache_types"]["types"]
    assert row["own"]["kld_mean"] > 0 and row["total"]["kld_mean"] >= row["own"]["kld_mean"] * 0.5
    assert "the artifact with a 16-bit cache on" not in result.stderr
