"""Tiny vision-language models built locally for tests (no network, no hub).

Each builder saves a safetensors checkpoint + tokenizer into a directory. The text model has
the micro toy model's shape (hidden 256, GQA 4/2 heads, 2 layers) so every method applies;
the vision tower is smaller still. When `text_from` names a micro toy checkpoint (a trained
LlamaForCausalLM with the same tokenizer), its weights are copied into the VLM's language model,
so the text path is a trained model and the quality gate means something; otherwise the text
model is random.

The tokenizer is quantkit's toy BPE tokenizer plus the image placeholder tokens the model needs.
"""

from __future__ import annotations

from pathlib import Path

TEXT_SHAPE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=2048, rms_norm_eps=1e-5)


def vlm_tokenizer(extra_tokens: list[str]):
    from quantkit.toy import build_tokenizer, bundled_texts

    tokenizer = build_tokenizer(bundled_texts(), 512)
    tokenizer.add_special_tokens({"additional_special_tokens": extra_tokens})
    return tokenizer


def _ids(tokenizer) -> dict:
    return dict(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id)


def _copy_text_weights(language_model, lm_head, text_from: Path | None) -> None:
    """Load a trained micro LlamaForCausalLM into the VLM's text decoder (extra vocab rows kept random)."""
    if text_from is None:
        return
    import torch
    from safetensors.torch import load_file

    state = load_file(str(Path(text_from) / "model.safetensors"))
    with torch.no_grad():
        inner = {k.removeprefix("model."): v for k, v in state.items() if k.startswith("model.")}
        own = language_model.state_dict()
        for name, value in inner.items():
            target = own[name]
            if name == "embed_tokens.weight":
                target[: value.shape[0]].copy_(value)
            else:
                target.copy_(value)
        for name, value in own.items():  # Qwen2 attention biases: zero, so the decoder equals the Llama one
            if name.endswith("_proj.bias") and name not in inner:
                value.zero_()
        head = state["lm_head.weight"]
        lm_head.weight[: head.shape[0]].copy_(head)


def _save(model, tokenizer, out: Path) -> Path:
    import torch

    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    return out


def chat_template(placeholder: str) -> str:
    """A minimal chat template: the family's image placeholder where an image goes, then the text."""
    return ("{% for m in messages %}{% for c in m['content'] %}{% if c['type'] == 'image' %}" + placeholder
            + "{% else %}{{ c['text'] }}{% endif %}{% endfor %}{% endfor %}")


