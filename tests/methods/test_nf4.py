"""nf4 (bitsandbytes) end to end through the CLI, reload with from_pretrained on CPU; missing extra."""

from __future__ import annotations

import sys

import pytest

from tests.methods.conftest import LOOSE_TOP1, assert_metrics, assert_nothing_written, mean_kld_vs_base, quant_config

FAST_ARGS = ["--num-samples", "2", "--seq-len", "64", "--eval-windows", "4"]


@pytest.mark.parametrize("scheme, double_quant", [("nf4", True), pytest.param("int8", False, marks=pytest.mark.slow),
                                                  pytest.param("fp4", False, marks=pytest.mark.slow)])
def test_nf4_end_to_end(cli, micro_model, tmp_path, scheme, double_quant):
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    dq = "--double-quant" if double_quant else "--no-double-quant"
    result = cli("quantize", micro_model, "--method", "nf4", "--scheme", scheme, dq,
                     "--compute-dtype", "bfloat16", *FAST_ARGS, *LOOSE_TOP1, "-o", out)
    assert result.exit_code == 0, result.output
    config = quant_config(out)
    assert config["quant_method"] == "bitsandbytes"
    if scheme == "int8":
        assert config["load_in_8bit"] is True
    else:
        assert config["load_in_4bit"] is True
        assert config["bnb_4bit_quant_type"] == scheme
        assert config["bnb_4bit_use_double_quant"] is double_quant
        assert config["bnb_4bit_compute_dtype"] == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(out, device_map="cpu")
    expected = bnb.nn.Linear8bitLt if scheme == "int8" else bnb.nn.Linear4bit
    assert isinstance(model.model.layers[0].self_attn.q_proj, expected)
    assert not isinstance(model.lm_head, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt))
    assert_metrics(out)
    assert mean_kld_vs_base(out, micro_model) < 0.05


def test_nf4_without_bitsandbytes(cli, micro_model, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)  # makes `import bitsandbytes` raise ImportError
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "nf4", *FAST_ARGS, "-o", out)
    assert result.exit_code == 2, result.output
    assert "bitsandbytes" in result.output and "quantkit[nf4]" in result.output
    assert_nothing_written(out)


def test_nf4_precision_strings():
    from quantkit.methods import nf4

    assert nf4.precision("decoder", nf4.Options(), "x", [256, 256]) == "nf4 blocks of 64 + double quant (bitsandbytes)"
    assert nf4.precision("vision", nf4.Options(), "x", [256, 256]) is None
