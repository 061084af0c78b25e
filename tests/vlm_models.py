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
    return _save(model, tokenizer, Path(out))


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


BUILDERS = {"llava": build_llava, "qwen2_vl": build_qwen2_vl}
