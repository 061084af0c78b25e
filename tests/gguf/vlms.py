"""Tiny VLMs for the GGUF mmproj tests, stored the way their Hub checkpoints are.

transformers 5.17 saves a CLIP / SigLIP tower without its `vision_model.` level
(`vision_tower.encoder.layers...`), while the checkpoints people download (llava-hf/llava-1.5-7b-hf,
google/gemma-3-4b-it) keep it (`vision_tower.vision_model.encoder.layers...`) and llama.cpp's
converters only know that layout. `hub_layout` rewrites a saved checkpoint to it (transformers
loads both). Shapes are chosen so that llama.cpp's converters and its clip code accept them:
Qwen's vision depth is at least 3 (convert_hf_to_gguf maps `merger.mlp.2` through a tensor map
sized by the depth), Qwen2.5-VL's full-attention blocks are evenly spaced (n_wa_pattern), and every
family has an image processor config with image_mean / image_std (the mmproj metadata needs them).
"""

from __future__ import annotations

import json
from pathlib import Path

from tests.vlm_models import QWEN2_VL_TOKENS, TEXT_ARCHITECTURES, TEXT_SHAPE, _ids, _save, save_processor, vlm_tokenizer

KINDS = ("llava", "qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe", "gemma4", "idefics3", "smolvlm",
         "mistral3", "gemma3")
# the towers whose Hub checkpoints keep the vision model's own `vision_model.` level
NESTED_TOWERS = {"llava": "vision_tower.", "gemma3": "vision_tower."}
QWEN_PREPROCESSOR = {"image_processor_type": "Qwen2VLImageProcessor", "min_pixels": 32 * 32, "max_pixels": 64 * 64,
                     "patch_size": 8, "temporal_patch_size": 2, "merge_size": 2,
                     "image_mean": [0.48145466, 0.4578275, 0.40821073],
                     "image_std": [0.26862954, 0.26130258, 0.27577711]}

PREPROCESSORS = {kind: {"image_processor_type": "Idefics3ImageProcessor", "size": {"longest_edge": 32},
                        "max_image_size": {"longest_edge": 32}, "image_mean": [0.5, 0.5, 0.5],
                        "image_std": [0.5, 0.5, 0.5]} for kind in ("idefics3", "smolvlm")}
PREPROCESSORS["mistral3"] = {"image_processor_type": "PixtralImageProcessor", "patch_size": 8,
                             "size": {"longest_edge": 32}, "image_mean": [0.48145466, 0.4578275, 0.40821073],
                             "image_std": [0.26862954, 0.26130258, 0.27577711]}



def hub_layout(model_dir: Path, kind: str) -> Path:
    """Rename the tower tensors of a saved checkpoint to the Hub layout (`vision_model.` kept)."""
    from safetensors.torch import load_file, save_file

    prefix = NESTED_TOWERS.get(kind)
    if prefix is None:
        return model_dir
    path = model_dir / "model.safetensors"
    state = load_file(str(path))
    renamed = {(prefix + "vision_model." + k[len(prefix):] if k.startswith(prefix) else k): v for k, v in state.items()}
    save_file(renamed, str(path), metadata={"format": "pt"})
    return model_dir


