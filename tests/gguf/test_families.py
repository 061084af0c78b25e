"""Every supported family: conversion round trip through quantkit's loader, metadata, mixture
rules for experts, and the early refusals of what the converter does not handle."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.gguf.families import build_family
from tests.gguf.helpers import convert_to, fields

_BUILT: dict[str, Path] = {}
ROUND_TRIP = ["llama31", "llama32", "mixtral", "qwen25", "qwen3moe", "gemma3", "gemma3vlm", "phi3"]
TOKENIZER = {"phi3": "spm", "gemma3vlm": "spm"}


@pytest.fixture(scope="module", params=ROUND_TRIP)
def family(request, tmp_path_factory) -> tuple[str, Path]:
    name = request.param
    if name not in _BUILT:
        _BUILT[name] = build_family(name, tmp_path_factory.mktemp("families") / name, TOKENIZER.get(name, "bpe"))
    return name, _BUILT[name]


def load_base(model: Path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model)
    return AutoModelForCausalLM.from_pretrained(model, config=config, dtype=torch.float32).eval()


def load_converted(path: Path, model: Path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from quantkit.gguf.loader import to_hf_state_dict

    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    state = to_hf_state_dict(path, AutoConfig.from_pretrained(model).to_dict())
    missing = set(base.state_dict()) - set(state)
    assert all("vision_tower" in m or "multi_modal_projector" in m for m in missing), sorted(missing)[:5]
    base.load_state_dict(state, strict=False)
    return base


def logits(model, vocab: int):
    import torch

    ids = torch.randint(3, vocab, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_f32_round_trip_exact(family, tmp_path):
    import torch

    name, model = family
    path = tmp_path / "f32.gguf"
    convert_to(model, path, "F32")
    base, loaded = load_base(model), load_converted(path, model)
    ref = base.state_dict()
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, ref[key]), key
    vocab = base.config.get_text_config().vocab_size
    torch.testing.assert_close(logits(loaded, vocab), logits(base, vocab), rtol=0, atol=0)


def test_q8_0_close(family, tmp_path):
    import torch

    name, model = family
    path = tmp_path / "q8.gguf"
    convert_to(model, path, "Q8_0")
    base, loaded = load_base(model), load_converted(path, model)
    vocab = base.config.get_text_config().vocab_size
    lp_b = torch.log_softmax(logits(base, vocab), -1)
    lp_q = torch.log_softmax(logits(loaded, vocab), -1)
    assert float((lp_b.exp() * (lp_b - lp_q)).sum(-1).mean()) < 1e-2


def test_family_metadata_and_tensors(family, tmp_path):
    import gguf

    name, model = family
    path = tmp_path / "m.gguf"
    convert_to(model, path, "Q4_K_M")
    meta = fields(path)
    arch = meta["general.architecture"]
    shapes = {t.name: tuple(int(d) for d in t.shape) for t in gguf.GGUFReader(str(path)).tensors}
    types = {t.name: t.tensor_type.name for t in gguf.GGUFReader(str(path)).tensors}
    assert meta[f"{arch}.block_count"] == 2 and meta[f"{arch}.embedding_length"] == 256
    if name.startswith("llama3"):
        assert shapes["rope_freqs.weight"] == (32,) and types["rope_freqs.weight"] == "F32"
        assert ("output.weight" in shapes) == (name == "llama31")
    if name in ("mixtral", "qwen3moe"):
        assert meta[f"{arch}.expert_count"] == 4 and meta[f"{arch}.expert_used_count"] == 2
        assert shapes["blk.0.ffn_gate_exps.weight"][2] == 4 and types["blk.0.ffn_gate_inp.weight"] == "F32"
    if name == "phi3":
        assert shapes["rope_factors_long.weight"] == (32,) and "blk.0.attn_qkv.weight" in shapes
        assert meta["phi3.rope.scaling.attn_factor"] == pytest.approx((1 + np.log(2) / np.log(4096)) ** 0.5)
    if name.startswith("gemma3"):
        assert meta["gemma3.attention.sliding_window"] == 32 and "output.weight" not in shapes
        assert not any(n.startswith(("v.", "mm.")) for n in shapes)


def test_eight_experts_bump_attention(tmp_path):
    """llama-quantize's n_expert == 8 rules: attn_v and attn_k Q8_0, attn_output Q5_K (Q4_K_M)."""
    from quantkit.gguf.convert import plan_tensors
    from quantkit.io.checkpoint import check_model_dir

    info = check_model_dir(build_family("mixtral8", tmp_path / "m8"))
    types = {p.name: p.qtype.name for p in plan_tensors(info.config, info.tensors, "Q4_K_M")}
    assert types["blk.0.attn_v.weight"] == "Q8_0" and types["blk.1.attn_k.weight"] == "Q8_0"
    assert types["blk.0.attn_output.weight"] == "Q5_K"
    assert types["blk.1.ffn_down_exps.weight"] == "Q6_K" and types["blk.0.ffn_down_exps.weight"] == "Q4_K"
    assert types["blk.0.ffn_gate_exps.weight"] == "Q4_K" and types["blk.0.ffn_gate_inp.weight"] == "F32"


