"""gptq W4A8 (--activations int8 | fp8) end to end through the CLI on the micro model: the layouts vLLM's
W4A8 schemes load, checked bit for bit, and the bad-input cases (exit 2)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from tests.methods.conftest import (
    CALIB_ARGS,
    LOOSE_TOP1,
    assert_metrics,
    assert_nothing_written,
    quant_config,
    stored_tensors,
)


@pytest.fixture(scope="module")
def w4a8(micro_model, tmp_path_factory):
    """w4a8("int8"): the micro model quantized by `quantkit quantize --method gptq --activations int8`, once."""
    from typer.testing import CliRunner

    from quantkit.cli.app import app

    root, made = tmp_path_factory.mktemp("w4a8"), {}

    def make(activations: str) -> Path:
        if activations not in made:
            out = root / activations
            result = CliRunner().invoke(app, ["quantize", str(micro_model), "--method", "gptq", "--activations",
                                              activations, *CALIB_ARGS, *LOOSE_TOP1, "-o", str(out)],
                                        catch_exceptions=False)
            assert result.exit_code == 0, result.output
            made[activations] = out
        return made[activations]

    return make


def tensors(out: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v for shard in sorted(out.glob("*.safetensors")) for k, v in load_file(shard).items()}


def signed_int4_from_uint4b8_words(packed):
    """vLLM 0.32's convert_packed_uint4b8_to_signed_int4_inplace (quant_utils.py; CUDA-only there), on a copy:
    each int32 word's eight nibbles from uint4b8 (value + 8) to two's-complement int4."""
    t = packed.clone()
    for i in range(8):
        shift = 4 * i
        nib = (t >> shift) & 0xF
        t &= ~(0xF << shift)
        t |= ((nib - 8) & 0xF) << shift
    return t


def nibbles_as_int8(words):
    """[out, in / 8] int32 words of two's-complement int4 -> [out, in] int8: nibble i of word j is input column
    8 j + i (the {input_dim 0, packed_dim 0} order CutlassW4A8LinearKernel permutes the words into)."""
    import torch

    columns = torch.stack([(words >> (4 * i)) & 0xF for i in range(8)], dim=-1).reshape(words.shape[0], -1)
    return torch.where(columns >= 8, columns - 16, columns).to(torch.int8)


def dynamic_4bit_bytes(weight):
    """vLLM 0.32's Dynamic4bitLinearKernel.process_weights_after_loading (W4A8Int's CPU kernel), before
    torch's _dyn_quant_pack_4bit_weight: int8 weights + 8, two columns per byte, the even one low."""
    import torch

    shifted = weight.add(8)
    return (shifted[:, 1::2] << 4 | shifted[:, ::2]).to(torch.uint8)


def test_w4a8_int8_is_the_layout_vllms_w4a8_int_scheme_loads(w4a8):
    out = w4a8("int8")
    config = quant_config(out)
    group = config["config_groups"]["group_0"]
    # vLLM's _is_dynamic_token_w4a8_int in an activation format -> CompressedTensorsW4A8Int
    assert config["format"] == group["format"] == "int-quantized"
    weights, acts = group["weights"], group["input_activations"]
    assert (weights["num_bits"], weights["type"], weights["symmetric"]) == (4, "int", True)
    assert weights["strategy"] == "group"
    assert weights["group_size"] == 128 and weights["dynamic"] is False
    assert (acts["num_bits"], acts["type"], acts["strategy"], acts["dynamic"], acts["symmetric"]) == \
        (8, "int", "token", True, True)
    stored, shapes = tensors(out), stored_tensors(out)
    q_proj = "model.layers.0.self_attn.q_proj"
    # W4A8Int.create_weights: `weight` int8 [out, in] (one int4 value per byte), `weight_scale` [out, in / group]
    assert shapes[f"{q_proj}.weight"] == ("I8", [256, 256]) and shapes[f"{q_proj}.weight_scale"] == ("BF16", [256, 2])
    assert f"{q_proj}.weight_packed" not in shapes and f"{q_proj}.weight_zero_point" not in shapes
    for name in (k for k, v in stored.items() if k.endswith(".weight") and v.dtype.itemsize == 1):
        assert -8 <= int(stored[name].min()) and int(stored[name].max()) <= 7, name
    entry = assert_metrics(out)
    assert entry["details"]["choices"]["symmetric"].startswith("auto: symmetric (W4A8")
    assert entry["options"]["activations"] == "int8" and entry["options"]["symmetric"] is True
    assert "activations: int8" in (out / "README.md").read_text()


