"""nf4 on a model whose shapes bitsandbytes' CPU 4-bit kernels cannot take: those layers stay 16-bit."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.methods.conftest import LOOSE_TOP1, report

FAST_ARGS = ["--num-samples", "2", "--seq-len", "64", "--eval-windows", "4"]


@pytest.fixture(scope="session")
def odd_model(tmp_path_factory) -> Path:
    """Hidden 64, intermediate 172: attention fits bitsandbytes' 4-bit CPU kernels, the MLP does not."""
    from quantkit.toy import ToyPreset, build_model, build_tokenizer, bundled_texts

    preset = ToyPreset(512, 64, 172, 2, 4, 2, train_steps=0)
    tokenizer = build_tokenizer(bundled_texts(), preset.vocab_size)
    out = tmp_path_factory.mktemp("models") / "odd"
    import torch

    build_model(preset, tokenizer).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def test_kernel_shape_rule():
    from quantkit.methods import nf4

    options = nf4.Options()
    assert nf4.fits_kernels(options, [64, 64]) and nf4.fits_kernels(options, [96, 128])
    assert not nf4.fits_kernels(options, [172, 64])  # out_features % 32
    assert not nf4.fits_kernels(options, [64, 172])  # in_features % 64
    assert not nf4.fits_kernels(options, [64, 96])
    assert nf4.fits_kernels(nf4.Options(scheme="int8"), [172, 64])
    assert nf4.precision("decoder", options, "x", [172, 64]) is None


def test_exact_module_pattern():
    import re

    from quantkit.methods import nf4

    pattern = nf4.exact_module("model.layers.1.mlp.down_proj")
    assert re.match(pattern, "model.layers.1.mlp.down_proj")
    assert re.match(pattern, "model.language_model.layers.1.mlp.down_proj")  # VLM module naming
    assert not re.match(pattern, "model.layers.11.mlp.down_proj")
    assert not re.match(pattern, "model.layers.1.mlp.down_proj_extra")


def test_nf4_keeps_odd_layers_16bit(cli, odd_model, tmp_path):
    import bitsandbytes as bnb
    import torch
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    result = cli("quantize", odd_model, "--method", "nf4", *FAST_ARGS, *LOOSE_TOP1, "--no-gate", "-o", out)
    assert result.exit_code == 0, result.output
    kept = report(out)["targets"][0]["details"]["kept_for_bnb_kernels"]
    assert sorted(kept) == sorted(f"model.layers.{i}.mlp.{p}" for i in range(2) for p in ("gate_proj", "up_proj", "down_proj"))
    model = AutoModelForCausalLM.from_pretrained(out, device_map="cpu")
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, bnb.nn.Linear4bit)
    assert not isinstance(layer.mlp.down_proj, bnb.nn.Linear4bit)
    with torch.no_grad():
        assert torch.isfinite(model(torch.arange(16)[None]).logits).all()


def test_nf4_refuses_a_model_no_layer_of_which_fits(odd_model):
    from quantkit.errors import UnsupportedError
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.methods import nf4

    info = check_model_dir(odd_model)
    info.tensors = {n: (d, [s[0] + 1, s[1]] if len(s) == 2 else s) for n, (d, s) in info.tensors.items()}
    with pytest.raises(UnsupportedError, match="fits bitsandbytes"):
        nf4.check(info, nf4.Options(), None)
