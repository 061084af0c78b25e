"""Gemma 4 (Gemma4ForCausalLM) on a tiny random checkpoint: every method, each artifact proven in its consumer."""

from __future__ import annotations

from pathlib import Path

from tests.families import common
from tests.gguf.families import write_spm_json_tokenizer

FAMILY = "gemma4_text"


def build(out: Path, **config) -> Path:
    """Gemma 4 as its small checkpoints are: sliding and global layers (the global ones with their own head
    width and proportional RoPE), per-layer inputs, the last layers reading the KV of earlier ones; Gemma's
    SentencePiece vocabulary (tokenizer.json, as Gemma 4 ships it)."""
    settings = dict(num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2,
                    num_kv_shared_layers=2, head_dim=64, global_head_dim=128, hidden_size_per_layer_input=64,
                    sliding_window=32, final_logit_softcapping=30.0, **config)
    return common.build_with_tokenizer(out, "Gemma4TextConfig", "Gemma4ForCausalLM", spm_json_tokenizer,
                                       norm_center=1.0, **settings)


def spm_json_tokenizer(out: Path) -> tuple[int, dict]:
    """Gemma's SentencePiece vocabulary as a tokenizer.json (tests.gguf.families), its size also the per-layer
    embedding's rows."""
    vocab, ids = write_spm_json_tokenizer(out, "gemma")
    return vocab, {**ids, "vocab_size_per_layer_input": vocab}
