"""Tiny random checkpoints of every architecture family the GGUF converter supports.

Each is built locally (no hub): a transformers config with hidden 256 (rows stay multiples of
256, so the k-quants apply), 2 layers, 4 heads of 64 (GQA 2), random weights (norm weights
randomised too), stored in bf16, with either the toy byte-level BPE tokenizer or a small
SentencePiece tokenizer.model trained on the bundled text, or (when the llama.cpp source tree is
present) the real Llama 3 / Qwen2 byte-level BPE vocabulary rebuilt from llama.cpp's test vocab
files (models/ggml-vocab-llama-bpe.gguf, ggml-vocab-qwen2.gguf): their pre-tokenizer check hashes
equal the converter's known "llama-bpe" / "qwen2" entries. Those large-vocabulary checkpoints use
hidden 64 to stay small.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
COMMON = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256, "rope_theta": 500000.0}


def family_config(family: str, vocab: int, ids: dict):
    """The transformers config of a family (ids: bos/eos/pad token ids)."""
    import transformers as tf

    c = {**COMMON, "vocab_size": vocab, **ids}
    builders = {
        "llama31": lambda: tf.LlamaConfig(**c, rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=False),
        "llama32": lambda: tf.LlamaConfig(**c, rope_parameters={**LLAMA3_ROPE, "factor": 32.0},
                                          tie_word_embeddings=True),
        "mistral": lambda: tf.MistralConfig(**c, sliding_window=None, head_dim=64),
        "mixtral": lambda: tf.MixtralConfig(**c, num_local_experts=4, num_experts_per_tok=2, head_dim=64),
        "mixtral8": lambda: tf.MixtralConfig(**c, num_local_experts=8, num_experts_per_tok=2, head_dim=64),
        "qwen25": lambda: tf.Qwen2Config(**c, tie_word_embeddings=False),
        "qwen3moe": lambda: tf.Qwen3MoeConfig(**c, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
                                              head_dim=64, norm_topk_prob=True),
        "gemma3": lambda: tf.Gemma3TextConfig(**c, head_dim=64, query_pre_attn_scalar=64, sliding_window=32),
        "phi3": lambda: tf.Phi3Config(**{**c, "max_position_embeddings": 8192}, original_max_position_embeddings=4096,
                                      rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                       "long_factor": [1.0 + i / 8 for i in range(32)],
                                                       "short_factor": [1.0 + i / 64 for i in range(32)]},
                                      sliding_window=None),
        "phi4": lambda: tf.Phi3Config(**c, original_max_position_embeddings=4096, sliding_window=None),
    }
    if family == "gemma3vlm":
        return tf.Gemma3Config(text_config={**c, "head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 32},
                               vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                                  num_attention_heads=2, image_size=32, patch_size=8),
                               mm_tokens_per_image=4, image_token_index=5, boi_token_index=6, eoi_token_index=7)
    return builders[family]()


MODEL_CLASSES = {"llama31": "LlamaForCausalLM", "llama32": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "mixtral": "MixtralForCausalLM", "mixtral8": "MixtralForCausalLM", "qwen25": "Qwen2ForCausalLM",
                 "qwen3moe": "Qwen3MoeForCausalLM", "gemma3": "Gemma3ForCausalLM",
                 "gemma3vlm": "Gemma3ForConditionalGeneration", "phi3": "Phi3ForCausalLM",
                 "phi4": "Phi3ForCausalLM"}
FAMILIES = list(MODEL_CLASSES)


def randomize(model, seed: int) -> None:
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3 + (0.0 if "gemma" in type(model).__name__.lower()
                                                                       else 1.0))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


SMALL = dict(hidden_size=64, intermediate_size=128, head_dim=16)
GGUF_VOCABS = {"llama-bpe": ("ggml-vocab-llama-bpe.gguf", "LLAMA3_REGEX", "<|begin_of_text|>", "<|end_of_text|>"),
               "qwen2": ("ggml-vocab-qwen2.gguf", "QWEN2_REGEX", None, "<|endoftext|>")}


def build_family(family: str, out: Path, tokenizer: str = "bpe", seed: int = 0, vocab_dir: Path | None = None,
                 padded_rows: int = 0) -> Path:
    """Save a tiny `family` checkpoint with a "bpe" (toy), "spm" (tokenizer.model), "spm-json" /
    "spm-json-llama" (its tokenizer.json alone, see write_spm_json_tokenizer), "llama-bpe" or "qwen2"
    (rebuilt from the vocab files in vocab_dir) tokenizer; `padded_rows` embedding rows past the tokenizer's."""
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    if tokenizer in GGUF_VOCABS:
        vocab, ids = write_gguf_vocab_tokenizer(out, vocab_dir, tokenizer)
    elif tokenizer in ("spm-json", "spm-json-llama"):
        vocab, ids = write_spm_json_tokenizer(out, "gemma" if tokenizer == "spm-json" else "llama")
    else:
        vocab, ids = write_bpe_tokenizer(out) if tokenizer == "bpe" else write_spm_tokenizer(out)
    config = family_config(family, vocab + padded_rows, ids)
    if tokenizer in GGUF_VOCABS:
        for key, value in SMALL.items():
            setattr(config, key, value)
    torch.manual_seed(seed)
    model = getattr(transformers, MODEL_CLASSES[family])(config)
    randomize(model, seed)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    if family == "phi4":  # Phi-4 ships a GPT2Tokenizer (byte-level BPE), no tokenizer.model
        config_file = out / "tokenizer_config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "tokenizer_class": "GPT2Tokenizer"}))
    return out


