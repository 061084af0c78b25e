"""quantkit.eval.compressed: compressed-tensors artifacts streamed a module at a time, with the metrics of
the artifact loaded whole through transformers (quantkit.formats.gate.load_artifact), activation
quantization included.

Artifacts are written by quantkit itself from the session's micro Llama: fp8 dynamic (W8A8 float,
per-token activations), fp8 static (a stored input_scale), fp8 block (128x128 weight blocks, activations
per token and group of 128), gptq W4A16 (packed int4), gptq asymmetric
(packed zero points) and smoothquant W8A8 (int8 weights, per-token int8 activations).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from quantkit.engines.transformers import hf_config
from quantkit.errors import ArtifactReloadError
from quantkit.eval import compressed, evaluate, scorers
from quantkit.formats import gate

REL = 1e-4
CALIB = ["--num-samples", "16", "--seq-len", "64"]
ARTIFACTS = {
    "fp8": ["--method", "fp8"],
    "fp8-static": ["--method", "fp8", "--scheme", "fp8-static", *CALIB],
    "fp8-block": ["--method", "fp8", "--scheme", "fp8-block"],
    "gptq": ["--method", "gptq", *CALIB],
    "gptq-asym": ["--method", "gptq", "--asymmetric", *CALIB],
    "smoothquant": ["--method", "smoothquant", *CALIB],
}
ACTIVATIONS_QUANTIZED = {"fp8", "fp8-static", "fp8-block", "smoothquant"}
SLOW = {"fp8-static", "gptq-asym"}  # a second scheme of the same compressor (stored input_scale, packed zero points)


def names(*chosen: str) -> list:
    return [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in chosen]


@pytest.fixture(scope="module")
def built(cli, micro_model, tmp_path_factory):
    """name -> artifact directory, each written once for the module."""
    root, done = tmp_path_factory.mktemp("compressed"), {}

    def get(name: str) -> Path:
        if name not in done:
            out = root / name
            result = cli("quantize", micro_model, "-o", out, "--eval-windows", "0", *ARTIFACTS[name])
            assert result.exit_code == 0, result.output
            done[name] = out
        return done[name]

    return get


@pytest.fixture(scope="module")
def windows():
    return torch.randint(0, 500, (5, 64), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def baseline(micro_model, windows):
    return evaluate.compute_baseline(scorers.checkpoint_scorer(micro_model), windows)


def assert_same_metrics(a: evaluate.Metrics, b: evaluate.Metrics) -> None:
    assert a.positions == b.positions
    for name in ("ppl", "kld_mean", "kld_p99", "top1"):
        assert getattr(a, name) == pytest.approx(getattr(b, name), rel=REL, abs=1e-9), name


def loading_refused(*args, **kwargs):
    raise AssertionError("the artifact was loaded whole")


@pytest.mark.parametrize("name", names(*ARTIFACTS))
def test_streamed_gate_equals_the_loaded_artifact(name, built, micro_model, windows, baseline, monkeypatch):
    path = built(name)
    loaded = evaluate.compare(gate.loaded_scorer(path, micro_model), windows, baseline)
    monkeypatch.setattr(gate, "load_artifact", loading_refused)
    streamed = gate.evaluate_artifact(path, micro_model, windows, baseline)  # the gate's own call
    assert_same_metrics(streamed, loaded)
    assert loaded.kld_mean > 0


@pytest.mark.parametrize("name", ["fp8", "fp8-block", "smoothquant", "gptq"])
def test_activation_quantization_is_part_of_the_streamed_forward(name, built, windows, baseline, monkeypatch):
    """With the input quantization switched off, W8A8 artifacts measure differently (the loaded
    artifact quantizes activations, so the streamed forward must); a weight-only artifact does not."""
    path = built(name)
    streamed = evaluate.compare(compressed.compressed_scorer(path), windows, baseline)
    real = compressed.quantized_meta_model

    def weights_only(config, dtype):
        model = real(config, dtype)
        for module in compressed.quantized(model).values():
            module.quantization_enabled = False
        return model

    monkeypatch.setattr(compressed, "quantized_meta_model", weights_only)
    dequantized = evaluate.compare(compressed.compressed_scorer(path), windows, baseline)
    if name in ACTIVATIONS_QUANTIZED:
        assert streamed.kld_mean != pytest.approx(dequantized.kld_mean, rel=1e-3)
    else:
        assert_same_metrics(streamed, dequantized)


@pytest.mark.parametrize("name", names("fp8", "fp8-block", "gptq", "gptq-asym", "smoothquant"))
def test_weights_are_compressed_tensors_own_decompression(name, built):
    """A quantized module's weight equals the one transformers' loading decompresses it to, in the
    Hugging Face shape; unquantized tensors are the stored ones."""
    from compressed_tensors.compressors.base import decompress_module

    path = built(name)
    model = gate.load_artifact(path)
    source = compressed.CompressedWeights(path, compressed.quantized_meta_model(hf_config(path),
                                                                                torch.bfloat16))
    proj = model.model.layers[1].mlp.down_proj
    decompress_module(proj)
    got = source.get("model.layers.1.mlp.down_proj.weight")
    assert torch.equal(got, proj.weight) and source.shape("model.layers.1.mlp.down_proj.weight") == tuple(got.shape)
    assert torch.equal(source.get("model.norm.weight"), model.model.norm.weight)
    assert torch.equal(source.rows("lm_head.weight", [3, 7]), model.lm_head.weight[[3, 7]])


def test_modules_are_decompressed_one_at_a_time(built, windows, monkeypatch):
    """At every torch call inside the forwards the parameters off the meta device are one module's
    (its dequantized weight) or the embedding's rows for the windows: never the artifact whole."""
    path, models, peak = built("gptq"), [], [0]
    real = compressed.quantized_meta_model

    def capture(config, dtype):
        models.append(real(config, dtype))
        return models[-1]

    class Count(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            if models:
                peak[0] = max(peak[0], sum(p.numel() for p in models[0].parameters() if not p.is_meta))
            return func(*args, **(kwargs or {}))

    monkeypatch.setattr(compressed, "quantized_meta_model", capture)
    with Count():
        evaluate.compute_baseline(compressed.compressed_scorer(path), windows)
    model = models[0]
    largest = max(p.numel() for p in model.get_decoder().layers.parameters())
    assert peak[0] == max(largest, len(windows.unique()) * model.config.hidden_size)
    assert all(p.is_meta for p in model.parameters())


def edited(path: Path, dest: Path, edit) -> Path:
    """A copy of the artifact whose config.json is `edit`ed in place."""
    shutil.copytree(path, dest)
    config = json.loads((dest / "config.json").read_text())
    edit(config)
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def test_which_artifacts_stream(built, tmp_path):
    fp8 = built("fp8")
    config = json.loads((fp8 / "config.json").read_text())
    assert compressed.streamable(config) and compressed.streams(fp8)

    def variant(**changes) -> dict:
        return {**config, "quantization_config": {**config["quantization_config"], **changes}}

    assert not compressed.streamable(variant(kv_cache_scheme={"num_bits": 8, "type": "float"}))
    assert not compressed.streamable(variant(transform_config={"config_groups": {"u": {}}}))
    assert not compressed.streamable(variant(quant_method="bitsandbytes"))
    assert not compressed.streamable({**config, "model_type": "mixtral", "architectures": ["MixtralForCausalLM"]})
    assert not compressed.streamable({**config, "architectures": ["LlavaForConditionalGeneration"],
                                      "vision_config": {}})
    # The head quantized (fp8's quantize_lm_head: "lm_head" left out of ignore): applied in vocabulary
    # slices outside its module's forward, it could not quantize its input, so the artifact loads whole.
    head = edited(fp8, tmp_path / "head", lambda c: c["quantization_config"].update(ignore=[]))
    assert compressed.streamable(json.loads((head / "config.json").read_text())) and not compressed.streams(head)
    # A format whose compressor is not one decompressed here (NVFP4's global scales): loaded whole.
    nvfp4 = edited(fp8, tmp_path / "nvfp4",
                   lambda c: c["quantization_config"]["config_groups"]["group_0"].update(format="nvfp4-pack-quantized"))
    assert not compressed.streams(nvfp4)


def rewritten(path: Path, dest: Path, edit) -> Path:
    """A copy of the artifact whose tensors are `edit`ed (a dict, in place)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(path, dest)
    tensors = load_file(dest / "model.safetensors")
    edit(tensors)
    save_file(tensors, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


def test_an_artifact_that_does_not_reload_strictly_fails_the_gate(built, micro_model, windows, baseline, tmp_path):
    """As for the loaded artifact (artifacts.check_strict_reload): exit 3, naming the tensors."""
    gptq = built("gptq")
    lacking = rewritten(gptq, tmp_path / "lacking",
                        lambda t: t.pop("model.layers.0.self_attn.k_proj.weight_scale"))
    extra = rewritten(gptq, tmp_path / "extra",
                      lambda t: t.update({"model.layers.0.mlp.experts.0.w1.weight": torch.zeros(2, 2)}))
    for path, words in ((lacking, "1 missing (model.layers.0.self_attn.k_proj.weight_scale)"),
                        (extra, "1 unexpected (model.layers.0.mlp.experts.0.w1.weight)")):
        assert compressed.streams(path)
        with pytest.raises(ArtifactReloadError) as err:
            gate.evaluate_artifact(path, micro_model, windows, baseline)
        assert err.value.exit_code == 3 and words in err.value.message