# ------------------------------------------------------------------ refusals (config only)


def base_config(arch: str, **extra) -> dict:
    return {"architectures": [arch], "num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 256,
            **extra}


REFUSED = [
    (base_config("LlamaForCausalLM", rope_scaling={"rope_type": "dynamic", "factor": 2.0}), "RoPE type 'dynamic'"),
    (base_config("Qwen2ForCausalLM", rope_scaling={"rope_type": "llama3", "factor": 8.0}), "RoPE type 'llama3'"),
    (base_config("Qwen2ForCausalLM", use_sliding_window=True, sliding_window=4096), "sliding-window"),
    (base_config("MistralForCausalLM", sliding_window=4096), "sliding-window"),
    (base_config("Gemma3ForCausalLM", head_dim=64, query_pre_attn_scalar=64,
                 layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    (base_config("Gemma3ForCausalLM", head_dim=64, query_pre_attn_scalar=256), "query_pre_attn_scalar"),
    (base_config("Qwen3MoeForCausalLM", num_experts=4, norm_topk_prob=False), "norm_topk_prob"),
    (base_config("Qwen3MoeForCausalLM", num_experts=4, norm_topk_prob=True, mlp_only_layers=[1]), "dense"),
    (base_config("Qwen2MoeForCausalLM", num_experts=4, shared_expert_intermediate_size=256, norm_topk_prob=True),
     "norm_topk_prob = true"),
    (base_config("Qwen2MoeForCausalLM", num_experts=4, shared_expert_intermediate_size=0), "no shared expert"),
    (base_config("Qwen2MoeForCausalLM", num_experts=4, shared_expert_intermediate_size=256, decoder_sparse_step=2),
     "dense"),
    (base_config("Phi3ForCausalLM", rope_scaling={"rope_type": "linear", "factor": 2.0}), "RoPE type 'linear'"),
    (base_config("Phi3ForCausalLM", rope_scaling={"rope_type": "longrope"}), "long_factor"),
    (base_config("InternVLForConditionalGeneration"), "does not support architecture"),
    (base_config("Qwen2ForCausalLM", rope_scaling={"rope_type": "default", "mrope_section": [8, 12, 12]}),
     "multimodal RoPE sections are not supported"),
    (base_config("Qwen2VLForConditionalGeneration"), "a RoPE without mrope_section is not supported"),
    (base_config("Qwen3VLForConditionalGeneration"), "a RoPE without mrope_section is not supported"),
    (base_config("LlamaForCausalLM", quantization_config={"quant_method": "awq"}), "already quantized"),
]


@pytest.mark.parametrize("config,message", REFUSED, ids=[m for _, m in REFUSED])
def test_arch_spec_refuses_early(config, message):
    from quantkit.errors import UnsupportedError
    from quantkit.gguf.convert import arch_spec

    with pytest.raises(UnsupportedError) as info:
        arch_spec(config)
    assert message in info.value.message and info.value.exit_code == 2
    assert info.value.hint


def test_supported_configs_pass():
    from quantkit.gguf.convert import arch_spec

    arch_spec(base_config("LlamaForCausalLM", rope_scaling={"rope_type": "llama3", "factor": 8.0}))
    arch_spec(base_config("Qwen2ForCausalLM", use_sliding_window=False, sliding_window=131072))
    arch_spec(base_config("Phi3ForCausalLM", rope_scaling={"type": "longrope", "long_factor": [1.0],
                                                           "short_factor": [1.0]}))
    text = base_config("x", head_dim=64, query_pre_attn_scalar=64)
    del text["architectures"]  # a text_config naming architectures is what the converter converts (SmolVLM)
    arch_spec({"architectures": ["Gemma3ForConditionalGeneration"], "text_config": text})


def test_fused_experts_refused_where_no_converter_step_writes_them():
    """Mixtral's converter class takes one tensor per expert only; Qwen3-MoE's takes its fused experts too."""
    from quantkit.errors import UnsupportedError
    from quantkit.gguf.convert import check_convertible

    fused = {"model.layers.0.mlp.experts.gate_up_proj": ("BF16", [4, 512, 256])}
    with pytest.raises(UnsupportedError, match="fused expert"):
        check_convertible(base_config("MixtralForCausalLM", num_local_experts=4), fused)
    assert check_convertible(base_config("Qwen3MoeForCausalLM", num_experts=4, norm_topk_prob=True), fused).arch \
        == "QWEN3MOE"


def test_sentencepiece_vocab_as_converter(tmp_path):
    """Scores and types from tokenizer.model; the tokenizer_config.json specials CONTROL, -1000."""
    model = build_family("mistral", tmp_path / "m", "spm")
    cfg = json.loads((model / "config.json").read_text())
    path = tmp_path / "v.gguf"
    convert_to(model, path, "F16")
    meta = fields(path)
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model / "tokenizer.model"))
    scores, types = meta["tokenizer.ggml.scores"], meta["tokenizer.ggml.token_type"]
    assert len(scores) == cfg["vocab_size"]
    assert types[:3] == [3, 3, 3] and scores[:3] == [-1000.0] * 3  # <unk>, <s>, </s>
    assert np.allclose(scores[3:], [sp.GetScore(i) for i in range(3, sp.vocab_size())])
    assert meta["tokenizer.ggml.model"] == "llama" and meta["tokenizer.ggml.add_bos_token"] is True


