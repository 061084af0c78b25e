"""HF -> GGUF conversion: metadata, tokenizer round trip, weights round trip, llama.cpp agreement.

The llama.cpp tests run when scripts/build_llamacpp.sh has built third_party/llama.cpp
(otherwise they skip, saying so). They compare quantkit's quantized files tensor by tensor
with llama-quantize's output from quantkit's own F16 GGUF of a checkpoint stored in f16 (so
both quantize the same values), and check llama-perplexity evaluates quantkit's file.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import numpy as np
import pytest

from tests.gguf.helpers import (
    ALL_MIXES,
    SAMPLE,
    convert_to,
    fields,
    load_gguf_model,
    need_llama,
    run_quantize,
    tensor_bytes,
)

# ------------------------------------------------------------------ metadata and names


def test_metadata_complete(micro, tmp_path):
    from gguf import LlamaFileType

    path = tmp_path / "m.gguf"
    convert_to(micro, path, "Q8_0")
    meta = fields(path)
    cfg = json.loads((micro / "config.json").read_text())
    assert meta["general.architecture"] == "llama"
    assert meta["general.file_type"] == LlamaFileType.MOSTLY_Q8_0
    assert meta["general.quantization_version"] == 2
    assert meta["llama.block_count"] == cfg["num_hidden_layers"]
    assert meta["llama.context_length"] == cfg["max_position_embeddings"]
    assert meta["llama.embedding_length"] == cfg["hidden_size"]
    assert meta["llama.feed_forward_length"] == cfg["intermediate_size"]
    assert meta["llama.attention.head_count"] == cfg["num_attention_heads"]
    assert meta["llama.attention.head_count_kv"] == cfg["num_key_value_heads"]
    assert meta["llama.rope.dimension_count"] == cfg["hidden_size"] // cfg["num_attention_heads"]
    assert meta["llama.vocab_size"] == cfg["vocab_size"]
    assert meta["llama.rope.freq_base"] == pytest.approx(10000.0)
    assert meta["llama.attention.layer_norm_rms_epsilon"] == pytest.approx(1e-5)
    assert meta["tokenizer.ggml.model"] == "gpt2"
    assert meta["tokenizer.ggml.pre"] == "gpt-2"
    assert meta["tokenizer.ggml.bos_token_id"] == 1 and meta["tokenizer.ggml.eos_token_id"] == 2
    assert meta["tokenizer.ggml.add_bos_token"] is True
    assert "<|assistant|>" in meta["tokenizer.chat_template"]


def test_unsupported_architecture_names_supported():
    from quantkit.errors import UnsupportedError
    from quantkit.gguf.convert import arch_spec

    with pytest.raises(UnsupportedError) as info:
        arch_spec({"architectures": ["GPTNeoXForCausalLM"]})
    assert info.value.exit_code == 2
    assert "LlamaForCausalLM" in info.value.hint and "Qwen2ForCausalLM" in info.value.hint


def test_permute_matches_llama_pair_order():
    from quantkit.gguf.convert import permute, unpermute

    w = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)  # 2 heads of dim 8
    p = permute(w, 2)
    # per head: rows 0, 4, 1, 5, 2, 6, 3, 7 (first half / second half interleaved)
    assert [int(r) for r in p[:8, 0] // 3] == [0, 4, 1, 5, 2, 6, 3, 7]
    assert np.array_equal(unpermute(p, 2), w)


def test_qwen_names_and_no_permute():
    from quantkit.gguf.convert import permute_heads, plan_tensors

    cfg = {"architectures": ["Qwen3ForCausalLM"], "num_hidden_layers": 1, "num_attention_heads": 4,
           "num_key_value_heads": 2}
    hf = {"model.embed_tokens.weight": ("BF16", [512, 256]), "model.norm.weight": ("BF16", [256]),
          "model.layers.0.self_attn.q_norm.weight": ("BF16", [64]),
          "model.layers.0.self_attn.q_proj.weight": ("BF16", [256, 256])}
    plans = {p.name: p for p in plan_tensors(cfg, hf, "Q4_K_M")}
    assert set(plans) == {"token_embd.weight", "output_norm.weight", "blk.0.attn_q_norm.weight",
                          "blk.0.attn_q.weight"}
    assert plans["token_embd.weight"].qtype.name == "Q6_K"  # tied embeddings follow the output rule
    assert permute_heads(cfg, "model.layers.0.self_attn.q_proj.weight") is None


# ------------------------------------------------------------------ tokenizer round trip


def gguf_tokenizer(path: Path):
    """A `tokenizers` byte-level BPE rebuilt from the GGUF's tokens and merges only."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    meta = fields(path)
    tokens = meta["tokenizer.ggml.tokens"]
    merges = [tuple(m.split(" ")) for m in meta["tokenizer.ggml.merges"]]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def test_tokenizer_round_trip(micro, tmp_path):
    from transformers import AutoTokenizer

    path = tmp_path / "v.gguf"
    convert_to(micro, path, "F16")
    hf = AutoTokenizer.from_pretrained(micro)
    rebuilt = gguf_tokenizer(path)
    for text in (SAMPLE, "The quick brown fox.", "  leading spaces\tand tabs\n\nnewlines"):
        assert rebuilt.encode(text).ids == hf(text, add_special_tokens=False)["input_ids"]
    types = fields(path)["tokenizer.ggml.token_type"]
    assert types[1] == 3 and types[100] == 1  # <s> CONTROL, a merged token NORMAL


