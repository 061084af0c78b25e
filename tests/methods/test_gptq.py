"""gptq end to end through the CLI on a micro model, and its bad-input cases (exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.methods.conftest import (
    CALIB_ARGS,
    LOOSE_TOP1,
    assert_beats_rtn,
    assert_metrics,
    assert_nothing_written,
    mean_kld_vs_base,
    quant_config,
)


@pytest.mark.parametrize(
    "bits, group_size, act_order",
    [(4, 64, "static"), pytest.param(8, -1, "none", marks=pytest.mark.slow)],
)
def test_gptq_end_to_end(cli, micro_model, tmp_path, bits, group_size, act_order):
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "gptq", "--bits", bits, "--group-size", group_size,
                     "--act-order", act_order, *CALIB_ARGS, *LOOSE_TOP1, "-o", out)
    assert result.exit_code == 0, result.output
    config = quant_config(out)
    assert config["quant_method"] == "compressed-tensors"
    assert config["format"] == "pack-quantized"
    weights = config["config_groups"]["group_0"]["weights"]
    # symmetric auto: zero points at 4 bits, none at 8 (Marlin takes no 8-bit zero points)
    assert weights["num_bits"] == bits and weights["symmetric"] is (bits == 8) and weights["type"] == "int"
    assert weights["strategy"] == ("channel" if group_size == -1 else "group")
    assert weights["actorder"] == (None if act_order == "none" else act_order)
    assert "lm_head" in config["ignore"]
    entry = assert_metrics(out)
    assert entry["details"]["calibration_tokens"] == 16 * 64
    assert entry["details"]["choices"]["symmetric"].startswith("auto: " + ("symmetric" if bits == 8 else "asymmetric"))
    assert mean_kld_vs_base(out, micro_model) < 0.05


def test_base_weights_are_freed_after_the_quantize_step(cli, micro_model, tmp_path, monkeypatch):
    """llm-compressor's sequential pipeline keeps the model object reachable from its traced code;
    the pipeline empties it before the gate, so the base model is not held through the gate."""
    import weakref

    from compressed_tensors.offload import disable_onloading

    from quantkit.run import pipeline

    seen, real = {}, pipeline.run_target

    def spy(job, resolved, baseline, opts, *rest):
        seen["model"] = weakref.ref(job.model)
        entry = real(job, resolved, baseline, opts, *rest)
        model = seen["model"]()
        with disable_onloading():
            seen["left"] = 0 if model is None else sum(p.numel() for p in model.parameters() if not p.is_meta)
        return entry

    monkeypatch.setattr(pipeline, "run_target", spy)
    result = cli("quantize", micro_model, "--method", "gptq", *CALIB_ARGS, *LOOSE_TOP1, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert seen["left"] == 0


def test_gptq_group_size_that_divides_no_width_is_refused(cli, micro_model, tmp_path):
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "gptq", "--group-size", 96, *CALIB_ARGS, "-o", out)
    assert result.exit_code == 2, result.output
    assert "gptq can tile no layer of this model" in result.output and "group_size=96 does not divide" in result.output
    assert_nothing_written(out)
    result = cli("quantize", micro_model, "--method", "gptq", "--group-size", 96, *CALIB_ARGS, "-o", out, "--strict-shapes")
    assert result.exit_code == 2 and "group_size=96 does not divide its input width" in result.output
    assert "model.layers.0." in result.output
    assert_nothing_written(out)


def test_gptq_explicit_group_size_keeps_the_layers_it_does_not_divide(cli, odd_model, tmp_path):
    """hidden 192, ffn 512: group 128 divides only down_proj's input; the rest stays 16-bit, listed."""
    import json

    out = tmp_path / "out"
    result = cli("quantize", odd_model, "--method", "gptq", "--group-size", 128, *CALIB_ARGS, "-o", out, "--no-gate")
    assert result.exit_code == 0, result.output
    kept = json.loads((out / "quantkit.json").read_text())["targets"][0]["details"]["kept_16bit"]
    assert "model.layers.0.mlp.down_proj" not in kept and "model.layers.0.self_attn.q_proj" in kept
    assert len(kept) == 2 * 6  # q, k, v, o, gate and up read 192-wide inputs, in both layers


def test_auto_group_size_is_the_largest_that_divides_every_width():
    from quantkit.io.checkpoint import ModelInfo
    from quantkit.methods.gptq import auto_group_size

    def info(widths):
        tensors = {f"model.layers.0.mlp.p{i}.weight": ("BF16", [64, w]) for i, w in enumerate(widths)}
        return ModelInfo(Path("m"), {}, [], "LlamaForCausalLM", "llama", tensors)

    assert auto_group_size(info([896, 4864]))[0] == 128  # Qwen2.5-0.5B
    size, why = auto_group_size(info([576, 1536]))  # SmolLM-135M
    assert size == 64 and "128 does not divide 576 (model.layers.0.mlp.p0)" in why
    assert auto_group_size(info([960, 2560]))[0] == 64
    assert auto_group_size(info([200]))[0] == -1  # none of 128, 64, 32: one scale per output channel