def write_bpe_tokenizer(out: Path) -> tuple[int, dict]:
    from quantkit.toy import build_tokenizer, bundled_texts

    tok = build_tokenizer(bundled_texts(), 512)
    tok.save_pretrained(out)
    return len(tok), dict(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


# GLM-4.5's added special tokens (its tokenizer_config.json's), the four llama.cpp's _set_vocab_glm reads among them
GLM_SPECIAL_TOKENS = ["<|endoftext|>", "[MASK]", "[gMASK]", "[sMASK]", "<sop>", "<eop>", "<|system|>", "<|user|>",
                      "<|assistant|>", "<|observation|>"]


def write_glm_tokenizer(out: Path) -> tuple[int, dict]:
    """The toy byte-level BPE with GLM-4.5's added special tokens and its special-token settings: no bos_token (the
    converter's _set_vocab_glm makes [gMASK] the BOS), eos and pad <|endoftext|>, a ByteLevel post-processor (no
    BOS added)."""
    from tokenizers import processors

    from quantkit.toy import build_tokenizer, bundled_texts

    tok = build_tokenizer(bundled_texts(), 512)
    tok.add_special_tokens({"additional_special_tokens": GLM_SPECIAL_TOKENS})
    tok.backend_tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.bos_token, tok.eos_token, tok.pad_token = None, "<|endoftext|>", "<|endoftext|>"
    tok.save_pretrained(out)
    return len(tok), dict(bos_token_id=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)


def write_spm_tokenizer(out: Path, vocab: int = 512) -> tuple[int, dict]:
    """A byte-fallback SentencePiece BPE model (Llama-2 style ids: <unk> 0, <s> 1, </s> 2) plus a
    tokenizer_config.json listing them as special added tokens, as Llama-2 / Mistral ship it."""
    import io

    import pytest

    spm = pytest.importorskip("sentencepiece", reason="SentencePiece vocabularies need the sentencepiece package")

    from quantkit.toy import bundled_texts

    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(bundled_texts()), model_writer=buf, vocab_size=vocab,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   unk_id=0, bos_id=1, eos_id=2, pad_id=-1, minloglevel=2)
    (out / "tokenizer.model").write_bytes(buf.getvalue())
    decoder = {str(i): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                        "single_word": False, "special": True} for i, t in enumerate(["<unk>", "<s>", "</s>"])}
    config = {"add_bos_token": True, "add_eos_token": False, "added_tokens_decoder": decoder,
              "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "pad_token": None,
              "chat_template": CHAT_TEMPLATE, "legacy": False, "model_max_length": 4096,
              "tokenizer_class": "LlamaTokenizer"}
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return vocab, dict(bos_token_id=1, eos_token_id=2, pad_token_id=0)


def write_spm_json_tokenizer(out: Path, style: str = "gemma") -> tuple[int, dict]:
    """tokenizer.json alone, as a fine-tune's save_pretrained leaves it: write_spm_tokenizer's
    SentencePiece model converted by transformers' GemmaTokenizer ("gemma": spaces to '▁' by a
    Replace normalizer, nothing prepended) or LlamaTokenizer ("llama": a Metaspace pre-tokenizer
    that prepends '▁'); no tokenizer.model."""
    import tempfile

    from transformers import AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        vocab, ids = write_spm_tokenizer(Path(tmp))
        AutoTokenizer.from_pretrained(tmp).save_pretrained(out)
    if style == "gemma":
        config_file = out / "tokenizer_config.json"
        config = {**json.loads(config_file.read_text()), "tokenizer_class": "GemmaTokenizer", "mask_token": None}
        config_file.write_text(json.dumps(config))
        AutoTokenizer.from_pretrained(out).save_pretrained(out)
    assert not (out / "tokenizer.model").exists()
    return vocab, ids


def write_gguf_vocab_tokenizer(out: Path, vocab_dir: Path, kind: str) -> tuple[int, dict]:
    """A tokenizer.json rebuilt from one of llama.cpp's ggml-vocab-*.gguf files: byte-level BPE
    (merges ignored for whole-word hits in Llama 3's, as its tokenizer.json says, applied in
    Qwen2's), the model's split regex, control tokens as special added tokens, BOS template for
    Llama 3."""
    import gguf
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    from quantkit.gguf import pretokenizer

    file, regex, bos, eos = GGUF_VOCABS[kind]
    fields = {k: f.contents() for k, f in gguf.GGUFReader(str(vocab_dir / file)).fields.items()}
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens) if types[i] == 1},
                               merges=[tuple(m.split(" ")) for m in fields["tokenizer.ggml.merges"]],
                               ignore_merges=kind == "llama-bpe", byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(getattr(pretokenizer, regex)), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for i, t in enumerate(tokens) if types[i] == 3])
    if bos:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos, chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(out)
    return len(tokens), dict(bos_token_id=tok.token_to_id(bos) if bos else None, eos_token_id=tok.token_to_id(eos))
