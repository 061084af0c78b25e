"""MoE checkpoints quantized model-free, by checkpoint names (quantkit.engines.llmcompressor.model_free_moe): fp8-block,
nvfp4 a16 and mxfp4 on synthetic DeepSeek-V3- and Qwen3-MoE-shaped checkpoints (quantkit.toy_moe).

Every tensor is llm-compressor's own model-free converter's output for the same tensor, bit for bit (a slab at a
time, shards cut small); a fused NVFP4 set is what the converter writes for the same tensors under names its fused
patterns see, so an expert's gate/up share one global scale, which llm-compressor's model_free_ptq does not give
them; what is quantized and kept, the config written, the preflight's memory, and `quantkit quantize` end to end.
tests/serve/test_moe_vllm_slow.py checks the artifacts against vLLM's loader code."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from quantkit.engines.llmcompressor import model_free, model_free_moe
from quantkit.io.checkpoint import check_model_dir
from quantkit.methods import ignore_patterns
from tests.methods.conftest import CALIB_ARGS, assert_nothing_written, quant_config, report

LOOSE_GATE = ["--max-kld", "1", "--max-ppl-increase", "1", "--min-top1", "0"]  # random weights
# scheme -> (quantkit quantize arguments, how the scheme is built)
SCHEMES = {"fp8-block": ["--method", "fp8", "--scheme", "fp8-block"], "nvfp4-a16": ["--method", "nvfp4", "--scheme",
                                                                                   "a16"], "mxfp4": ["--method", "mxfp4"]}
# the names llm-compressor's model-free converter fuses (microscale.DEFAULT_FUSED_MAPPINGS), for each fused set
ALIASES = {("gate_proj", "up_proj"): ("alias.mlp.gate_proj", "alias.mlp.up_proj"),
           ("q_proj", "k_proj", "v_proj"): ("alias.self_attn.q_proj", "alias.self_attn.k_proj", "alias.self_attn.v_proj"),
           ("q_a_proj", "kv_a_proj_with_mqa"): ("alias.self_attn.wq_a", "alias.self_attn.wkv_a_with_mqa")}


def scheme_of(name: str):
    from compressed_tensors.quantization import QuantizationScheme

    from quantkit.methods import fp8

    if name == "fp8-block":
        return QuantizationScheme(**fp8.block_scheme_config()["group_0"])
    return model_free_moe.preset_scheme({"nvfp4-a16": "NVFP4A16", "mxfp4": "MXFP4A16"}[name])


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """kind -> a tiny synthetic checkpoint (quantkit.toy_moe), built on first use."""
    from quantkit.toy_moe import build_moe

    root, built = tmp_path_factory.mktemp("moe"), {}

    def get(kind: str) -> Path:
        if kind not in built:
            built[kind] = build_moe(kind, root / kind)
        return built[kind]

    return get


def tensors(out: Path) -> dict[str, torch.Tensor]:
    found = {}
    for file in sorted(out.glob("*.safetensors")):
        with safe_open(file, "pt") as f:
            found.update({name: f.get_tensor(name) for name in f.keys()})
    return found


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def written(info, scheme: str, out: Path, ignore: list[str] | None = None, dtype=None, **sizes):
    plan = model_free_moe.plan_moe(info, scheme_of(scheme), ignore_patterns(info, []) if ignore is None else ignore,
                                   dtype)
    out.mkdir(parents=True)
    model_free.write_weights(plan, out, **sizes)
    model_free_moe.write_config(plan, info.path, out)
    return plan


# ------------------------------------------------------------------ what is quantized


def test_routers_norms_embeddings_head_and_the_mtp_layer_stay_as_stored(moe_models):
    info = check_model_dir(moe_models("deepseek_v3"))
    ignore = ignore_patterns(info, [])
    quantized = model_free_moe.quantized_modules(info, ignore)
    assert {"model.layers.0.mlp.gate_proj", "model.layers.0.self_attn.q_a_proj",
            "model.layers.1.self_attn.kv_a_proj_with_mqa", "model.layers.1.self_attn.kv_b_proj",
            "model.layers.1.mlp.shared_experts.down_proj", "model.layers.2.mlp.experts.3.up_proj"} <= set(quantized)
    assert not [m for m in quantized if m.startswith("model.layers.3.") or m.endswith(("mlp.gate", "norm"))
                or "embed" in m or m == "lm_head"]
    assert model_free_moe.mtp_prefixes(info) == ["model.layers.3."]
    assert model_free_moe.written_ignore(info, ignore, quantized) == [
        "lm_head", "model.layers.1.mlp.gate", "model.layers.2.mlp.gate", *[p for p in ignore if p.startswith("re:")],
        r"re:model\.layers\.3\..*"]


def test_what_the_path_cannot_read(moe_models):
    import dataclasses

    info = check_model_dir(moe_models("qwen3_moe"))
    assert model_free_moe.blocker(info) is None
    stacked = {**info.tensors, "model.layers.0.mlp.experts.gate_up_proj": ("BF16", [4, 256, 256])}
    assert "experts stored stacked" in model_free_moe.blocker(dataclasses.replace(info, tensors=stacked))
    fp8 = {**info.tensors, "model.layers.0.mlp.experts.0.up_proj.weight": ("F8_E4M3", [128, 256])}
    assert "give the 16-bit checkpoint" in model_free_moe.blocker(dataclasses.replace(info, tensors=fp8))
    assert "no row" in model_free_moe.blocker(dataclasses.replace(info, model_type="olmoe"))


def test_a_fused_layer_split_by_the_ignore_list_is_refused(moe_models):
    from quantkit.errors import UnsupportedError

    info = check_model_dir(moe_models("deepseek_v3"))
    ignore = [*ignore_patterns(info, []), "model.layers.1.self_attn.q_a_proj"]
    with pytest.raises(UnsupportedError, match="kv_a_proj_with_mqa would be quantized, but vLLM fuses it"):
        model_free_moe.plan_moe(info, scheme_of("fp8-block"), ignore)


# ------------------------------------------------------------------ the bytes


@pytest.mark.parametrize("kind,scheme", [
    ("qwen3_moe", "fp8-block"), ("qwen3_moe", "nvfp4-a16"), ("qwen3_moe", "mxfp4"), ("deepseek_v3", "nvfp4-a16"),
    pytest.param("deepseek_v3", "fp8-block", marks=pytest.mark.slow),
    pytest.param("deepseek_v3", "mxfp4", marks=pytest.mark.slow),
])
def test_every_tensor_is_what_llm_compressors_converter_writes(moe_models, tmp_path, kind, scheme):
    """A slab of a few rows at a time and many small shards: each quantized weight equals ModelFreePtqConverter's
    output for the whole tensor, a fused NVFP4 set equals its output for the same tensors under names its fused
    patterns see; kept tensors are the stored bytes."""
    from llmcompressor.entrypoints.model_free.converter import ModelFreePtqConverter

    info = check_model_dir(moe_models(kind))
    plan = written(info, scheme, tmp_path / "out", slab_bytes=4096, shard_bytes=300_000)
    out, source = tensors(tmp_path / "out"), tensors(info.path)
    assert len(list((tmp_path / "out").glob("*.safetensors"))) > 3
    converter = ModelFreePtqConverter(model_free_moe.model_free_config(scheme_of(scheme), []))
    fused = 0
    for item in plan.items:
        if isinstance(item, model_free.Copied):
            assert same(out[item.name], source[item.name]), item.name
            continue
        modules = item.modules if isinstance(item, model_free.FusedQuantized) else (item.module,)
        leaves = tuple(m.rsplit(".", 1)[1] for m in modules)
        alias = dict(zip(modules, ALIASES[leaves])) if len(modules) > 1 else {modules[0]: modules[0]}
        expected = converter.process({f"{alias[m]}.weight": source[f"{m}.weight"] for m in modules})
        for module in modules:
            names = [n for n in expected if n.rsplit(".", 1)[0] == alias[module]]
            assert names and sorted(f"{module}.{n.rsplit('.', 1)[1]}" for n in names) == sorted(
                s.name for s in item.outputs if s.name.rsplit(".", 1)[0] == module)
            for name in names:
                ours = f"{module}.{name.rsplit('.', 1)[1]}"
                assert same(out[ours], expected[name]), ours
        fused += len(modules) > 1
    assert (fused > 0) == (scheme == "nvfp4-a16")
    assert sorted(out) == sorted(s.name for item in plan.items for s in item.outputs)


def test_an_experts_gate_and_up_share_one_global_scale(moe_models, tmp_path):
    """vLLM's NVFP4 MoE kernels take one global scale for an expert's w13 (w1's; a warning when w3's differs):
    quantkit fuses an expert's gate/up, the shared experts' and MLA's q_a/kv_a as llm-compressor's oneshot does;
    its model-free converter, by its name patterns, gives them separate scales."""
    from llmcompressor.entrypoints.model_free.converter import ModelFreePtqConverter

    info = check_model_dir(moe_models("deepseek_v3"))
    written(info, "nvfp4-a16", tmp_path / "out")
    out, source = tensors(tmp_path / "out"), tensors(info.path)
    for a, b in (("mlp.experts.2.gate_proj", "mlp.experts.2.up_proj"),
                 ("mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj"),
                 ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa")):
        a, b = f"model.layers.1.{a}", f"model.layers.1.{b}"
        assert same(out[f"{a}.weight_global_scale"], out[f"{b}.weight_global_scale"])
        alone = ModelFreePtqConverter(model_free_moe.model_free_config(scheme_of("nvfp4-a16"), [])).process(
            {f"{a}.weight": source[f"{a}.weight"], f"{b}.weight": source[f"{b}.weight"]})
        assert not torch.equal(alone[f"{a}.weight_global_scale"], alone[f"{b}.weight_global_scale"])


@pytest.mark.parametrize("scheme", ["fp8-block", "nvfp4-a16", "mxfp4"])
def test_llm_compressors_model_free_ptq_writes_the_same_checkpoint(moe_models, tmp_path, scheme):
    """llm-compressor's own entry point on the same checkpoint, with the same ignore list (and the embedding, which
    it would quantize): every tensor equal, but the experts' gate/up under NVFP4, whose global scales it keeps
    apart; the same quantization_config."""
    from llmcompressor.entrypoints.model_free import model_free_ptq

    info = check_model_dir(moe_models("qwen3_moe"))
    plan = written(info, scheme, tmp_path / "ours")
    model_free_ptq(str(info.path), str(tmp_path / "theirs"), config=model_free_moe.model_free_config(
        scheme_of(scheme), [*plan.config.ignore, "model.embed_tokens"]), device="cpu")
    ours, theirs = tensors(tmp_path / "ours"), tensors(tmp_path / "theirs")
    assert sorted(ours) == sorted(theirs)
    differ = sorted(n for n in ours if not same(ours[n], theirs[n]))
    if scheme == "nvfp4-a16":
        assert differ and all(".experts." in n and n.split(".")[-2] in ("gate_proj", "up_proj") for n in differ)
    else:
        assert differ == []
    config = quant_config(tmp_path / "theirs")
    assert {**quant_config(tmp_path / "ours"), "ignore": config["ignore"]} == config
    assert quant_config(tmp_path / "ours")["ignore"] == [i for i in config["ignore"] if i != "model.embed_tokens"]


def test_another_dtype_is_the_one_from_pretrained_would_load(moe_models, tmp_path):
    """--dtype float16 on a bfloat16 checkpoint: the weights quantized from float16, the kept tensors cast to it but
    DeepSeek-V3's correction bias (transformers keeps it in float32), config.json's dtype float16."""
    from llmcompressor.entrypoints.model_free.converter import ModelFreePtqConverter

    info = check_model_dir(moe_models("deepseek_v3"))
    written(info, "mxfp4", tmp_path / "out", dtype=torch.float16, slab_bytes=4096)
    out, source = tensors(tmp_path / "out"), tensors(info.path)
    assert out["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert out["model.norm.weight"].dtype == out["lm_head.weight"].dtype == torch.float16
    assert same(out["model.layers.3.eh_proj.weight"], source["model.layers.3.eh_proj.weight"].half())
    name = "model.layers.2.mlp.experts.1.down_proj"
    expected = ModelFreePtqConverter(model_free_moe.model_free_config(scheme_of("mxfp4"), [])).process(
        {f"{name}.weight": source[f"{name}.weight"].half()})
    assert all(same(out[key], value) for key, value in expected.items())
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float16"


def test_the_config_names_every_kept_linear(moe_models, tmp_path):
    info = check_model_dir(moe_models("qwen3_moe"))
    written(info, "mxfp4", tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    source = json.loads((info.path / "config.json").read_text())
    assert {k: v for k, v in config.items() if k != "quantization_config"} == source
    q = config["quantization_config"]
    assert q["format"] == "mxfp4-pack-quantized" and q["quantization_status"] == "compressed"
    assert list(q["config_groups"]) == ["group_0"] and q["config_groups"]["group_0"]["targets"] == ["Linear"]
    assert q["ignore"][:3] == ["lm_head", "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]


# ------------------------------------------------------------------ the methods


def test_the_path_and_its_memory_before_any_work(moe_models, tmp_path):
    """No model loaded; the preflight's quantize step is one slab (or an NVFP4 fused set) of the largest weight,
    not the model; the gate streams the artifact a layer at a time."""
    from quantkit.engines.llmcompressor.model_free import SLAB_WORKING_SET
    from quantkit.run.pipeline import RunOptions, prepare
    from quantkit.run.preflight import ram_estimate, unit_bytes
    from quantkit.run.recipe import Overrides, build_recipe
    from tests.util import kept as kept_baseline

    model = moe_models("deepseek_v3")
    info = check_model_dir(model)
    _others, layers = unit_bytes(info)
    expert = 2 * 128 * 256  # one expert projection, bf16: the largest quantized weight but the dense MLP's
    dense = 2 * 512 * 256
    for method, options, working in (("fp8", {"scheme": "fp8-block"}, dense), ("nvfp4", {"scheme": "a16"}, 2 * dense),
                                     ("mxfp4", {}, dense)):
        recipe = build_recipe(None, method, Overrides(model=str(model), method_options=options))
        _info, targets, _placement = prepare(recipe, RunOptions(model=str(model), out=tmp_path / method))
        assert not targets[0].needs_model
        steps = ram_estimate(info, recipe, targets).steps
        kept = kept_baseline(info)  # held from the baseline on, beside every later step
        assert steps[f"{method}: quantize"] - kept == SLAB_WORKING_SET * working > SLAB_WORKING_SET * expert
        assert steps[f"{method}: gate"] - max(layers.values()) == steps["baseline"] - max(layers.values())


@pytest.mark.parametrize("kind,scheme", [
    ("deepseek_v3", "fp8-block"), ("qwen3_moe", "nvfp4-a16"),
    pytest.param("deepseek_v3", "nvfp4-a16", marks=pytest.mark.slow),
    pytest.param("deepseek_v3", "mxfp4", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", "fp8-block", marks=pytest.mark.slow),
    pytest.param("qwen3_moe", "mxfp4", marks=pytest.mark.slow),
])
def test_quantize_end_to_end(cli, moe_models, tmp_path, kind, scheme):
    """`quantkit quantize`: no model loaded, the artifact gated by quantkit's own reading of its experts."""
    out = tmp_path / "out"
    result = cli("quantize", moe_models(kind), *SCHEMES[scheme], *CALIB_ARGS, *LOOSE_GATE, "-o", out)
    assert result.exit_code == 0, result.output
    assert "loading" not in result.output
    entry = report(out)["targets"][0]
    assert entry["details"]["path"] == "model-free: mixture-of-experts, by checkpoint names"
    assert entry["gate"]["passed"] and 0 < entry["metrics"]["kld_mean"] < 1
    ignore = quant_config(out)["ignore"]
    assert "model.layers.1.mlp.gate" in ignore and "lm_head" in ignore
    if kind == "deepseek_v3":
        assert entry["details"]["mtp_layers_kept"] == ["model.layers.3"]
        assert r"re:model\.layers\.3\..*" in ignore
    if scheme == "fp8-block" and kind == "deepseek_v3":  # kv_a_proj_with_mqa's 192 rows: both MLA shards 16-bit
        assert "model.layers.1.self_attn.kv_a_proj_with_mqa" in ignore and "model.layers.1.self_attn.q_a_proj" in ignore
    for name in ("tokenizer.json", "recipe.yaml", "README.md"):
        assert (out / name).is_file(), name


