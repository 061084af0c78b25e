"""quantkit.eval.experts: the gate's reading of MoE checkpoints and artifacts, each expert decompressed and stacked as
transformers stacks them, against transformers' own loading: the 16-bit base, an artifact transformers reloads
(fp8-dynamic experts), and the FP4 and fp8-block artifacts it cannot reload (against their weights decompressed by
compressed-tensors into a 16-bit checkpoint transformers loads)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from quantkit.eval import experts, scorers
from quantkit.eval.resident import resident_built
from quantkit.eval.stream import streamed_logits
from quantkit.formats import gate
from quantkit.io.checkpoint import check_model_dir

IDS = torch.randint(0, 500, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    from quantkit.toy_moe import build_moe

    root = tmp_path_factory.mktemp("moe")
    return {kind: build_moe(kind, root / kind) for kind in ("deepseek_v3", "qwen3_moe")}


def resident_logits(reading):
    model, source = reading.open()
    with torch.no_grad():
        return resident_built(model, reading.config, source, "cpu").model(IDS).logits.float()


def transformers_logits(path: Path, dtype=None):
    from transformers import AutoModelForCausalLM

    with torch.no_grad():
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()(IDS).logits.float()


def read_in_float32(path: Path) -> None:
    """The artifact's config.json says float32: quantkit's reading builds the model and decompresses into it at
    float32 (the stored values are the same)."""
    import json

    config = json.loads((path / "config.json").read_text())
    config["dtype"] = "float32"
    (path / "config.json").write_text(json.dumps(config))


def artifact(info, scheme, out: Path) -> Path:
    from quantkit.engines.llmcompressor import model_free, model_free_moe
    from quantkit.engines.transformers import load_tokenizer
    from quantkit.methods import ignore_patterns

    plan = model_free_moe.plan_moe(info, scheme, ignore_patterns(info, []))
    out.mkdir(parents=True)
    model_free.write_weights(plan, out)
    model_free_moe.write_config(plan, info.path, out)
    load_tokenizer(info).save_pretrained(out)
    return out


def scheme_of(name: str):
    from compressed_tensors.quantization import QuantizationScheme

    from quantkit.engines.llmcompressor.model_free_moe import preset_scheme
    from quantkit.methods import fp8

    if name in ("fp8-block", "fp8-dynamic"):
        return QuantizationScheme(**fp8.scheme_config(fp8.Options(scheme=name))["group_0"])
    return preset_scheme(name)


def dequantized(path: Path, source, out: Path) -> Path:
    """The artifact's every weight decompressed by compressed-tensors (the reading's source), as a 16-bit checkpoint."""
    from safetensors.torch import save_file

    out.mkdir()
    for file in path.iterdir():
        if file.suffix != ".safetensors" and file.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(file, out / file.name)
    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config")
    (out / "config.json").write_text(json.dumps(config))
    weights = source.weights
    state = {name: weights.get(name).contiguous() for name in weights.keys()
             if name in weights.modules or not any(name.rsplit(".", 1)[0] + ".weight" == m for m in weights.modules)}
    save_file({k: v.to(torch.bfloat16) if v.dtype == torch.float32 and "e_score" not in k else v
               for k, v in state.items()}, out / "model.safetensors", metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("kind", ["deepseek_v3", "qwen3_moe"])
def test_the_base_reads_as_transformers_loads_it(moe_models, kind):
    """Resident and streamed a unit at a time (a layer's fused experts one unit), the router's float32 correction
    bias read (the stream computes buffers otherwise)."""
    info = check_model_dir(moe_models[kind])
    reading = scorers.base_reading(info)
    expected = transformers_logits(info.path)
    assert torch.equal(resident_logits(reading), expected)
    assert torch.equal(streamed_logits(scorers.streamed_reading(reading, "cpu"), IDS), expected)


def test_an_artifact_transformers_reloads_reads_the_same(moe_models, tmp_path):
    """fp8-dynamic experts, which transformers 5 dequantizes into its fused experts and runs on 16-bit inputs: with
    the experts' activation quantization switched off the reading's logits are transformers' exactly; on (the
    gate), each expert's inputs are quantized per token as vLLM's fused-MoE kernel quantizes them."""
    path = artifact(check_model_dir(moe_models["qwen3_moe"]), scheme_of("fp8-dynamic"), tmp_path / "fp8")
    assert experts.reads(path)
    with torch.no_grad():
        expected = gate.load_artifact(path)(IDS).logits.float()
    reading = gate.artifact_reading(path)
    model, source = reading.open()
    expert_linears = [m for n, m in model.named_modules() if ".experts." in n and hasattr(m, "quantization_scheme")]
    assert expert_linears
    with torch.no_grad():
        gated = resident_built(model, reading.config, source, "cpu").model(IDS).logits.float()
        for module in expert_linears:
            module.quantization_enabled = False
        weights_only = resident_built(model, reading.config, source, "cpu").model(IDS).logits.float()
    assert torch.equal(weights_only, expected)
    assert not torch.equal(gated, expected)


@pytest.mark.parametrize("kind,scheme", [("deepseek_v3", "NVFP4A16"), ("qwen3_moe", "MXFP4A16"),
                                         ("deepseek_v3", "fp8-block")])
def test_experts_transformers_cannot_reload_read_as_their_decompressed_weights(moe_models, tmp_path, kind, scheme):
    """NVFP4 (global scales), MXFP4 and fp8-block (its block scales fail transformers' reload): the reading's logits
    are those of the weights compressed-tensors decompresses, saved as 16-bit and loaded by transformers; for
    fp8-block with compressed-tensors' activation quantization switched off (it is on in the gate, as vLLM quantizes
    them). Both at float32, equal to float32 rounding: the reading runs each expert as its own Linear (llm-compressor's
    linear experts), whose sums round otherwise than transformers' fused experts."""
    path = artifact(check_model_dir(moe_models[kind]), scheme_of(scheme), tmp_path / "artifact")
    read_in_float32(path)
    reading = gate.artifact_reading(path)
    model, source = reading.open()
    if scheme == "fp8-block":
        quantized = [m for m in model.modules() if getattr(m, "quantization_scheme", None) is not None]
        assert quantized
        for module in quantized:
            module.quantization_enabled = False
    with torch.no_grad():
        ours = resident_built(model, reading.config, source, "cpu").model(IDS).logits.float()
    theirs = transformers_logits(dequantized(path, source, tmp_path / "16bit"), torch.float32)
    assert (ours - theirs).abs().max() < 1e-5 * theirs.abs().max()  # float32 rounding; a wrong scale: percents


def test_a_missing_expert_tensor_fails_the_strict_reload(moe_models, tmp_path):
    from safetensors.torch import load_file, save_file

    from quantkit.errors import ArtifactReloadError

    path = artifact(check_model_dir(moe_models["qwen3_moe"]), scheme_of("MXFP4A16"), tmp_path / "artifact")
    state = load_file(path / "model.safetensors")
    del state["model.layers.1.mlp.experts.2.up_proj.weight_scale"]
    save_file(state, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ArtifactReloadError, match="experts.2.up_proj.weight_scale"):
        gate.artifact_reading(path).open()