@pytest.mark.parametrize("method", ["gptq", pytest.param("awq", marks=pytest.mark.slow)])  # the same group-size rule
def test_default_group_size_runs_on_widths_128_does_not_divide(cli, odd_model, tmp_path, method):
    """hidden 192: the default (auto) takes 64 and says why; an explicit 128 with --strict-shapes is refused."""
    out = tmp_path / "out"
    result = cli("quantize", odd_model, "--method", method, *CALIB_ARGS, "--no-gate", "-o", out)
    assert result.exit_code == 0, result.output
    entry = assert_metrics(out)
    assert entry["options"]["group_size"] == 64 and quant_config(out)["config_groups"]["group_0"]["weights"][
        "group_size"] == 64
    assert entry["details"]["choices"]["group_size"].startswith("auto: 64 (the largest of 128, 64, 32")
    assert "group_size auto: 64" in (out / "README.md").read_text()
    refused = cli("quantize", odd_model, "--method", method, "--group-size", "128", *CALIB_ARGS, "-o", tmp_path / "x",
                  "--strict-shapes")
    assert refused.exit_code == 2 and "sizes that divide every width: 16, 32, 64" in refused.stderr


def test_gptq_unsupported_bits(cli, micro_model, tmp_path):
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "gptq", "--bits", 3, *CALIB_ARGS, "-o", out)
    assert result.exit_code == 2, result.output
    assert "bits=3 is not supported" in result.output
    assert_nothing_written(out)


def test_gptq_too_few_calibration_tokens(cli, micro_model, tmp_path):
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "gptq", "--num-samples", 2, "--seq-len", 64,
                     "--eval-windows", 2, "-o", out)
    assert result.exit_code == 2, result.output
    assert "128 calibration tokens is too few" in result.output
    assert_nothing_written(out)


def test_auto_symmetric_by_bits_and_moe():
    from types import SimpleNamespace

    from quantkit.methods import gptq

    def info(config):
        return SimpleNamespace(model_type=config["model_type"], config=config)

    dense, moe = info({"model_type": "llama"}), info({"model_type": "mixtral", "num_local_experts": 8})
    vlm = info({"model_type": "qwen3_5_moe", "text_config": {"model_type": "qwen3_5_moe_text", "num_experts": 8}})
    assert gptq.auto_symmetric(dense, 4)[0] is False
    assert gptq.auto_symmetric(dense, 8)[0] is True
    assert gptq.auto_symmetric(moe, 4)[0] is True
    assert gptq.auto_symmetric(vlm, 4)[0] is True
    # a family with dense and MoE checkpoints under one model_type: only the one with experts
    granite = {"model_type": "granitemoehybrid", "num_local_experts": 0}
    assert gptq.auto_symmetric(info(granite), 4)[0] is False
    assert gptq.auto_symmetric(info({**granite, "num_local_experts": 4}), 4)[0] is True
    # int8 layers of a per-layer plan are symmetric per channel whatever the int4 scheme
    scheme = gptq.Scheme(group_size=64, symmetric=False)
    assert scheme.weights("int8")["symmetric"] is True and scheme.weights("int4")["symmetric"] is False
    assert scheme.nbytes((64, 256), "int8") == gptq.Scheme(64, True).nbytes((64, 256), "int8")


def test_gptq_precision_strings():
    from quantkit.methods import gptq

    options = gptq.Options(group_size=128, act_order="none", symmetric=True)
    assert gptq.precision("decoder", options, "x", [256, 256]) == "int4 g128 sym (GPTQ)"
    assert gptq.precision("lm_head", options, "lm_head", [512, 256]) is None
    options = gptq.Options(bits=8, group_size=-1, symmetric=False)
    assert gptq.precision("decoder", options, "x", [256, 256]) == "int8 per-channel asym (GPTQ, act-order static)"


@pytest.mark.slow
def test_gptq_beats_rtn_on_reference_model(cli, reference_model, tmp_path):
    """On a trained model GPTQ's error feedback must beat plain rounding of the same format."""
    assert_beats_rtn(cli, reference_model, tmp_path, "gptq", "W4A16")

def test_gptq_act_order_group_refused_before_work(cli, micro_model, tmp_path):
    """llm-compressor's GPTQ rejects group ordering only after loading and calibrating: refused at once."""
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "gptq", "--act-order", "group", *CALIB_ARGS, "-o", out)
    assert result.exit_code == 2, result.output
    assert "act_order=group is not supported" in result.output and "act_order static" in result.output
    assert_nothing_written(out)