def _config(kind: str, text: dict, ids: dict):
    import transformers as T

    head_dim = TEXT_SHAPE["hidden_size"] // TEXT_SHAPE["num_attention_heads"]
    mrope = {"rope_type": "default", "rope_theta": 10000.0,
             "mrope_section": [head_dim // 8, head_dim // 8 * 3 // 2, head_dim // 8 * 3 // 2]}
    qwen_ids = dict(image_token_id=ids.get("<|image_pad|>"), video_token_id=ids.get("<|video_pad|>"),
                    vision_start_token_id=ids.get("<|vision_start|>"), vision_end_token_id=ids.get("<|vision_end|>"))
    if kind == "llava":
        vision = T.CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                    image_size=32, patch_size=8, projection_dim=64)
        return T.LlavaConfig(vision_config=vision, text_config=T.LlamaConfig(**text), image_token_index=ids["<image>"],
                             image_seq_length=(32 // 8) ** 2)
    if kind == "qwen2_vl":
        return T.Qwen2VLConfig(text_config={**text, "rope_parameters": mrope},
                               vision_config=dict(depth=3, embed_dim=64, hidden_size=text["hidden_size"], num_heads=2,
                                                  mlp_ratio=2, patch_size=8, spatial_merge_size=2,
                                                  temporal_patch_size=2), **qwen_ids)
    if kind == "qwen2_5_vl":
        return T.Qwen2_5_VLConfig(text_config={**text, "rope_parameters": mrope},
                                  vision_config=dict(depth=4, hidden_size=64, intermediate_size=128, num_heads=2,
                                                     out_hidden_size=text["hidden_size"], patch_size=8,
                                                     spatial_merge_size=2, temporal_patch_size=2, window_size=32,
                                                     fullatt_block_indexes=[1, 3]), **qwen_ids)
    if kind == "qwen3_vl":  # the deepstack merger 0 reads block 1: it is written under the block's number
        return T.Qwen3VLConfig(text_config={**text, "rope_parameters": mrope, "head_dim": head_dim},
                               vision_config=dict(depth=3, hidden_size=64, intermediate_size=128, num_heads=2,
                                                  out_hidden_size=text["hidden_size"], patch_size=8,
                                                  spatial_merge_size=2, temporal_patch_size=2,
                                                  num_position_embeddings=16, deepstack_visual_indexes=[1]),
                               **qwen_ids)
    # Qwen3.5's text model (a Gated DeltaNet layer and a gated full-attention one) and Qwen3-VL's tower, no deepstack
    hybrid = {**text, "head_dim": head_dim, "layer_types": ["linear_attention", "full_attention"],
              "full_attention_interval": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
              "linear_key_head_dim": 64, "linear_value_head_dim": 64}
    qwen35_tower = dict(depth=3, hidden_size=64, intermediate_size=128, num_heads=2,
                        out_hidden_size=text["hidden_size"], patch_size=8, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
    if kind == "qwen3_5":
        return T.Qwen3_5Config(text_config=hybrid, vision_config=qwen35_tower, **qwen_ids)
    if kind == "qwen3_5_moe":  # with 4 experts (and a gated shared expert) in each layer
        experts = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
                   "shared_expert_intermediate_size": 256}
        return T.Qwen3_5MoeConfig(text_config=hybrid | experts, vision_config=qwen35_tower, **qwen_ids)
    if kind in ("idefics3", "smolvlm"):  # the converter converts their language model through text_config.architectures
        cls = T.Idefics3Config if kind == "idefics3" else T.SmolVLMConfig
        return cls(text_config={**text, "model_type": "llama", "architectures": [TEXT_ARCHITECTURES[kind]]},
                   vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, image_size=32, patch_size=8),
                   scale_factor=2, image_token_id=ids["<image>"])
    if kind == "mistral3":  # a Pixtral tower 3 layers deep: the converter maps linear_1 / linear_2 as blocks 1 / 2
        return T.Mistral3Config(text_config={**text, "model_type": "mistral", "sliding_window": None},
                                vision_config=dict(model_type="pixtral", hidden_size=64, intermediate_size=128,
                                                   num_hidden_layers=3, num_attention_heads=2, head_dim=32,
                                                   image_size=32, patch_size=8),
                                image_token_index=ids["[IMG]"], spatial_merge_size=2)
    if kind == "gemma3":
        siglip = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                      image_size=32, patch_size=8, vision_use_head=False)
        return T.Gemma3Config(text_config={**text, "head_dim": 64, "query_pre_attn_scalar": 64},
                              vision_config=siglip, mm_tokens_per_image=4,
                              image_token_index=ids["<image_soft_token>"], boi_token_index=ids["<start_of_image>"],
                              eoi_token_index=ids["<end_of_image>"])
    raise KeyError(kind)


# llama.cpp's mtmd wraps an Idefics3 image in "\n\n<fake_token_around_image><global-img>", each looked up as one
# vocabulary token (aborting, GGML_ASSERT(idx >= 0), when one is missing): the Hub tokenizers have "\n\n", the toy one
# gets it as an added token
IDEFICS3_TOKENS = ["<image>", "<fake_token_around_image>", "<global-img>", "\n\n"]
TOKENS = {"llava": ["<image>"], "qwen2_vl": QWEN2_VL_TOKENS, "qwen2_5_vl": QWEN2_VL_TOKENS, "qwen3_vl": QWEN2_VL_TOKENS,
          "qwen3_5": QWEN2_VL_TOKENS, "qwen3_5_moe": QWEN2_VL_TOKENS, "idefics3": IDEFICS3_TOKENS, "smolvlm": IDEFICS3_TOKENS, "mistral3": ["[IMG]", "[IMG_BREAK]", "[IMG_END]"],
          "gemma3": ["<image_soft_token>", "<start_of_image>", "<end_of_image>"]}


def gemma4_config(vocab: int, ids: dict, clipped: bool = False):
    """Gemma 4 as its small checkpoints are (tests.vlm_models' text shape) with a 2-layer tower; `clipped`: its
    ClippableLinears with stored clipping bounds (use_clipped_linears)."""
    import transformers as T

    text = dict(TEXT_SHAPE, vocab_size=vocab, **ids, num_hidden_layers=4,
                layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2, head_dim=64,
                global_head_dim=128, hidden_size_per_layer_input=64, vocab_size_per_layer_input=vocab,
                sliding_window=32, final_logit_softcapping=30.0)
    image = {name: vocab - 1 - i for i, name in enumerate(("image_token_id", "boi_token_id", "eoi_token_id",
                                                            "video_token_id", "audio_token_id", "boa_token_id",
                                                            "eoa_token_index"))}
    return T.Gemma4Config(text_config=text, audio_config=None, tie_word_embeddings=True, **image,
                          vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=2, head_dim=32, patch_size=8,
                                             position_embedding_size=64, pooling_kernel_size=2,
                                             use_clipped_linears=clipped))


