"""LoRA merge-then-quantize: adapters are merged into the full-precision base before quantizing."""

import json

import pytest

from tests.util import FAST_CALIB


@pytest.fixture(scope="module")
def adapter(micro_model, tmp_path_factory):
    """A LoRA adapter on q/v projections with non-zero B, so merging changes the model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(micro_model)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    for name, param in peft_model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.02)
    out = tmp_path_factory.mktemp("adapters") / "lora"
    peft_model.save_pretrained(out)
    return out


def test_merge_changes_weights(micro_model, adapter, tmp_path):
    from safetensors.torch import load_file

    from quantkit.lora import merge_adapters
    from quantkit.model import check_model_dir

    merged = merge_adapters(check_model_dir(micro_model), [str(adapter)], tmp_path / "merged")
    before = load_file(micro_model / "model.safetensors")
    after = load_file(merged / "model.safetensors")
    key = "model.layers.0.self_attn.q_proj.weight"
    assert not (before[key] == after[key]).all()
    assert (before["model.layers.0.mlp.up_proj.weight"] == after["model.layers.0.mlp.up_proj.weight"]).all()
    assert not any("lora" in k for k in after)


def test_quantize_with_lora_measures_against_the_merged_model(cli, micro_model, adapter, tmp_path):
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--lora", adapter, "--method", "fp8", "-o", out, *FAST_CALIB)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "quantkit.json").read_text())
    assert report["recipe"]["lora"] == [str(adapter)]
    assert report["targets"][0]["metrics"]["kld_mean"] < 0.01  # vs the merged base, not the original
    assert report["model"]["path"] == str(micro_model)


def test_missing_adapter_is_bad_input(cli, micro_model, tmp_path):
    result = cli("quantize", micro_model, "--lora", tmp_path / "none", "--method", "fp8", "-o", tmp_path / "out")
    assert result.exit_code == 2 and "LoRA adapter directory not found" in result.stderr


def test_not_an_adapter(cli, micro_model, tmp_path):
    (tmp_path / "empty").mkdir()
    result = cli("quantize", micro_model, "--lora", tmp_path / "empty", "--method", "fp8", "-o", tmp_path / "out",
                 *FAST_CALIB)
    assert result.exit_code == 2 and "not a LoRA adapter" in result.stderr
    assert not (tmp_path / "out").exists()


def test_already_quantized_model_refused(cli, micro_model, tmp_path):
    fp8 = tmp_path / "fp8"
    assert cli("quantize", micro_model, "--method", "fp8", "-o", fp8, *FAST_CALIB).exit_code == 0
    result = cli("quantize", fp8, "--method", "fp8", "-o", tmp_path / "again")
    assert result.exit_code == 2 and "already quantized" in result.stderr
