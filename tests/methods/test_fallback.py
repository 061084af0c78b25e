"""--fallback for the one-precision methods (fp8, smoothquant, nf4) on the general-case model: a failing gate
turned into a passing artifact whose most damaging layers stay 16-bit, within --max-size; refusals before
work; and the failed gate's message naming --fallback."""

from __future__ import annotations

import json

import pytest

from tests.methods.conftest import CALIB_ARGS, assert_nothing_written, probe_window_bound, report

LOOSE = ("--min-top1", "0", "--max-ppl-increase", "10")


def plain_kld(cli, model, method: str, tmp_path) -> float:
    out, json_path = tmp_path / f"plain-{method}", tmp_path / f"plain-{method}.json"
    result = cli("quantize", model, "--method", method, *CALIB_ARGS, "--no-gate", "-o", out, "--json", json_path)
    assert result.exit_code == 0, result.output
    return json.loads(json_path.read_text())["targets"][0]["metrics"]["kld_mean"]


@pytest.mark.parametrize("method", ["fp8", *(pytest.param(m, marks=pytest.mark.slow) for m in ("nf4", "smoothquant"))])
def test_fallback_keeps_the_worst_layers_16_bit_until_the_gate_passes(cli, odd_model, tmp_path, method):
    from transformers import AutoModelForCausalLM

    gate = ("--max-kld", f"{plain_kld(cli, odd_model, method, tmp_path) * 0.5:.3g}", *LOOSE)
    failed = cli("quantize", odd_model, "--method", method, *CALIB_ARGS, *gate, "-o", tmp_path / "failed")
    assert failed.exit_code == 3 and "--fallback" in failed.stderr, failed.output  # the hint names the way out
    recipe = tmp_path / "fallback.yaml"
    recipe.write_text(f"targets:\n  - name: t\n    method: {method}\n"
                      "    options: {fallback: {max_size: '+100%', tensors_per_step: 2}}\n")
    out = tmp_path / "out"
    result = cli("quantize", odd_model, "--recipe", recipe, *CALIB_ARGS, *gate, "-o", out)
    assert result.exit_code == 0, result.output
    target = report(out)["targets"][0]
    fallback, details = target["details"]["fallback"], target["details"]
    steps = fallback["steps"]
    assert not steps[0]["passed"] and steps[-1]["passed"] and target["gate"]["passed"]
    assert all(s["raised"] for s in steps[1:]) and all(v.endswith("->16-bit") for s in steps[1:]
                                                        for v in s["raised"].values())
    assert steps[-1]["bytes"] <= fallback["limit_bytes"] == 2 * steps[0]["bytes"]
    kept = sorted(n for n, p in fallback["types"].items() if p == "16-bit")
    assert kept and details["sensitivity"]["probes"] > 0
    # the sensitivity windows are the gate's 4 held-out ones; the probes take what one pass of them pays for
    assert details["sensitivity"]["windows"] == probe_window_bound(odd_model, details["sensitivity"], 4, 4)
    model = AutoModelForCausalLM.from_pretrained(out, device_map="cpu")
    for name in kept:  # reloaded as plain 16-bit Linear layers
        module = model.get_submodule(name)
        assert type(module).__name__ == "Linear" and getattr(module, "quantization_scheme", None) is None, name


def test_fallback_with_an_absolute_max_size_below_the_first_artifact_is_refused_before_work(cli, odd_model, tmp_path):
    out = tmp_path / "out"
    result = cli("quantize", odd_model, "--method", "fp8", "--fallback", "--max-size", "100KB", *CALIB_ARGS, "-o", out)
    assert result.exit_code == 2 and "--max-size 100KB (100,000 bytes) is below the first artifact" in result.stderr
    assert "quantizing" not in result.stderr
    assert_nothing_written(out)


def test_fallback_is_refused_for_a_vlm_before_work(cli, tmp_path):
    from tests.vlm_models import build_llava

    model = build_llava(tmp_path / "llava")
    result = cli("quantize", model, "--method", "fp8", "--fallback", *CALIB_ARGS, "-o", tmp_path / "out")
    assert result.exit_code == 2 and "fp8: fallback is not supported for VLMs" in result.stderr, result.output


def test_the_search_keeps_the_fewest_raises_that_pass(cli, odd_model, tmp_path):
    """The default fallback: measured steps each printed with their metrics, the artifact kept is the fewest
    raises that passed, and q/k/v and gate/up move together (vLLM loads each group as one layer)."""
    gate = ("--max-kld", f"{plain_kld(cli, odd_model, 'fp8', tmp_path) * 0.5:.3g}", *LOOSE)
    out = tmp_path / "out"
    result = cli("quantize", odd_model, "--method", "fp8", "--fallback", "--max-size", "+100%", *CALIB_ARGS, *gate,
                 "-o", out)
    assert result.exit_code == 0, result.output
    target = report(out)["targets"][0]
    fallback = target["details"]["fallback"]
    steps = fallback["steps"]
    passing = [s["raises"] for s in steps[1:] if s["passed"]]
    assert passing and target["gate"]["passed"] and fallback["passed"]
    assert "fallback step 1: " in result.stderr and " layers changed), " in result.stderr and "KLD " in result.stderr
    assert f"gate passed with {min(passing)} of " in fallback["stopped"]
    kept = {n for n, p in fallback["types"].items() if p == "16-bit"}
    assert kept and kept == {n for n, v in steps[[s.get("raises") for s in steps].index(min(passing))]["raised"].items()}
    for layer in range(2):
        prefix = f"model.layers.{layer}."
        assert len({prefix + f"self_attn.{p}_proj" in kept for p in "qkv"}) == 1
        assert (prefix + "mlp.gate_proj" in kept) == (prefix + "mlp.up_proj" in kept)
    assert set(kept) <= set(json.loads((out / "config.json").read_text())["quantization_config"]["ignore"])
    peaks = target["peak_rss_by_step"]  # the fallback's own steps in the per-step peaks
    assert {"quantize", "eval", "fallback: sensitivity", "fallback: requantize", "fallback: eval"} <= set(peaks)
    assert target["peak_rss_bytes"] == max(peaks.values())


def test_the_search_says_how_much_room_a_pass_needs(cli, odd_model, tmp_path):
    gate = ("--max-kld", f"{plain_kld(cli, odd_model, 'fp8', tmp_path) * 0.2:.3g}", *LOOSE)
    result = cli("quantize", odd_model, "--method", "fp8", "--fallback", "--max-size", "+3%", *CALIB_ARGS, *gate,
                 "-o", tmp_path / "out")
    assert result.exit_code == 3, result.output
    assert "no passing artifact within --max-size +3%" in result.stderr
    assert "the measured trend needs about" in result.stderr or "even every raise would stay above" in result.stderr
    assert "raise --max-size" in result.stderr
