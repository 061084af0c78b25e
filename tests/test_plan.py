import pytest

from quantkit.arch.roles import classify, matches
from quantkit.io.checkpoint import ModelInfo
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