@pytest.mark.parametrize("name", ["mixtral", "gemma3", "gemma3vlm"])
def test_pipeline_gate_reads_family_back(cli, name, tmp_path):
    """quantkit quantize --method gguf: the gate evaluates the .gguf read back into the HF
    architecture (experts fused in memory, Gemma 3's per-layer-type RoPE, a VLM's towers from the base).
    The VLM fixture has no image processor config, so its mmproj cannot be written: --mmproj none
    asks for the language model alone (tests/gguf/test_vlm_gguf.py covers the mmproj)."""
    from tests.util import FAST_CALIB

    model = build_family(name, tmp_path / name)
    out = tmp_path / "out"
    result = cli("quantize", model, "--method", "gguf", "--gguf-type", "Q8_0", "-o", out, *FAST_CALIB,
                 "--min-top1", "0.5", *(["--mmproj", "none"] if name == "gemma3vlm" else []))
    assert result.exit_code == 0, result.output
    target = json.loads((out / "quantkit.json").read_text())["targets"][0]
    assert target["gate"]["passed"] and target["metrics"]["kld_mean"] < 0.01


def test_gate_reads_gemma3_embedding_trimmed_to_the_tokenizer(cli, tmp_path):
    """A Gemma 3 whose embedding has rows past its tokenizer's vocabulary: the .gguf keeps the tokenizer's rows (as
    llama.cpp's converter trims them), and the gate reads it back with the config's rows, the trimmed ones zero
    (the random base puts real probability on its padded ids, so the gate is measured, not enforced)."""
    import math

    from transformers import AutoTokenizer

    from tests.util import FAST_CALIB

    model = build_family("gemma3", tmp_path / "g3", padded_rows=100)
    out = tmp_path / "out"
    result = cli("quantize", model, "--method", "gguf", "--gguf-type", "Q8_0", "-o", out, *FAST_CALIB, "--no-gate")
    assert result.exit_code == 0, result.output
    import gguf

    tensors = {t.name: t for t in gguf.GGUFReader(str(next(out.glob("*.gguf")))).tensors}
    rows = int(tensors["token_embd.weight"].shape[1])
    assert len(AutoTokenizer.from_pretrained(model)) <= rows < json.loads((model / "config.json").read_text())["vocab_size"]
    assert math.isfinite(json.loads((out / "quantkit.json").read_text())["targets"][0]["metrics"]["kld_mean"])


@pytest.mark.parametrize("name", ["mixtral", "gemma3vlm"])
def test_imatrix_covers_experts_and_vlm_language_model(name, tmp_path):
    """quantkit's imatrix: per-expert rows for stacked experts (routed tokens only, as
    llama-imatrix's MUL_MAT_ID collection; top-2 -> 2 rows per token), a VLM's language model."""
    import torch

    from quantkit.gguf import imatrix as im

    model_dir = build_family(name, tmp_path / name)
    base = load_base(model_dir)
    windows = torch.randint(3, 500, (2, 32), generator=torch.Generator().manual_seed(1))
    result = im.compute(base, windows, base.config.to_dict())
    assert "blk.1.attn_q.weight" in result.sums and "blk.0.ffn_down.weight" not in result.sums or name != "mixtral"
    if name == "mixtral":
        assert result.sums["blk.0.ffn_gate_exps.weight"].shape == (4, 256)
        assert result.sums["blk.0.ffn_down_exps.weight"].shape == (4, 512)
        assert result.counts["blk.1.ffn_up_exps.weight"].sum() == 2 * 64
        back = im.read(im.write(result, tmp_path / "im.gguf"))
        np.testing.assert_array_equal(back.weights()["blk.0.ffn_down_exps.weight"],
                                      result.weights()["blk.0.ffn_down_exps.weight"])
    else:
        assert result.counts["blk.0.ffn_down.weight"][0] == 64


def test_plan_from_sparse_config_json():
    """config.json may omit values equal to transformers' defaults (a Gemma 3 VLM's text_config):
    planning fills them in as AutoConfig does, and the towers are left out."""
    from quantkit.gguf.convert import plan_tensors

    config = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
              "text_config": {"model_type": "gemma3_text", "hidden_size": 256, "intermediate_size": 512,
                              "num_hidden_layers": 2, "head_dim": 64, "query_pre_attn_scalar": 64},
              "vision_config": {"model_type": "siglip_vision_model"}}
    hf = {"language_model.model.embed_tokens.weight": ("BF16", [512, 256]),
          "language_model.model.layers.0.self_attn.q_proj.weight": ("BF16", [512, 256]),
          "vision_tower.vision_model.post_layernorm.weight": ("BF16", [64])}
    types = {p.name: p.qtype.name for p in plan_tensors(config, hf, "Q4_K_M")}
    assert types == {"token_embd.weight": "Q6_K", "blk.0.attn_q.weight": "Q4_K"}