def test_w4a8_fp8_is_packed_as_vllms_w4a8_fp8_scheme_unpacks_it(w4a8):
    """The fp8 artifact's int32 words, unpacked as vLLM's CUTLASS W4A8 path does, are bit for bit the int8
    artifact's int4 values (same GPTQ, same calibration: the activations do not change the weights); their bytes
    are what vLLM's CPU W4A8 kernel packs from those int8 values; and the scales are equal."""
    import torch

    int8, fp8 = w4a8("int8"), w4a8("fp8")
    config = quant_config(fp8)
    group = config["config_groups"]["group_0"]
    # vLLM's _is_fp8_w4a8_sm90 -> CompressedTensorsW4A8Fp8: packed int32 + weight_shape, group 128, symmetric
    assert config["format"] == group["format"] == "pack-quantized"
    assert group["weights"]["group_size"] == 128 and group["weights"]["symmetric"] is True
    assert (group["input_activations"]["type"], group["input_activations"]["strategy"]) == ("float", "token")
    unpacked, packed = tensors(int8), tensors(fp8)
    layers = sorted(k.removesuffix(".weight") for k, v in unpacked.items() if v.dtype == torch.int8)
    assert len(layers) == 14
    for layer in layers:
        words, values = packed[f"{layer}.weight_packed"], unpacked[f"{layer}.weight"]
        assert words.dtype == torch.int32 and words.shape == (values.shape[0], values.shape[1] // 8)
        assert packed[f"{layer}.weight_shape"].tolist() == list(values.shape)
        assert torch.equal(nibbles_as_int8(signed_int4_from_uint4b8_words(words)), values), layer
        assert torch.equal(words.contiguous().view(torch.uint8).reshape(values.shape[0], -1),
                           dynamic_4bit_bytes(values)), layer  # little-endian words: the same bytes
        assert torch.equal(packed[f"{layer}.weight_scale"], unpacked[f"{layer}.weight_scale"]), layer


def test_w4a8_gate_reads_the_artifact_as_compressed_tensors_decompresses_it(w4a8):
    """The gate's weights (quantkit.eval.compressed) are the stored int4 values times their group's scale."""
    import torch

    from quantkit.engines.transformers import hf_config
    from quantkit.eval.compressed import CompressedWeights, quantized_meta_model

    out = w4a8("int8")
    stored = tensors(out)
    reading = CompressedWeights(out, quantized_meta_model(hf_config(out), torch.float32))
    name = "model.layers.1.mlp.down_proj"
    values, scale = stored[f"{name}.weight"].float(), stored[f"{name}.weight_scale"].float()
    expected = (values.reshape(values.shape[0], -1, 128) * scale.unsqueeze(-1)).reshape(values.shape)
    assert torch.allclose(reading.get(f"{name}.weight").float(), expected, rtol=1e-2, atol=0)


@pytest.mark.parametrize("args, message", [
    (("--activations", "int8", "--bits", "8"), "quantizes 4-bit weights"),
    (("--activations", "int8", "--asymmetric"), "take symmetric weights only"),
    (("--activations", "fp8", "--group-size", "64"), "takes group size 128 only"),
    (("--activations", "int8", "--fallback"), "cannot take fallback"),
    (("--activations", "int4"), "activations"),
])
def test_w4a8_bad_inputs_are_refused_before_work(cli, micro_model, tmp_path, args, message):
    out = tmp_path / "out"
    result = cli("quantize", micro_model, "--method", "gptq", *args, *CALIB_ARGS, "-o", out)
    assert result.exit_code == 2, result.output
    assert message in result.output
    assert_nothing_written(out)


def test_w4a8_fp8_keeps_layers_whose_widths_are_not_multiples_of_128(width_72_model):
    from quantkit.io.checkpoint import check_model_dir
    from quantkit.methods import gptq

    info = check_model_dir(width_72_model)
    options, notes = gptq.resolve(info, gptq.Options(activations="fp8"))
    assert options.group_size == 128 and options.symmetric is True and "128" in notes["group_size"]
    problems = gptq.METHOD.layers.shape_problems(info, options, [])
    assert problems and all("not multiples of 128" in why or "does not divide" in why for why in problems.values())
    assert set(problems) == set(gptq.quantized_linears(info))


def test_w4a8_runtimes_name_the_vllm_kernels():
    from quantkit.methods import gptq, runtimes_for

    (cpu,) = runtimes_for(gptq.METHOD, gptq.Options(activations="int8"))
    assert cpu.serves("cpu") and not cpu.serves("cuda", 9.0)
    (hopper,) = runtimes_for(gptq.METHOD, gptq.Options(activations="fp8"))
    assert hopper.serves("cuda", 9.0) and not hopper.serves("cuda", 8.9) and not hopper.serves("cuda", 10.0)
    assert not hopper.serves("cpu") and not hopper.accepts([576, 1536]) and hopper.accepts([1536, 512])
    assert runtimes_for(gptq.METHOD, gptq.Options()) == runtimes_for(gptq.METHOD, gptq.Options(bits=8))  # WNA16


@pytest.mark.parametrize("activations", ["int8", "fp8"])
def test_w4a8_size_estimate_is_what_is_stored(w4a8, activations):
    """The preflight's bits per weight (stored_bits) against one layer's stored tensors: one int8 per int4 value
    (int8) or eight per int32 (fp8), a 16-bit scale per group of 128, no zero point."""
    from quantkit.methods import gptq

    shapes = stored_tensors(w4a8(activations))
    layer = "model.layers.0.mlp.down_proj"
    element = {"I8": 1, "I32": 4, "BF16": 2, "I64": 8}
    stored = sum(element[dtype] * math.prod(shape) for name, (dtype, shape) in shapes.items()
                 if name.startswith(layer + ".weight") and not name.endswith("weight_shape"))
    out, width = 256, 512
    assert 8 * stored / (out * width) == gptq.stored_bits(gptq.Options(activations=activations, group_size=128))
