"""Every VLM family of quantkit.arch.vlm.FAMILIES through every method via the CLI: exit 0 with the towers
bit-identical after reload (and an image+text forward where the fixture has a processor), or exit 2
before any work with the reason. Full matrix slow; Mllama gptq (a Linear projector), Gemma 3 gptq
(SigLIP's MultiheadAttention pooling head), Gemma 3 awq/smoothquant (smoothed inside its language model)
and the Mllama smoothing refusal are fast."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from tests.util import leftovers
from tests.vlm_models import FAMILY_KINDS, PROCESSOR_KINDS, build_family

CALIB = ("--num-samples", "16", "--seq-len", "64", "--eval-windows", "4", "--no-gate")
METHODS = ("fp8", "gptq", "awq", "autoround", "smoothquant", "nf4", "gguf", "nvfp4", "mxfp4", "mlx")


def test_the_matrix_covers_the_readme_families():
    from quantkit.arch.families import vlm_rows

    assert FAMILY_KINDS == tuple(family.model_type for family in vlm_rows())


@pytest.fixture(scope="session")
def family_model(tmp_path_factory):
    made = {}

    def get(kind: str):
        if kind not in made:
            made[kind] = build_family(kind, tmp_path_factory.mktemp("families") / kind)
        return made[kind]

    return get


def with_image_stats(model_dir, tmp_path):
    """The Qwen fixtures ship no processor files (Qwen's processor needs torchvision); a Qwen
    checkpoint's preprocessor_config.json gives the image_mean / image_std the mmproj needs."""
    import shutil

    from tests.gguf.vlms import QWEN_PREPROCESSOR

    if (model_dir / "preprocessor_config.json").is_file() or (model_dir / "processor_config.json").is_file():
        return model_dir
    copy = shutil.copytree(model_dir, tmp_path / model_dir.name)
    (copy / "preprocessor_config.json").write_text(json.dumps(QWEN_PREPROCESSOR))
    return copy


def tensors(path) -> dict:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def run_case(cli, model_dir, kind: str, method: str, tmp_path):
    """What docs/models.md's VLM table says for (family, method): exit 2 before work, or exit 0 with the proof."""
    from quantkit.run.support import verdict

    out = tmp_path / "out"
    if method == "gguf":
        model_dir = with_image_stats(model_dir, tmp_path)
    result = cli("quantize", model_dir, "--method", method, "-o", out, "--json", tmp_path / "r.json", *CALIB)
    if verdict(kind, method).startswith("refused"):
        assert result.exit_code == 2, result.output
        assert leftovers(tmp_path, "out") == []
        assert "error: " in result.stderr and (method == "gguf" or method in result.stderr)  # the method's own check
        return None
    assert result.exit_code == 0, result.output
    report = json.loads((out / "quantkit.json").read_text())
    proof = report["targets"][0]["details"]["towers"]
    if method == "gguf":  # the towers are in the mmproj .gguf beside the language model
        assert (out / proof["mmproj"]).is_file() and proof["tensors"] > 0
        from quantkit.io.checkpoint import check_model_dir

        towers = check_model_dir(model_dir).towers
        assert proof["tower_tensors_covered"] == len([n for n in tensors(model_dir) if towers.role(n)])
        assert f"FROM ./{proof['mmproj']}" in (out / "Modelfile").read_text()
        return out
    assert proof["tower_tensors_identical"] > 0
    # Gemma 4's processor needs torchvision, which the test machines lack: the forward is skipped, saying why
    assert proof["image_forward"].startswith("ran" if kind in PROCESSOR_KINDS else
                                             "skipped: its processor cannot be loaded here (" if kind == "gemma4" else
                                             "skipped: the artifact has no processor files")
    assert report["model"]["towers"]["model_type"] == kind
    # the checkpoint itself: every tower tensor of the source is stored unchanged
    source, written = tensors(model_dir), tensors(out)
    from quantkit.io.checkpoint import check_model_dir

    towers = check_model_dir(model_dir).towers
    kept = [k for k in source if towers.role(k)]
    assert kept and all(k in written and written[k].dtype == source[k].dtype and written[k].equal(source[k])
                        for k in kept)
    if kind in PROCESSOR_KINDS:
        assert (out / "processor_config.json").is_file() and (out / "chat_template.jinja").is_file()
    assert "## Vision-language model" in (out / "README.md").read_text()
    return out


@pytest.mark.parametrize("kind,method", [pytest.param("mllama", "gptq", marks=pytest.mark.slow),
                                         pytest.param("gemma3", "gptq", marks=pytest.mark.slow),
                                         pytest.param("gemma3", "awq", marks=pytest.mark.slow),
                                         pytest.param("gemma3", "smoothquant", marks=pytest.mark.slow),
                                         ("mllama", "awq"), ("gemma3", "mlx"), ("qwen3_5_moe", "fp8"),
                                         ("qwen3_5_moe", "awq")])
def test_representative_family_cases(cli, family_model, tmp_path, kind, method):
    out = run_case(cli, family_model(kind), kind, method, tmp_path)
    if kind == "qwen3_5_moe" and out is not None:  # a VLM's mixture of experts: every expert fp8, the routers not
        stored = {k: v.dtype for k, v in tensors(out).items()}
        experts = [k for k in stored if ".mlp.experts." in k and k.endswith("proj.weight")]
        assert len(experts) == 2 * 4 * 3 and all(str(stored[k]) == "torch.float8_e4m3fn" for k in experts)
        assert all(str(stored[k]) == "torch.bfloat16" for k in stored if k.endswith(("mlp.gate.weight",
                                                                                      "shared_expert_gate.weight")))
    if kind == "mllama" and out is not None:  # the projector is one Linear: stored 16-bit, not packed
        qconfig = json.loads((out / "config.json").read_text())["quantization_config"]
        assert "model.multi_modal_projector" in qconfig["ignore"] or any(
            p.startswith("re:") and "multi_modal_projector" in p for p in qconfig["ignore"])
        assert "multi_modal_projector.weight" in tensors(out)


@pytest.mark.slow
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("kind", FAMILY_KINDS)
def test_family_method_matrix(cli, family_model, tmp_path, kind, method):
    run_case(cli, family_model(kind), kind, method, tmp_path)


@pytest.mark.parametrize("flags,words", [(("--method", "fp8", "--scheme", "fp8-block"), "fp8-block's 128x128"),
                                         (("--method", "gptq", "--asymmetric"), "zero points"),
                                         (("--method", "nvfp4"), "NVFP4's global scales")])
def test_a_vlm_s_experts_refuse_what_transformers_cannot_reload(cli, family_model, tmp_path, flags, words):
    """Its towers are proven on transformers' reload of the artifact: expert scales that reload cannot decompress
    are refused before work, naming them."""
    out = tmp_path / "out"
    result = cli("quantize", family_model("qwen3_5_moe"), *flags, "-o", out, *CALIB)
    assert result.exit_code == 2, result.output
    assert words in result.stderr and "Qwen3_5MoeForConditionalGeneration" in result.stderr
    assert leftovers(tmp_path, "out") == []


def test_changed_tower_tensor_fails_the_proof(cli, family_model, tmp_path):
    """A tower tensor altered in the written artifact: the proof names it (exit 3 in a run)."""
    from safetensors.torch import save_file

    from quantkit.errors import TowerChangedError
    from quantkit.eval.vlm_proof import prove_towers
    from quantkit.formats.gate import load_artifact
    from quantkit.io.checkpoint import check_model_dir

    model_dir = family_model("mllama")
    out = tmp_path / "out"
    assert cli("quantize", model_dir, "--method", "fp8", "-o", out, *CALIB).exit_code == 0
    info = check_model_dir(model_dir)
    assert prove_towers(load_artifact(out), out, info)["image_forward"] == "ran"
    state = tensors(out)
    state["multi_modal_projector.weight"] = state["multi_modal_projector.weight"] * 2
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(TowerChangedError, match=r"1 of \d+ tower/projector tensors changed.*multi_modal_projector"):
        prove_towers(load_artifact(out), out, info)
    assert TowerChangedError.exit_code == 3


def test_inspect_names_the_towers(cli, family_model):
    result = cli("inspect", family_model("mllama"), "--method", "gptq", "--json", "-")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["towers"]["family"] == "Llama 3.2 Vision (Mllama)"
    assert data["towers"]["projector"] == ["multi_modal_projector"] and data["towers"]["unknown_towers"] == []
    projector = next(m for m in data["modules"] if m["name"] == "multi_modal_projector")
    assert projector["role"] == "projector" and "kept" in projector["precision"]


@pytest.mark.parametrize("option,message", [
    ("--vision", "vision: int8 refused for Gemma 3: transformers' SigLIP initializer reads q_proj.weight"),
    ("--projector", "projector: Gemma3ForConditionalGeneration has no linear layer there to quantize"),
])
def test_gemma3_towers_that_cannot_be_quantized_are_refused_before_work(cli, family_model, tmp_path, option, message):
    """SigLIP towers quantized do not reload in transformers, and Gemma 3's projector is a bare weight
    matrix, not a Linear: both refused before any work, not after quantizing."""
    out = tmp_path / "out"
    result = cli("quantize", family_model("gemma3"), "--method", "fp8", option, "int8", "-o", out, *CALIB)
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert leftovers(tmp_path, "out") == []


def test_plan_sizes_a_vlm_the_gguf_converter_does_not_take(cli, family_model):
    """Mllama has no llama.cpp conversion: the gguf row falls back to the per-role default types
    ("Q4_K (Q4_K_M mix)") and is sized from them, not an internal error."""
    result = cli("plan", family_model("mllama"), "--json", "-")
    assert result.exit_code == 0, result.output
    rows = {row["method"]: row["weights_bytes"] for row in json.loads(result.stdout)["formats"]}
    assert 0 < rows["gguf"] < rows["fp8"] < rows["source"]
