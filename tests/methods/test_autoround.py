"""autoround end to end through the CLI on a micro model, its options and its bad-input cases (exit 2)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from quantkit.methods import autoround
from tests.methods.conftest import (
    CALIB_ARGS,
    LOOSE_TOP1,
    assert_beats_rtn,
    assert_metrics,
    assert_nothing_written,
    mean_kld_vs_base,
    quant_config,
)

FEW_ITERS = ["--iters", "4"]


def digest(out: Path) -> str:
    return hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()


def run(cli, model: Path, out: Path):
    result = cli("quantize", model, "--method", "autoround", *FEW_ITERS, *CALIB_ARGS, *LOOSE_TOP1, "-o", out)
    assert result.exit_code == 0, result.output
    return out


def test_autoround_end_to_end(cli, micro_model, tmp_path):
    """W4A16 compressed-tensors with auto group size, every 16-bit tensor back in the model's dtype,
    reloaded by transformers."""
    from safetensors import safe_open

    out = run(cli, micro_model, tmp_path / "out")
    config = quant_config(out)
    assert config["format"] == "pack-quantized" and "lm_head" in config["ignore"]
    weights = config["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"]) == (4, 128, True)
    entry = assert_metrics(out)
    assert entry["details"]["tuning"] == {"iters": 4, "lr": None}
    with safe_open(out / "model.safetensors", "pt") as f:  # AutoRound tunes in float32; nothing stays there
        assert {f.get_slice(k).get_dtype() for k in f.keys()} <= {"BF16", "I32", "I64"}
    assert mean_kld_vs_base(out, micro_model) < 0.05


@pytest.mark.slow  # the fast end-to-end run covers the pipeline; this one the scheme's other corner
def test_autoround_int8_asymmetric(cli, micro_model, tmp_path):
    """W8A16 with a zero point per group: the config says so, the zero points are stored, transformers
    reloads it and it is closer to the base than the 4-bit run is allowed to be."""
    from safetensors import safe_open

    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "autoround", "--bits", "8", "--asymmetric", *FEW_ITERS,
                 *CALIB_ARGS, *LOOSE_TOP1, "-o", out)
    assert result.exit_code == 0, result.output
    weights = quant_config(out)["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["symmetric"]) == (8, False)
    with safe_open(out / "model.safetensors", "pt") as f:
        assert any(k.endswith("weight_zero_point") for k in f.keys())
    assert mean_kld_vs_base(out, micro_model) < 0.01


def stored_levels(out: Path):
    """Every quantized 4-bit layer's integer levels minus its zero points, as the artifact stores them, and
    the zero points."""
    import torch
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from safetensors import safe_open

    levels, zero_points = [], []
    with safe_open(out / "model.safetensors", "pt") as f:
        for key in [k for k in f.keys() if k.endswith(".weight_packed")]:
            prefix = key.removesuffix("weight_packed")
            shape = torch.Size(f.get_tensor(prefix + "weight_shape").tolist())
            scale = f.get_tensor(prefix + "weight_scale")
            packed = unpack_from_int32(f.get_tensor(key), 4, shape).int()
            zero_point = unpack_from_int32(f.get_tensor(prefix + "weight_zero_point"), 4, scale.shape, 0).int()
            levels.append(packed.reshape(shape[0], scale.shape[1], -1) - zero_point.unsqueeze(-1))
            zero_points.append(zero_point)
    return torch.cat([x.flatten() for x in levels]), torch.cat([z.flatten() for z in zero_points])


def test_autoround_asymmetric_stores_its_zero_points(cli, micro_model, tmp_path):
    """W4A16 asymmetric: AutoRound's own zero points are stored (llm-compressor's modifier would leave
    them 0), so the weights keep the levels AutoRound gave them beyond the symmetric -8..7."""
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "autoround", "--asymmetric", *FEW_ITERS, *CALIB_ARGS,
                 *LOOSE_TOP1, "-o", out)
    assert result.exit_code == 0, result.output
    assert quant_config(out)["config_groups"]["group_0"]["weights"]["symmetric"] is False
    levels, zero_points = stored_levels(out)
    assert (zero_points != 0).any() and zero_points.min() >= -8 and zero_points.max() <= 7
    assert levels.min() < -8 or levels.max() > 7
    assert mean_kld_vs_base(out, micro_model) < 0.05


@pytest.mark.slow
def test_autoround_with_offload_dir(cli, micro_model, tmp_path):
    """--offload-dir: decoder layers on disk while AutoRound tunes them; the float32 leftovers are cast
    back through the offload cache, the artifact reloads and passes the gate, the folder is emptied."""
    from safetensors import safe_open

    offload = tmp_path / "offload"
    offload.mkdir()
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "autoround", *FEW_ITERS, *CALIB_ARGS, *LOOSE_TOP1,
                 "--offload-dir", offload, "-o", out)
    assert result.exit_code == 0, result.output
    assert "offloaded to" in result.stderr and list(offload.iterdir()) == []
    assert assert_metrics(out)["gate"]["passed"]
    with safe_open(out / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} <= {"BF16", "I32", "I64"}


@pytest.mark.slow
def test_autoround_is_deterministic(cli, micro_model, tmp_path):
    assert digest(run(cli, micro_model, tmp_path / "a")) == digest(run(cli, micro_model, tmp_path / "b"))


def test_presets_and_overrides():
    assert autoround.tuning(autoround.Options()) == (200, None)
    assert autoround.tuning(autoround.Options(preset="light")) == (50, 5e-3)
    assert autoround.tuning(autoround.Options(preset="light", iters=80)) == (80, None)  # auto-round's 1/iters
    assert autoround.tuning(autoround.Options(iters=80, lr=1e-3)) == (80, 1e-3)
    text = autoround.METHOD.precision("decoder", autoround.Options(preset="light"), "model.layers.0.mlp.up_proj",
                                      [256, 256])
    assert text.startswith("int4") and "AutoRound, 50 iters" in text


@pytest.mark.parametrize("args, message", [
    (["--bits", "3"], "bits"),
    (["--group-size", "96"], "group"),
    (["--batch-size", "32"], "batch_size=32"),
])
def test_bad_options_are_refused_before_work(cli, micro_model, tmp_path, args, message):
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "autoround", *args, *CALIB_ARGS, "-o", out)
    assert result.exit_code == 2, result.output
    assert message in result.output and "loading" not in result.output
    assert_nothing_written(out)


def test_inspect_shows_the_autoround_plan(cli, micro_model):
    result = cli("inspect", micro_model, "--method", "autoround", "--json", "-")
    assert result.exit_code == 0, result.output
    modules = json.loads(result.stdout)["modules"]
    decoder = [m["precision"] for m in modules if m["role"] == "decoder"]
    assert decoder and all(p.startswith("int4 g128 sym (AutoRound, 200 iters") for p in decoder)


@pytest.mark.slow
def test_autoround_beats_rtn_on_reference_model(cli, reference_model, tmp_path):
    assert_beats_rtn(cli, reference_model, tmp_path, "autoround", "W4A16")


def test_restore_dtype_casts_what_autoround_left_in_float32():
    """Norms and biases (also of quantized layers) go back to the model's dtype; a quantized weight and its
    quantization parameters are compression's."""
    import torch

    layer = torch.nn.Linear(4, 4)
    layer.quantization_scheme = object()
    layer.register_parameter("weight_scale", torch.nn.Parameter(torch.ones(4, 1)))
    model = torch.nn.Sequential(layer, torch.nn.LayerNorm(4))
    cast = autoround.restore_dtype(model, torch.bfloat16)
    assert sorted(cast) == ["0.bias", "1.bias", "1.weight"]
    assert layer.bias.dtype == model[1].weight.dtype == torch.bfloat16
    assert layer.weight.dtype == layer.weight_scale.dtype == torch.float32
