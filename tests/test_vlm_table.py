"""The VLM family table and the detection of unknown towers (no torch: names and shapes only)."""

from __future__ import annotations

import pytest

from quantkit.arch.roles import matches
from quantkit.arch.vlm import FAMILIES, find_unknown_towers, language_root, model_towers
from quantkit.io.checkpoint import ModelInfo
from quantkit.methods import fp8, ignore_patterns
from quantkit.run.plan import build_plan

LLAMA_DECODER = {
    "model.embed_tokens.weight": ("BF16", [512, 256]),
    "model.layers.0.self_attn.q_proj.weight": ("BF16", [256, 256]),
    "model.layers.0.mlp.down_proj.weight": ("BF16", [256, 512]),
    "model.norm.weight": ("BF16", [256]),
    "lm_head.weight": ("BF16", [512, 256]),
}


def info_of(model_type: str, tensors: dict, config: dict | None = None) -> ModelInfo:
    return ModelInfo(None, {"model_type": model_type, **(config or {})}, [], "XForConditionalGeneration",
                     model_type, tensors)


def test_every_family_row_is_a_transformers_architecture():
    import transformers

    for model_type, family in FAMILIES.items():
        assert hasattr(transformers, family.architecture), (model_type, family.architecture)
        assert family.vision and family.projector and family.language


@pytest.mark.parametrize("module,role", [
    # module names of the loaded model (transformers 5.17) for each family: tower components by role
    ("model.multi_modal_projector", "projector"),  # mllama: a Linear
    ("model.visual.merger.mlp.0", "projector"),
    ("model.visual.deepstack_merger_list.0.linear_fc1", "projector"),
    ("model.visual.blocks.0.attn.qkv", "vision"),
    ("model.vision_tower.head.attention.out_proj", "vision"),
    ("model.connector.modality_projection.proj", "projector"),
    ("model.vision_model.global_transformer.layers.0.mlp.fc1", "vision"),
    ("model.audio_tower.conformer.0.attention", "audio"),
    ("model.embed_vision.embedding_projection", "projector"),
    ("model.language_model.layers.0.self_attn.q_proj", None),
])
def test_family_tower_roles(module, role):
    towers = [model_towers(t, {}, {}) for t in FAMILIES]
    assert role in {t.role(module) for t in towers}
    assert all(t.role("model.language_model.layers.0.mlp.down_proj") is None for t in towers)


def test_mllama_linear_projector_is_ignored_by_module_and_checkpoint_name():
    info = info_of("mllama", {**{f"language_model.{k}": v for k, v in LLAMA_DECODER.items()},
                              "vision_model.patch_embedding.weight": ("BF16", [32, 3, 8, 8]),
                              "multi_modal_projector.weight": ("BF16", [256, 64])})
    ignore = ignore_patterns(info, [])
    for name in ("model.multi_modal_projector", "multi_modal_projector", "model.vision_model.transformer.layers.0.x"):
        assert matches(name, ignore), name
    assert not matches("model.language_model.layers.0.self_attn.q_proj", ignore)
    entry = next(e for e in build_plan(info, fp8.METHOD, fp8.Options(), ignore) if e.name == "multi_modal_projector")
    assert entry.kept and entry.role == "projector"


def test_language_root():
    assert language_root(LLAMA_DECODER) == "model."
    assert language_root({"model.language_model.embed_tokens.weight": ("BF16", [4, 4])}) == "model.language_model."
    assert language_root({"language_model.model.embed_tokens.weight": ("BF16", [4, 4])}) == "language_model.model."


def test_text_models_have_no_unknown_towers():
    assert find_unknown_towers({"model_type": "llama"}, LLAMA_DECODER) == []
    assert model_towers("llama", {}, LLAMA_DECODER).components == ()


def test_unknown_tower_found_by_its_convolution():
    tensors = {**LLAMA_DECODER, "model.retina.stem.weight": ("BF16", [64, 3, 8, 8]),
               "model.retina.blocks.0.fc.weight": ("BF16", [64, 64]),
               "model.bridge.weight": ("BF16", [256, 64])}
    # no vision_config: the conv tower is found by look; a plain Linear with a plain name is not
    assert find_unknown_towers({}, tensors) == ["model.retina"]
    # with a vision_config and no table row, every component beside the text model is a tower
    assert find_unknown_towers({"vision_config": {}}, tensors) == ["model.bridge", "model.retina"]


@pytest.mark.parametrize("name", ["image_encoder", "mm_projector", "audio_frontend", "perceiver_resampler",
                                  "vision_adapter", "multi_modal_bridge", "patch_stem"])
def test_unknown_tower_found_by_its_name(name):
    tensors = {**LLAMA_DECODER, f"{name}.proj.weight": ("BF16", [256, 64])}
    assert find_unknown_towers({}, tensors) == [name]