@pytest.mark.slow  # the fast suite runs the same on GLM-4.5 (tests/families/test_moe.py)
def test_nvfp4_w4a4_takes_the_loaded_model(cli, moe_models, tmp_path):
    """nvfp4's default w4a4 calibrates its activations' global scales, so it runs on the loaded model (not
    model-free), its FP4 experts read back by quantkit's reading."""
    out = tmp_path / "out"
    result = cli("quantize", moe_models("qwen3_moe"), "--method", "nvfp4", *CALIB_ARGS, "--no-gate", "-o", out)
    assert result.exit_code == 0, result.output
    entry = json.loads((out / "quantkit.json").read_text())["targets"][0]
    assert entry["details"].get("path") != "model-free"
    from tests.families.common import stored_tensors

    assert any(k.endswith(".experts.0.up_proj.input_global_scale") for k in stored_tensors(out))


@pytest.mark.parametrize("args,words", [
    (["--method", "fp8", "--scheme", "fp8-block", "--kv-cache", "fp8"], "--kv-cache needs the loaded model"),
])
def test_refused_before_any_work(cli, moe_models, tmp_path, args, words):
    out = tmp_path / "out"
    result = cli("quantize", moe_models("qwen3_moe"), *args, *CALIB_ARGS, "-o", out)
    assert result.exit_code == 2, result.output
    assert words in result.output
    assert "measuring" not in result.output
    assert_nothing_written(out)


def test_resume_by_shard_where_the_path_saves_progress(moe_models):
    """fp8-block on an MoE checkpoint resumes a shard at a time (the model-free writer's state file); nvfp4 a16 and
    mxfp4 keep the sequential methods' rule: a data-free scheme has no layers to save, and is refused."""
    from quantkit.methods import fp8, mxfp4, nvfp4

    info = check_model_dir(moe_models("qwen3_moe"))
    assert fp8.METHOD.resume.refused(info, fp8.Options(scheme="fp8-block")) is None
    assert "calibrates nothing" in nvfp4.METHOD.resume.refused(info, nvfp4.Options(scheme="a16"))
    assert "calibrates nothing" in mxfp4.METHOD.resume.refused(info, mxfp4.Options())