# ------------------------------------------------------------------ weights round trip


def test_f32_round_trip_exact(micro, tmp_path):
    from safetensors.torch import load_file

    from quantkit.gguf.loader import to_hf_state_dict

    path = tmp_path / "f32.gguf"
    result = convert_to(micro, path, "F32")
    assert result.type_counts == {"F32": result.tensors}
    state = to_hf_state_dict(path, json.loads((micro / "config.json").read_text()))
    ref = load_file(micro / "model.safetensors")
    assert set(state) == set(ref)
    for name, tensor in ref.items():
        assert np.array_equal(state[name].numpy(), tensor.float().numpy()), name


def test_f16_round_trip(micro_f16, tmp_path):
    from safetensors.torch import load_file

    from quantkit.gguf.loader import to_hf_state_dict

    path = tmp_path / "f16.gguf"
    assert convert_to(micro_f16, path, "F16").type_counts == {"F16": 16, "F32": 5}
    state = to_hf_state_dict(path, json.loads((micro_f16 / "config.json").read_text()))
    for name, tensor in load_file(micro_f16 / "model.safetensors").items():
        assert np.array_equal(state[name].numpy(), tensor.float().numpy()), name


def test_streamed_slabs_equal_whole_tensor(micro, tmp_path, monkeypatch):
    import quantkit.gguf.convert as conv

    whole, slabs = tmp_path / "whole.gguf", tmp_path / "slabs.gguf"
    convert_to(micro, whole, "Q8_0")
    monkeypatch.setattr(conv, "SLAB_ELEMENTS", 256 * 7)  # 7 rows per slab
    convert_to(micro, slabs, "Q8_0")
    assert whole.read_bytes() == slabs.read_bytes()


def test_q8_0_evaluates_close_to_base(micro, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    path = tmp_path / "q8.gguf"
    convert_to(micro, path, "Q8_0")
    base = AutoModelForCausalLM.from_pretrained(micro, dtype=torch.float32).eval()
    quant = load_gguf_model(path, micro)
    ids = torch.randint(0, 500, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lp_b = torch.log_softmax(base(ids).logits, -1)
        lp_q = torch.log_softmax(quant(ids).logits, -1)
    kld = (lp_b.exp() * (lp_b - lp_q)).sum(-1).mean()
    assert 0 < float(kld) < 1e-3


# ------------------------------------------------------------------ against llama.cpp (optional)


@pytest.mark.slow
@pytest.mark.parametrize("gguf_type", ALL_MIXES)
def test_bit_exact_with_llama_quantize(micro_f16, tmp_path, gguf_type):
    need_llama("llama-quantize")
    f16 = tmp_path / "f16.gguf"
    convert_to(micro_f16, f16, "F16")
    theirs, ours = tmp_path / "theirs.gguf", tmp_path / "ours.gguf"
    run_quantize(f16, theirs, gguf_type)
    convert_to(micro_f16, ours, gguf_type)
    a, b = tensor_bytes(theirs), tensor_bytes(ours)
    assert list(a) == list(b)  # same tensor order
    for name in a:
        assert a[name][0] == b[name][0], f"{name}: type {b[name][0]} != llama-quantize {a[name][0]}"
        assert a[name][1] == b[name][1], f"{name} ({a[name][0]}): bytes differ"


@pytest.mark.slow
def test_llama_perplexity_runs_quantkit_file(micro, tmp_path):
    exe = need_llama("llama-perplexity")
    path = tmp_path / "q4.gguf"
    convert_to(micro, path, "Q4_K_M")
    from quantkit.toy import bundled_texts

    text = tmp_path / "text.txt"
    text.write_text("\n\n".join(bundled_texts())[:20000])
    out = subprocess.run([str(exe), "-m", str(path), "-f", str(text), "-c", "128", "--chunks", "4", "-t", "1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    match = re.search(r"Final estimate: PPL = ([0-9.]+)", out.stdout + out.stderr)
    assert match and float(match.group(1)) > 1.0


@pytest.mark.slow
def test_llama_tokenizer_agrees(micro, tmp_path):
    """llama.cpp tokenizes with our vocab ('gpt-2' pre-tokenizer) exactly like the HF tokenizer."""
    exe = need_llama("llama-tokenize")
    from transformers import AutoTokenizer

    path = tmp_path / "v.gguf"
    convert_to(micro, path, "Q8_0")
    out = subprocess.run([str(exe), "-m", str(path), "-p", SAMPLE, "--ids", "--no-bos", "--log-disable"],
                         capture_output=True, text=True, timeout=120)
    ids = json.loads(out.stdout.strip().splitlines()[-1])
    assert ids == AutoTokenizer.from_pretrained(micro)(SAMPLE, add_special_tokens=False)["input_ids"]
