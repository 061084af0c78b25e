"""VLMs end to end on tiny local models: the plan keeps the vision tower and projector in 16-bit,
fp8 quantizes only the text decoder, the artifact reloads in transformers (AutoModelForImageTextToText)
and the gate scores the text path on text-only token windows."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from tests.util import FAST_CALIB, leftovers
from tests.vlm_models import build_llava, build_qwen2_vl

# The text models here are random (flat next-token distributions): top-1 flips on near-ties, so
# only top-1 is loosened; perplexity and KL stay at the fp8 defaults.
VLM_CALIB = (*FAST_CALIB, "--min-top1", "0.5")

# Checkpoint-name prefixes of the modules that must stay 16-bit, per model.
KEPT_PREFIXES = {
    "llava": ("vision_tower.", "multi_modal_projector."),
    "qwen2_vl": ("visual.",),
}


@pytest.fixture(scope="session")
def llava_model(tmp_path_factory):
    return build_llava(tmp_path_factory.mktemp("vlm") / "llava")


@pytest.fixture(scope="session")
def qwen2_vl_model(tmp_path_factory):
    return build_qwen2_vl(tmp_path_factory.mktemp("vlm") / "qwen2_vl")


@pytest.fixture(params=["llava", "qwen2_vl"])
def vlm(request):
    """(kind, model dir) for each tiny VLM."""
    return request.param, request.getfixturevalue(f"{request.param}_model")


@pytest.fixture(scope="session")
def fp8_artifacts(tmp_path_factory, cli):
    """Quantize each VLM once through the CLI (fp8 dynamic); tests share the outputs."""
    made = {}

    def get(kind: str, model_dir):
        if kind not in made:
            parent = tmp_path_factory.mktemp(f"{kind}-fp8")
            out = parent / "fp8"
            result = cli("quantize", model_dir, "--method", "fp8", "-o", out, "--json", parent / "r.json", *VLM_CALIB)
            made[kind] = (result, out, parent)
        return made[kind]

    return get


def test_inspect_keeps_towers_16bit(cli, vlm):
    kind, model_dir = vlm
    result = cli("inspect", model_dir, "--method", "fp8", "--json", "-")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    roles = data["roles"]
    assert data["architecture"].endswith("ForConditionalGeneration")
    assert set(roles["vision"]["precisions"]) == {"bf16 (kept: vision stays 16-bit)"}
    assert set(roles["decoder"]["precisions"]) == {"fp8-e4m3 W/channel A/token"}
    assert roles["decoder"]["modules"] == 14  # 2 layers x (q, k, v, o, gate, up, down)
    assert set(roles["lm_head"]["precisions"]) == {"bf16 (kept: lm_head)"}
    if kind == "llava":
        assert set(roles["projector"]["precisions"]) == {"bf16 (kept: projector stays 16-bit)"}
        assert roles["projector"]["modules"] == 2
    else:  # Qwen2-VL: the projector (visual.merger) lives inside the vision tower; its own role
        assert any(m["name"].endswith("visual.merger.mlp.0") and m["role"] == "projector" for m in data["modules"])
    tower = "vision_tower" if kind == "llava" else "visual"
    assert "lm_head" in data["ignore"] and any(tower in p for p in data["ignore"])
    for module in data["modules"]:
        if module["name"].startswith(("model.vision_tower.", "model.multi_modal_projector.", "model.visual.")):
            assert "kept" in module["precision"], module


def test_inspect_with_vlm_recipe(cli, llava_model):
    result = cli("inspect", llava_model, "--recipe", "vlm-fp8", "--json", "-")
    assert result.exit_code == 0, result.output
    roles = json.loads(result.stdout)["roles"]
    assert "kept" in next(iter(roles["projector"]["precisions"]))
    assert "fp8" in next(iter(roles["decoder"]["precisions"]))


def test_fp8_end_to_end_keeps_towers_16bit(vlm, fp8_artifacts):
    kind, model_dir = vlm
    result, out, parent = fp8_artifacts(kind, model_dir)
    assert result.exit_code == 0, result.output
    report = json.loads((out / "quantkit.json").read_text())
    target = report["targets"][0]
    assert report["model"]["architecture"].endswith("ForConditionalGeneration")
    assert target["gate"]["passed"] and target["metrics"]["positions"] == 4 * 63  # text-only windows
    assert "vision" in target["kept"]
    assert target["quantized_modules"] == 14
    assert leftovers(parent, "fp8") == ["fp8"]
    for name in ("tokenizer.json", "config.json", "README.md"):
        assert (out / name).is_file()

    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qconfig["quant_method"] == "compressed-tensors" and qconfig["format"] == "float-quantized"
    ignore = qconfig["ignore"]
    assert "lm_head" in ignore  # module name, as transformers names it on reload
    kept = KEPT_PREFIXES[kind]
    with safe_open(out / "model.safetensors", "pt") as f:
        dtypes = {key: f.get_slice(key).get_dtype() for key in f.keys()}
        ndims = {key: len(f.get_slice(key).get_shape()) for key in f.keys()}
    tower = {k: d for k, d in dtypes.items() if k.startswith(kept)}
    assert tower and set(tower.values()) == {"BF16"}, tower
    assert not any(k.endswith(("weight_scale", "input_scale")) for k in tower)
    decoder = {k: d for k, d in dtypes.items() if k.endswith("_proj.weight") and ".layers." in k
               and not k.startswith(kept)}
    assert len(decoder) == 14 and set(decoder.values()) == {"F8_E4M3"}, decoder
    assert {d for k, d in dtypes.items() if k.endswith("lm_head.weight")} == {"BF16"}
    # every tower linear is named in `ignore`, in checkpoint form (vLLM) and module form (transformers)
    tower_linears = {k.removesuffix(".weight") for k in tower
                     if k.endswith(".weight") and ndims[k] == 2 and "embedding" not in k}
    assert tower_linears and tower_linears <= set(ignore), tower_linears - set(ignore)
    assert all(f"model.{name}" in ignore for name in tower_linears)


def test_fp8_reloads_in_transformers_close_to_base(vlm, fp8_artifacts):
    import torch
    from transformers import AutoModelForImageTextToText

    from quantkit.formats.gate import load_artifact

    kind, model_dir = vlm
    result, out, _ = fp8_artifacts(kind, model_dir)
    assert result.exit_code == 0, result.output
    ids = torch.randint(0, 500, (2, 48), generator=torch.Generator().manual_seed(0))
    base_model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32)
    quant_model = AutoModelForImageTextToText.from_pretrained(out)
    with torch.inference_mode():
        base = base_model(input_ids=ids).logits
        quant = quant_model(input_ids=ids).logits.float()
    assert torch.isfinite(quant).all()
    rel = (quant - base).norm() / base.norm()
    assert rel < 0.1, rel  # random text weights: ~0.075 here; the trained micro model stays under 0.05
    # the towers came back unquantized, with the base's weights
    base_params = dict(base_model.named_parameters())
    for name, param in quant_model.named_parameters():
        if name.startswith(("model.vision_tower.", "model.multi_modal_projector.", "model.visual.")):
            assert param.dtype == torch.bfloat16 and not name.endswith("_scale"), name
            assert torch.equal(param.float(), base_params[name]), name
    # quantkit's evaluator loads it through the same Auto class
    assert type(load_artifact(out)).__name__ == type(base_model).__name__


def test_fp8_llava_artifact_still_sees_images(llava_model, fp8_artifacts):
    import torch
    from transformers import AutoModelForImageTextToText

    result, out, _ = fp8_artifacts("llava", llava_model)
    assert result.exit_code == 0, result.output
    base_model = AutoModelForImageTextToText.from_pretrained(llava_model, dtype=torch.float32)
    quant_model = AutoModelForImageTextToText.from_pretrained(out, dtype=torch.float32)
    image_token = base_model.config.image_token_index
    ids = torch.tensor([[1] + [image_token] * 16 + list(range(10, 30))])
    pixels = torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        base = base_model(input_ids=ids, pixel_values=pixels).logits
        quant = quant_model(input_ids=ids, pixel_values=pixels).logits
    assert torch.isfinite(quant).all()
    assert (quant - base).norm() / base.norm() < 0.1


def test_is_vlm_rule():
    from quantkit.arch.vlm import is_vlm

    assert is_vlm({"architectures": ["LlavaForConditionalGeneration"], "vision_config": {}})
    assert not is_vlm({"architectures": ["LlamaForCausalLM"]})
    assert not is_vlm({"architectures": ["T5ForConditionalGeneration"]})


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llava", "qwen2_vl"])
def test_fp8_static_calibrates_on_text_windows(cli, kind, request, tmp_path):
    model_dir = request.getfixturevalue(f"{kind}_model")
    out = tmp_path / "static"
    result = cli("quantize", model_dir, "--method", "fp8", "--scheme", "fp8-static", "-o", out, *VLM_CALIB)
    assert result.exit_code == 0, result.output
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qconfig["config_groups"]["group_0"]["input_activations"]["dynamic"] is False
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = list(f.keys())
    scales = [k for k in keys if k.endswith("input_scale")]
    assert len(scales) == 14 and not any(k.startswith(KEPT_PREFIXES[kind]) for k in scales)


@pytest.mark.slow
@pytest.mark.parametrize("builder", [build_llava, build_qwen2_vl])
def test_trained_text_path_passes_the_fp8_gate(cli, builder, micro_model, tmp_path):
    """The micro toy model's trained weights inside a VLM: the gate on text windows means something."""
    model_dir = builder(tmp_path / "vlm", text_from=micro_model)
    out = tmp_path / "fp8"
    result = cli("quantize", model_dir, "--recipe", "vlm-fp8", "-o", out, *FAST_CALIB)
    assert result.exit_code == 0, result.output
    metrics = json.loads((out / "quantkit.json").read_text())["targets"][0]["metrics"]
    assert metrics["kld_mean"] < 0.01 and metrics["top1"] > 0.8
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    ids = torch.randint(0, 500, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        text_only = AutoModelForCausalLM.from_pretrained(micro_model, dtype=torch.float32)(input_ids=ids).logits
        quant = AutoModelForImageTextToText.from_pretrained(out)(input_ids=ids).logits.float()[..., : text_only.shape[-1]]
    assert (quant - text_only).norm() / text_only.norm() < 0.05


@pytest.mark.slow
def test_gptq_vlm_recipe_quantizes_only_the_text_decoder(cli, llava_model, tmp_path):
    out = tmp_path / "w4"
    result = cli("quantize", llava_model, "--recipe", "vlm-w4a16", "-o", out, "--num-samples", "16",
                 "--seq-len", "64", "--eval-windows", "4", "--min-top1", "0.5")
    assert result.exit_code == 0, result.output
    with safe_open(out / "model.safetensors", "pt") as f:
        names = list(f.keys())
    packed = [n for n in names if n.endswith("weight_packed")]
    assert len(packed) == 14 and all("layers" in n and "vision" not in n for n in packed)
    assert not any(n.startswith(KEPT_PREFIXES["llava"]) and "packed" in n for n in names)
    assert leftovers(tmp_path, "w4") == ["w4"]


@pytest.mark.parametrize("method", [pytest.param("awq", marks=pytest.mark.slow), "smoothquant"])  # awq on a VLM: test_vlm_families
def test_smoothing_methods_smooth_only_the_language_model(cli, llava_model, tmp_path, method):
    """AWQ/SmoothQuant on a VLM: the language model's norms are rescaled, every tower tensor is stored
    unchanged (the proof in the report), and the image+text forward runs on the reloaded artifact."""
    out = tmp_path / "out"
    result = cli("quantize", llava_model, "--method", method, "-o", out, "--num-samples", "16",
                 "--seq-len", "64", "--eval-windows", "4", "--no-gate", "--json", tmp_path / "r.json")
    assert result.exit_code == 0, result.output
    proof = json.loads((out / "quantkit.json").read_text())["targets"][0]["details"]["towers"]
    assert proof["tower_tensors_identical"] > 0 and proof["image_forward"] == "ran"
    with safe_open(llava_model / "model.safetensors", "pt") as src, safe_open(out / "model.safetensors", "pt") as dst:
        norms = [n for n in src.keys() if n.endswith("layernorm.weight") or "layer_norm" in n]
        changed = {n for n in norms if not src.get_tensor(n).equal(dst.get_tensor(n))}
    assert changed and all("language_model" in n for n in changed)
    assert any("vision_tower" in n for n in norms)


# ---------------------------------------------------------------- towers quantized on request


@pytest.mark.slow
def test_towers_int8_on_request_are_rounded_not_changed(cli, qwen2_vl_model, tmp_path):
    """gptq with `--vision int8 --projector int8`: the towers' Linear weights go to their own int8
    config group (round-to-nearest, before GPTQ), the proof checks them within half a step of the
    source after reload and every other tower tensor bit-identical; report and card say so."""
    out = tmp_path / "out"
    result = cli("quantize", qwen2_vl_model, "--method", "gptq", "--vision", "int8", "--projector", "int8",
                 "-o", out, "--num-samples", "16", "--seq-len", "64", "--eval-windows", "4", "--no-gate")
    assert result.exit_code == 0, result.output
    proof = json.loads((out / "quantkit.json").read_text())["targets"][0]["details"]["towers"]
    assert proof["tower_precision"] == {"vision": "int8", "projector": "int8"} and proof["forced"] is False
    assert proof["tower_weights_quantized"] > 0 and proof["tower_tensors_identical"] > 0
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    bits = {g["weights"]["num_bits"]: g["targets"] for g in qconfig["config_groups"].values()}
    assert bits[4] == ["Linear"] and all("visual" in name for name in bits[8])
    assert any("merger" in name for name in bits[8]) and any("blocks" in name for name in bits[8])
    assert not any("visual" in pattern for pattern in qconfig["ignore"])
    assert "quantized on request, round-to-nearest weights: vision int8, projector int8" in (out / "README.md").read_text()


def test_projector_alone_int8_keeps_the_vision_tower_around_it(cli, qwen2_vl_model, tmp_path):
    """Qwen2-VL's projector (`visual.merger`) sits inside the vision tower: quantizing it alone leaves
    every other `visual.` tensor bit-identical, and the ignore list keeps the tower but not the merger."""
    out = tmp_path / "out"
    result = cli("quantize", qwen2_vl_model, "--method", "fp8", "--projector", "int8", "-o", out, *VLM_CALIB)
    assert result.exit_code == 0, result.output
    qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
    tower_targets = [t for g in qconfig["config_groups"].values() for t in g["targets"] if t != "Linear"]
    assert tower_targets and all("visual.merger" in t for t in tower_targets)
    proof = json.loads((out / "quantkit.json").read_text())["targets"][0]["details"]["towers"]
    assert proof["tower_weights_quantized"] == len(tower_targets)


def test_four_bit_towers_need_force(cli, llava_model, tmp_path):
    out = tmp_path / "out"
    refused = cli("quantize", llava_model, "--method", "fp8", "--vision", "int4", "-o", out, *VLM_CALIB)
    assert refused.exit_code == 2 and "vision: int4 refused" in refused.stderr and "--force" in refused.stderr
    assert leftovers(tmp_path, "out") == []
    forced = cli("quantize", llava_model, "--method", "fp8", "--vision", "int4", "--force", "-o", out,
                 "--num-samples", "16", "--seq-len", "64", "--eval-windows", "4", "--no-gate")
    assert forced.exit_code == 0, forced.output
    proof = json.loads((out / "quantkit.json").read_text())["targets"][0]["details"]["towers"]
    assert proof["forced"] is True and proof["tower_weights_quantized"] > 0
    assert "4-bit towers allowed with --force" in (out / "README.md").read_text()


@pytest.mark.parametrize("method,model,message", [
    ("nf4", "llava_model", "vision: int8 is not available with nf4"),
    ("gguf", "llava_model", "not available with gguf"),
    ("fp8", "micro_model", "has no vision in quantkit's VLM table"),
])
def test_tower_precision_refused_before_work(cli, request, tmp_path, method, model, message):
    out = tmp_path / "out"
    result = cli("quantize", request.getfixturevalue(model), "--method", method, "--vision", "int8", "-o", out,
                 *VLM_CALIB)
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert leftovers(tmp_path, "out") == []


def test_rounding_bound_catches_a_wrong_scale():
    import torch

    from quantkit.eval.vlm_proof import within_rounding

    weight = torch.randn(16, 32, dtype=torch.bfloat16)
    step = weight.float().abs().amax(dim=1, keepdim=True) / 127
    rounded = (torch.round(weight.float() / step) * step).to(torch.bfloat16)
    assert within_rounding(rounded, weight, 8)
    assert not within_rounding(rounded * 0.9, weight, 8)
    assert not within_rounding(torch.zeros_like(weight), weight, 8)