def test_unknown_towers_kept_16bit_in_the_plan_and_the_ignore_list():
    from quantkit.methods import gptq

    tensors = {**LLAMA_DECODER, "model.retina.stem.weight": ("BF16", [64, 3, 8, 8]),
               "model.retina.blocks.0.fc.weight": ("BF16", [64, 64]),
               "model.bridge.weight": ("BF16", [256, 64])}
    info = info_of("tinyeye", tensors, {"vision_config": {}})
    assert info.towers.unknown == ("model.bridge", "model.retina")
    ignore = ignore_patterns(info, [])
    plan = {e.name: e for e in build_plan(info, gptq.METHOD, gptq.Options(), ignore)}
    for name in ("model.bridge", "model.retina.blocks.0.fc"):
        assert plan[name].kept and plan[name].role == "tower", plan[name]
        assert "unknown tower" in plan[name].precision
        assert matches(name, ignore)
    assert not plan["model.layers.0.self_attn.q_proj"].kept
    assert set(gptq.quantized_linears(info)) == {"model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"}


def test_mllama_cross_attention_layers_stay_16bit():
    """Layers that attend to image features get no text-only calibration and no text gate: kept."""
    towers = model_towers("mllama", {"text_config": {"cross_attention_layers": [1]}}, {})
    assert towers.role("language_model.model.layers.1.cross_attn.k_proj.weight") == "cross_attention"
    assert towers.role("model.language_model.layers.1.mlp.down_proj") == "cross_attention"
    assert towers.role("model.language_model.layers.0.self_attn.q_proj") is None
    assert towers.role("model.vision_model.transformer.layers.1.mlp.fc1") == "vision"


def test_vlm_smoothing_rows_resolve_inside_the_language_model_only():
    """A VLM's AWQ/SmoothQuant rows are its text model's rows anchored under the language model, so a
    vision layer with the same names (Mllama's, SigLIP's) is never smoothed."""
    from quantkit.arch.mappings import model_mappings, rows_for

    info = info_of("llava", {"model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight":
                             ("BF16", [64, 64])}, {"text_config": {"model_type": "llama"}})
    rows = model_mappings(info, "awq")
    assert len(rows) == len(rows_for("llama", "awq"))
    norm_row = rows[0]
    assert matches("model.language_model.layers.0.input_layernorm", [norm_row.smooth])
    assert matches("language_model.model.layers.3.input_layernorm", [norm_row.smooth])
    assert not matches("model.vision_tower.vision_model.encoder.layers.0.input_layernorm", [norm_row.smooth])
    assert matches("model.language_model.layers.0.self_attn.q_proj", list(norm_row.balance))
    assert not matches("model.vision_tower.vision_model.encoder.layers.0.self_attn.q_proj", list(norm_row.balance))


@pytest.mark.parametrize("model_type,config,reason", [
    ("mllama", {"text_config": {"model_type": "mllama_text_model"}}, "cross-attention layers"),
    ("llava", {"text_config": {"model_type": "falcon"}}, "'falcon' .the text model of LLaVA"),
    ("tinyeye", {"vision_config": {}}, "towers found by look .*model.retina"),
])
def test_vlm_smoothing_refusals_name_the_reason(model_type, config, reason):
    from quantkit.arch.mappings import model_mappings
    from quantkit.errors import UnsupportedError

    tensors = {**LLAMA_DECODER, "model.retina.stem.weight": ("BF16", [64, 3, 8, 8]),
               "model.vision_model.layers.0.fc.weight": ("BF16", [64, 64]),
               "model.multi_modal_projector.weight": ("BF16", [256, 64])}
    with pytest.raises(UnsupportedError, match=reason):
        model_mappings(info_of(model_type, tensors, config), "smoothquant")


def test_towers_quantized_on_request_in_the_plan_and_the_ignore_list():
    """A target's `vision: int8`: the vision Linears get the tower precision in the plan (not its
    embeddings), the projector stays kept, and the ignore list drops the vision component only, with
    a projector nested inside it (Qwen2-VL's `visual.merger`) still ignored."""
    tensors = {**LLAMA_DECODER, "model.visual.blocks.0.attn.qkv.weight": ("BF16", [96, 32]),
               "model.visual.pos_embed.weight": ("BF16", [64, 32]),
               "model.visual.merger.mlp.0.weight": ("BF16", [128, 128])}
    info = info_of("qwen2_vl", tensors)
    ignore = ignore_patterns(info, [], quantized_towers=("vision",))
    plan = {e.name: e for e in build_plan(info, fp8.METHOD, fp8.Options(), ignore, {"vision": "int8"})}
    assert not plan["model.visual.blocks.0.attn.qkv"].kept
    assert plan["model.visual.blocks.0.attn.qkv"].precision.startswith("int8 W/channel sym RTN")
    assert plan["model.visual.pos_embed"].kept and plan["model.visual.merger.mlp.0"].kept
    assert matches("model.visual.merger.mlp.0", ignore) and not matches("model.visual.blocks.0.attn.qkv", ignore)
    ignore = ignore_patterns(info, [], quantized_towers=("projector",))
    assert not matches("model.visual.merger.mlp.0", ignore) and matches("model.visual.blocks.0.attn.qkv", ignore)
