import math

import pytest

from quantkit.arch.roles import classify, matches
from quantkit.io.checkpoint import ModelInfo, check_model_dir
from quantkit.methods import fp8, ignore_patterns
from quantkit.run.plan import build_plan, kv_cache_bytes


@pytest.mark.parametrize("name,role", [
    ("model.layers.3.self_attn.q_proj.weight", "decoder"),
    ("model.layers.0.mlp.down_proj.weight", "decoder"),
    ("lm_head.weight", "lm_head"),
    ("model.embed_tokens.weight", "embeddings"),
    ("model.norm.weight", "norm"),
    ("model.layers.1.input_layernorm.weight", "norm"),
    # Llava / Gemma3 (checkpoint and transformers v5 module names)
    ("vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight", "vision"),
    ("model.vision_tower.encoder.layers.0.mlp.fc1.weight", "vision"),
    ("multi_modal_projector.linear_1.weight", "projector"),
    ("model.multi_modal_projector.linear_2.weight", "projector"),
    ("language_model.model.layers.0.self_attn.o_proj.weight", "decoder"),
    # Qwen2-VL: the merger (projector) sits inside the visual tower; the more specific component wins
    ("visual.blocks.0.attn.qkv.weight", "vision"),
    ("model.visual.merger.mlp.0.weight", "projector"),
    # Mllama: the projector is itself a Linear (checkpoint and module name)
    ("multi_modal_projector.weight", "projector"),
    ("model.multi_modal_projector", "projector"),
    # SigLIP's attention-pooling head (nn.MultiheadAttention) inside Gemma 3's vision tower
    ("model.vision_tower.head.attention.out_proj", "vision"),
    # Idefics3
    ("model.connector.modality_projection.proj.weight", "projector"),
])
def test_classify(name, role):
    assert classify(name) == role


def vlm_info() -> ModelInfo:
    tensors = {
        "model.language_model.layers.0.self_attn.q_proj.weight": ("BF16", [256, 256]),
        "model.language_model.embed_tokens.weight": ("BF16", [512, 256]),
        "model.vision_tower.encoder.layers.0.self_attn.q_proj.weight": ("BF16", [128, 128]),
        "model.multi_modal_projector.linear_1.weight": ("BF16", [256, 128]),
        "lm_head.weight": ("BF16", [512, 256]),
    }
    config = {"text_config": {"num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
                              "hidden_size": 256}}
    return ModelInfo(None, config, [], "LlavaForConditionalGeneration", "llava", tensors)


def test_vlm_towers_stay_16bit_whatever_the_ignore_list():
    info = vlm_info()
    plan = {e.name: e.precision for e in build_plan(info, fp8.METHOD, fp8.Options(), [])}
    assert plan["model.language_model.layers.0.self_attn.q_proj"].startswith("fp8")
    assert "kept: vision" in plan["model.vision_tower.encoder.layers.0.self_attn.q_proj"]
    assert "kept: projector" in plan["model.multi_modal_projector.linear_1"]
    assert "kept" in plan["lm_head"]


def test_ignore_patterns_cover_present_towers_with_llmcompressor_semantics():
    patterns = ignore_patterns(vlm_info(), ["re:.*q_proj"])
    assert patterns[0] == "lm_head" and patterns[-1] == "re:.*q_proj"
    assert matches("model.vision_tower.encoder.layers.0.mlp.fc1", patterns)
    assert matches("model.multi_modal_projector.linear_1", patterns)
    assert not matches("model.language_model.layers.0.mlp.up_proj", patterns)


def test_memory_rows_are_the_serving_plans_weights():
    """inspect's memory table sizes each method's default artifact as `quantkit plan` does."""
    from quantkit.methods import get_method
    from quantkit.run.serving import memory_rows, weight_bytes

    info = vlm_info()
    rows = memory_rows(info, context=10)
    assert rows["source"]["weights_bytes"] > rows["fp8"]["weights_bytes"] > rows["gptq"]["weights_bytes"]
    gptq = get_method("gptq")
    assert rows["gptq"]["weights_bytes"] == weight_bytes(info, gptq, gptq.resolve(info, gptq.options())[0])
    assert all(r["with_overhead_bytes"] > r["weights_bytes"] for r in rows.values())
    assert kv_cache_bytes(info.config, context=10) == 2 * 1 * 2 * 64 * 2 * 10


