"""A checkpoint of a family transformers 5.17 does not know: exit 2 before any work, naming the model_type and
what to do (quantkit's engines build the model through transformers; GGUF names the architectures it converts)."""

from __future__ import annotations

import json

import pytest

from tests.families import common


@pytest.fixture
def unknown(micro_model, tmp_path):
    """The micro model under a model_type and class no transformers has."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(micro_model, model)
    config = json.loads((model / "config.json").read_text())
    config.update(model_type="qwen9_text", architectures=["Qwen9ForCausalLM"])
    (model / "config.json").write_text(json.dumps(config))
    return model


@pytest.mark.parametrize("method", ["fp8", "gptq", "nf4", "mlx"])
def test_refused_before_work_naming_the_model_type(cli, unknown, tmp_path, method):
    out = tmp_path / "out"
    result = common.quantize(cli, unknown, out, method)
    common.assert_refused(result, out, "qwen9_text")
    assert "internal error" not in result.output


def test_gguf_names_the_architectures_it_converts(cli, unknown, tmp_path):
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, unknown, out, "gguf"), out, "Qwen9ForCausalLM", "LlamaForCausalLM")


def test_a_checkpoint_with_its_own_code_is_told_about_trust_remote_code(cli, unknown, tmp_path):
    config = json.loads((unknown / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_qwen9.Qwen9ForCausalLM"}
    (unknown / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    common.assert_refused(common.quantize(cli, unknown, out, "fp8"), out, "qwen9_text", "--trust-remote-code")