def build_gemma4(out: Path, seed: int = 0, clipped: bool = False) -> Path:
    """A tiny Gemma 4 VLM with Gemma's SentencePiece vocabulary as tokenizer.json (what its converter reads), tied
    embeddings as Gemma 4 ships them, clipping bounds away from infinity when stored."""
    import torch
    from transformers import AutoModelForImageTextToText

    from tests.gguf.families import write_spm_json_tokenizer

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    vocab, ids = write_spm_json_tokenizer(out, "gemma")
    model = AutoModelForImageTextToText.from_config(gemma4_config(vocab, ids, clipped)).float().eval()
    with torch.no_grad():
        for name, p in model.named_buffers():
            if name.endswith(("input_max", "output_max")):
                p.fill_(8.0)
            elif name.endswith(("input_min", "output_min")):
                p.fill_(-8.0)
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    model.to(torch.bfloat16).save_pretrained(out)
    (out / "preprocessor_config.json").write_text(json.dumps(GEMMA4_PREPROCESSOR, indent=2))
    return out


GEMMA4_PREPROCESSOR = {"image_processor_type": "Gemma4ImageProcessor", "image_mean": [0.5, 0.5, 0.5],
                       "image_std": [0.5, 0.5, 0.5], "patch_size": 8, "pooling_kernel_size": 2}


def build_vlm(kind: str, out: str | Path, seed: int = 0, layout: str = "hub") -> Path:
    """A tiny random VLM of `kind` (bf16 safetensors, tokenizer, image processor config) in the Hub
    layout, or as transformers 5.17 saves it (layout="transformers")."""
    import torch
    from transformers import AutoModelForImageTextToText

    out = Path(out)
    if kind in ("gemma4", "gemma4_clipped"):
        return build_gemma4(out, seed, clipped=kind == "gemma4_clipped")
    torch.manual_seed(seed)
    tokenizer = vlm_tokenizer(TOKENS[kind])
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in TOKENS[kind]}
    text = dict(vocab_size=len(tokenizer), tie_word_embeddings=False, **TEXT_SHAPE, **_ids(tokenizer))
    config = _config(kind, text, ids)
    config.tie_word_embeddings = kind == "gemma3"
    model = AutoModelForImageTextToText.from_config(config).float().eval()
    with torch.no_grad():  # norms away from 1 and 0 so that a lost +1 shift or a swapped tensor shows
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.add_(torch.randn_like(p) * 0.1)
    _save(model, tokenizer, out)
    if kind in ("llava", "gemma3"):
        save_processor(kind, out)
    else:
        (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSORS.get(kind, QWEN_PREPROCESSOR), indent=2))
    return hub_layout(out, kind) if layout == "hub" else out