@pytest.fixture(scope="module")
def fused_moe(tmp_path_factory):
    """Tiny GPT-OSS and Llama 4 text checkpoints: experts stored fused across experts, 3-D tensors."""
    from tests.families import test_moe

    return {family: check_model_dir(test_moe.build(tmp_path_factory.mktemp(family) / "model", family))
            for family in ("gpt_oss", "llama4_text")}


def fused_expert_values(info) -> int:
    return sum(math.prod(shape) for name, (_dtype, shape) in info.tensors.items()
               if len(shape) == 3 and name.rsplit(".", 1)[1] in ("gate_up_proj", "down_proj"))


@pytest.mark.parametrize("family, method, quantized", [
    ("llama4_text", "gptq", True), ("llama4_text", "fp8", True), ("llama4_text", "nf4", True),
    ("llama4_text", "mlx", True), ("llama4_text", "gguf", True),
    ("gpt_oss", "nf4", False), ("gpt_oss", "mlx", True), ("gpt_oss", "gguf", True),
])
def test_experts_stored_fused_are_planned_one_weight_per_expert_projection(fused_moe, family, method, quantized):
    """The plan (and every size read from it: plan, inspect, --method auto) counts each expert's projection cut from
    the fused tensor where the method quantizes it, at the method's precision; nf4 keeps GPT-OSS's fused experts
    16-bit (bitsandbytes quantizes Linear layers only), as the artifact does."""
    from quantkit.methods import get_method
    from quantkit.run.serving import weight_parts

    info, spec = fused_moe[family], get_method(method)
    options, _choices = spec.resolve(info, spec.options())
    entries = build_plan(info, spec, options, ignore_patterns(info, [], spec.layers.keeps_lm_head(options)))
    experts = [e for e in entries if ".experts." in e.name and ".shared" not in e.name]
    _total, count, other, quantizes_experts = weight_parts(info, spec, options)
    linear = sum(e.params for e in entries if not e.kept and e not in experts)
    everything = sum(math.prod(shape) for _dtype, shape in info.tensors.values())
    assert quantizes_experts is quantized
    if quantized:
        assert {e.name.rsplit(".", 2)[1] for e in experts} == {"0", "1", "2", "3"}  # every expert, 2-D
        assert all(not e.kept and len(e.shape) == 2 for e in experts)
        assert count == linear + fused_expert_values(info)
    else:
        assert experts and all(e.kept for e in experts) and count == linear
    assert other == (everything - count) * 2


def test_a_fused_experts_plan_names_what_the_artifact_writes(fused_moe):
    """nf4 writes Llama 4's experts one Linear per expert projection (quantkit.methods.nf4.split_modules): the plan's
    entries are those modules, at nf4's precision."""
    from quantkit.methods import get_method
    from quantkit.methods.nf4 import split_modules

    info, nf4 = fused_moe["llama4_text"], get_method("nf4")
    entries = {e.name: e for e in build_plan(info, nf4, nf4.options(), ["lm_head"])}
    assert set(split_modules(info)) <= set(entries)
    assert {entries[name].precision for name in split_modules(info)} == {"nf4 blocks of 64 + double quant (bitsandbytes)"}


@pytest.mark.parametrize("method", ["fp8", "gptq", "nf4", "mlx", "gguf"])
def test_experts_stored_fused_or_one_tensor_each_plan_alike(tmp_path_factory, method):
    """Qwen3.5-MoE's experts as its releases store them (transformers' fused gate_up_proj / down_proj) and one tensor
    per expert: the same weights, so the same plan, each expert at its stacked tensor's precision (gguf: the type
    llama-quantize's mixture gives `blk.N.ffn_down_exps`, for every expert, not the first alone)."""
    from quantkit.methods import get_method
    from quantkit.run.serving import weight_parts
    from tests.families import common, test_moe

    root = tmp_path_factory.getbasetemp() / "qwen35_moe_plan"
    if not (root / "fused").is_dir():
        common.with_fused_experts(test_moe.build(root / "per_expert", "qwen3_5_moe_text"), root / "fused")
    spec = get_method(method)
    per_expert, fused = (check_model_dir(root / kind) for kind in ("per_expert", "fused"))
    plans = [{e.name: e.precision for e in build_plan(info, spec, spec.options(), ["lm_head"])}
             for info in (per_expert, fused)]
    assert plans[0] == plans[1]
    assert weight_parts(per_expert, spec, spec.options()) == weight_parts(fused, spec, spec.options())
    downs = {name: text for name, text in plans[0].items() if ".experts." in name and name.endswith("down_proj")}
    assert len({text for name, text in downs.items() if name.startswith("model.layers.1.")}) == 1