def save_processor(kind: str, out: Path) -> None:
    """Real processor files (image processor sized for the tiny tower, the tokenizer, a chat template)
    for the families whose processors build without torchvision (Qwen's need its video processor)."""
    import transformers as T

    if kind not in PROCESSOR_KINDS:
        return
    if kind == "gemma3":
        tokenizer = T.AutoTokenizer.from_pretrained(out, extra_special_tokens={
            "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"})
    else:
        tokenizer = T.AutoTokenizer.from_pretrained(out)
    clip = dict(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    llava = dict(patch_size=8, vision_feature_select_strategy="default", num_additional_image_tokens=1,
                 chat_template=chat_template("<image>"))
    processor = {
        "llava": lambda: T.LlavaProcessor(T.CLIPImageProcessor(**clip), tokenizer, **llava),
        "llava_next": lambda: T.LlavaNextProcessor(
            T.LlavaNextImageProcessor(**clip, image_grid_pinpoints=[[32, 32], [32, 64]]), tokenizer, **llava),
        "mllama": lambda: T.MllamaProcessor(T.MllamaImageProcessor(size={"height": 32, "width": 32}, max_image_tiles=1),
                                            tokenizer, chat_template=chat_template("<|image|>")),
        "gemma3": lambda: T.Gemma3Processor(T.Gemma3ImageProcessor(size={"height": 32, "width": 32}), tokenizer,
                                            image_seq_length=4, chat_template=chat_template("<start_of_image>")),
    }[kind]()
    processor.save_pretrained(out)


PROCESSOR_KINDS = ("llava", "llava_next", "mllama", "gemma3")


def build_llava(out: str | Path, text_from: str | Path | None = None, seed: int = 0) -> Path:
    """LlavaForConditionalGeneration: tiny CLIP vision tower (32 px, 8 px patches) + micro Llama text model."""
    import torch
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

    torch.manual_seed(seed)
    tokenizer = vlm_tokenizer(["<image>"])
    text = LlamaConfig(vocab_size=len(tokenizer), tie_word_embeddings=False, **TEXT_SHAPE, **_ids(tokenizer))
    vision = CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8, projection_dim=64)
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_index=tokenizer.convert_tokens_to_ids("<image>"),
                         image_seq_length=(32 // 8) ** 2, tie_word_embeddings=False)
    model = LlavaForConditionalGeneration(config).float().eval()
    _copy_text_weights(model.model.language_model, model.lm_head, text_from and Path(text_from))
    _save(model, tokenizer, Path(out))
    save_processor("llava", Path(out))
    return Path(out)


QWEN2_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def build_qwen2_vl(out: str | Path, text_from: str | Path | None = None, seed: int = 0) -> Path:
    """Qwen2VLForConditionalGeneration: 2-block vision tower (merger = projector inside `visual`) + micro text model."""
    import torch
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    torch.manual_seed(seed)
    tokenizer = vlm_tokenizer(QWEN2_VL_TOKENS)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN2_VL_TOKENS}
    head_dim = TEXT_SHAPE["hidden_size"] // TEXT_SHAPE["num_attention_heads"]
    text = dict(vocab_size=len(tokenizer), **TEXT_SHAPE, **_ids(tokenizer),
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                 "mrope_section": [head_dim // 8, head_dim // 8 * 1.5, head_dim // 8 * 1.5]})
    text["rope_parameters"]["mrope_section"] = [int(x) for x in text["rope_parameters"]["mrope_section"]]
    vision = dict(depth=2, embed_dim=64, hidden_size=TEXT_SHAPE["hidden_size"], num_heads=2, mlp_ratio=2,
                  patch_size=8, spatial_merge_size=2, temporal_patch_size=2)
    config = Qwen2VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    model = Qwen2VLForConditionalGeneration(config).float().eval()
    _copy_text_weights(model.model.language_model, model.lm_head, text_from and Path(text_from))
    return _save(model, tokenizer, Path(out))


def build_gemma4(out: str | Path, seed: int = 0) -> Path:
    """Gemma 4 with Gemma's SentencePiece vocabulary (tests.gguf.vlms: its GGUF converter reads no other kind)."""
    from tests.gguf import vlms

    return vlms.build_gemma4(Path(out), seed)


BUILDERS = {"llava": build_llava, "qwen2_vl": build_qwen2_vl, "gemma4": build_gemma4}


# ---------------------------------------------------------------- every family of quantkit.arch.vlm.FAMILIES
# (config class, model class, image placeholder tokens, config kwargs given the tokenizer's ids);
# text models take TEXT_SHAPE, vision towers are 1-2 tiny layers on 32 px images with 8 px patches.

def _mrope(text: dict) -> dict:
    head_dim = TEXT_SHAPE["hidden_size"] // TEXT_SHAPE["num_attention_heads"]
    return {**text, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                        "mrope_section": [head_dim // 8, head_dim // 8 * 3 // 2, head_dim // 8 * 3 // 2]}}


SIGLIP = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, image_size=32,
              patch_size=8)


def _family_config(kind: str, text: dict, ids: dict):
    import transformers as T

    if kind == "llava_next":
        return T.LlavaNextConfig(vision_config=T.CLIPVisionConfig(**SIGLIP), text_config=T.LlamaConfig(**text),
                                 image_token_index=ids["<image>"], image_grid_pinpoints=[[32, 32], [32, 64]])
    if kind == "qwen2_5_vl":
        return T.Qwen2_5_VLConfig(
            text_config=_mrope(text), vision_config=dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2,
                                                         out_hidden_size=text["hidden_size"], patch_size=8,
                                                         fullatt_block_indexes=[0]),
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    if kind == "qwen3_vl":
        return T.Qwen3VLConfig(
            text_config={**_mrope(text), "head_dim": 64},
            vision_config=dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2,
                               out_hidden_size=text["hidden_size"], patch_size=8, deepstack_visual_indexes=[0],
                               num_position_embeddings=16),
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    if kind == "qwen3_5":  # a Gated DeltaNet layer, then a gated full-attention one (Qwen3.5's hybrid)
        return T.Qwen3_5Config(
            text_config={**text, "head_dim": 64, "layer_types": ["linear_attention", "full_attention"],
                         "full_attention_interval": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                         "linear_key_head_dim": 64, "linear_value_head_dim": 64},
            vision_config=dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2,
                               out_hidden_size=text["hidden_size"], patch_size=8, num_position_embeddings=16),
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    if kind == "qwen3_5_moe":  # Qwen3.5's hybrid with a mixture of experts (and a gated shared expert) in every layer
        return T.Qwen3_5MoeConfig(
            text_config={**text, "head_dim": 64, "layer_types": ["linear_attention", "full_attention"],
                         "full_attention_interval": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                         "linear_key_head_dim": 64, "linear_value_head_dim": 64, "num_experts": 4,
                         "num_experts_per_tok": 2, "moe_intermediate_size": 256,
                         "shared_expert_intermediate_size": 256},
            vision_config=dict(depth=1, hidden_size=64, intermediate_size=128, num_heads=2,
                               out_hidden_size=text["hidden_size"], patch_size=8, num_position_embeddings=16),
            image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    if kind in ("idefics3", "smolvlm"):
        cls = T.Idefics3Config if kind == "idefics3" else T.SmolVLMConfig
        # as on the Hub, text_config names its architecture (llama.cpp's converter reads it, quantkit.gguf too)
        return cls(text_config={**text, "model_type": "llama", "architectures": [TEXT_ARCHITECTURES[kind]]},
                   vision_config=SIGLIP, scale_factor=2, image_token_id=ids["<image>"])
    if kind == "gemma3":
        return T.Gemma3Config(text_config={**text, "head_dim": 64, "query_pre_attn_scalar": 64},
                              vision_config=SIGLIP, mm_tokens_per_image=4,
                              image_token_index=ids["<image_soft_token>"], boi_token_index=ids["<start_of_image>"],
                              eoi_token_index=ids["<end_of_image>"])
    if kind == "paligemma":
        return T.PaliGemmaConfig(text_config={**text, "model_type": "gemma", "head_dim": 64},
                                 vision_config={**SIGLIP, "projection_dim": text["hidden_size"]},
                                 image_token_index=ids["<image>"])
    if kind == "mllama":
        return T.MllamaConfig(
            text_config={**text, "num_hidden_layers": 3, "cross_attention_layers": [1]},
            vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_global_layers=1,
                               attention_heads=2, image_size=32, patch_size=8, vision_output_dim=128,
                               intermediate_layers_indices=[0], max_num_tiles=1, supported_aspect_ratios=[[1, 1]]),
            image_token_index=ids["<|image|>"])
    if kind == "mistral3":
        return T.Mistral3Config(text_config={**text, "model_type": "mistral", "sliding_window": None},  # as Mistral Small 3.1
                                # 3 layers, as every released Pixtral tower has more (llama.cpp's converter maps
                                # the projector's linear_1 / linear_2 as blocks 1 / 2 of the tower's tensor map)
                                vision_config={**SIGLIP, "head_dim": 32, "num_hidden_layers": 3},
                                image_token_index=ids["[IMG]"],
                                spatial_merge_size=2)
    if kind == "internvl":
        return T.InternVLConfig(text_config={**text, "model_type": "qwen2"},
                                vision_config={**SIGLIP, "image_size": [32, 32], "patch_size": [8, 8]},
                                image_token_id=ids["<IMG_CONTEXT>"], downsample_ratio=0.5)
    if kind == "llama4":  # a mixture of experts in every text layer, as Llama 4 Scout / Maverick
        return T.Llama4Config(text_config={**text, "head_dim": 64, "intermediate_size_mlp": 512, "num_local_experts": 4,
                                           "num_experts_per_tok": 1, "interleave_moe_layer_step": 1},
                              vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                                 num_attention_heads=2, image_size=32, patch_size=8,
                                                 vision_output_dim=64, projector_input_dim=64,
                                                 projector_output_dim=text["hidden_size"]),
                              image_token_index=ids["<|patch|>"])
    raise KeyError(kind)


FAMILY_TOKENS = {
    "llava_next": ["<image>"], "qwen2_5_vl": QWEN2_VL_TOKENS, "qwen3_vl": QWEN2_VL_TOKENS,
    "qwen3_5": QWEN2_VL_TOKENS, "qwen3_5_moe": QWEN2_VL_TOKENS,
    "idefics3": ["<image>", "<fake_token_around_image>", "<global-img>"],
    "smolvlm": ["<image>", "<fake_token_around_image>", "<global-img>"],
    "gemma3": ["<image_soft_token>", "<start_of_image>", "<end_of_image>"], "paligemma": ["<image>"],
    "mllama": ["<|image|>"], "mistral3": ["[IMG]", "[IMG_BREAK]", "[IMG_END]"],
    "internvl": ["<IMG_CONTEXT>", "<img>", "</img>"], "llama4": ["<|image|>", "<|patch|>", "<|image_start|>",
                                                                 "<|image_end|>"],
}


def build_family(kind: str, out: str | Path, seed: int = 0) -> Path:
    """A tiny random VLM of one family (transformers 5.17 classes), saved with its tokenizer."""
    import torch
    from transformers import AutoModelForImageTextToText

    if kind in BUILDERS:
        return BUILDERS[kind](out, seed=seed)
    torch.manual_seed(seed)
    tokenizer = vlm_tokenizer(FAMILY_TOKENS[kind])
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in FAMILY_TOKENS[kind]}
    text = dict(vocab_size=len(tokenizer), tie_word_embeddings=False, **TEXT_SHAPE, **_ids(tokenizer))
    config = _family_config(kind, text, ids)
    config.tie_word_embeddings = False
    model = AutoModelForImageTextToText.from_config(config).float().eval()
    _save(model, tokenizer, Path(out))
    save_processor(kind, Path(out))
    return Path(out)


TEXT_ARCHITECTURES = {"idefics3": "LlamaForCausalLM", "smolvlm": "VLlama3ForCausalLM"}  # as their Hub checkpoints
FAMILY_KINDS = ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "idefics3", "smolvlm", "gemma3",
                "paligemma", "mllama", "mistral3", "internvl", "llama4", "gemma4", "qwen3_5", "qwen3_5_moe")
