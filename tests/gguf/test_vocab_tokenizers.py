"""quantkit.gguf.vocab.BPETokenizer (tokenizers alone) against transformers' AutoTokenizer: the
same GGUF token list, token types and pre-tokenizer check hash for the test tokenizers, and
AutoTokenizer wherever transformers would change the tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantkit.gguf import vocab as qv

LLAMACPP_VOCABS = Path(__file__).resolve().parents[2] / "third_party" / "llama.cpp" / "src" / "models"


def tokenizer_dirs(tmp: Path, llamacpp: bool) -> dict[str, Path]:
    """The toy byte-level BPE tokenizer, the same under GPT2Tokenizer (as Phi-4 names it), and with
    `llamacpp` the Llama 3 and Qwen2 vocabularies rebuilt from llama.cpp's vocab files."""
    from tests.gguf.families import GGUF_VOCABS, write_bpe_tokenizer, write_gguf_vocab_tokenizer

    dirs = {"toy": tmp / "toy"}
    dirs["toy"].mkdir()
    write_bpe_tokenizer(dirs["toy"])
    dirs["gpt2 class"] = tmp / "gpt2"
    dirs["gpt2 class"].mkdir()
    write_bpe_tokenizer(dirs["gpt2 class"])
    config_file = dirs["gpt2 class"] / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "tokenizer_class": "GPT2Tokenizer"}))
    if llamacpp:
        for kind in GGUF_VOCABS:
            dirs[kind] = tmp / kind
            dirs[kind].mkdir()
            write_gguf_vocab_tokenizer(dirs[kind], LLAMACPP_VOCABS, kind)
    return dirs


def check_equal(dirs: dict[str, Path]) -> None:
    from transformers import AutoTokenizer

    for name, path in dirs.items():
        assert qv.BPETokenizer.applies(path), name
        direct, auto = qv.BPETokenizer(path), AutoTokenizer.from_pretrained(path, local_files_only=True)
        assert qv.bpe_tokens(direct, None) == qv.bpe_tokens(auto, None), name
        assert qv.check_hash(direct) == qv.check_hash(auto), name
        assert direct.get_added_vocab() == auto.get_added_vocab(), name


def test_bpe_tokenizer_equals_autotokenizer(tmp_path):
    pytest.importorskip("transformers")
    check_equal(tokenizer_dirs(tmp_path, llamacpp=False))


@pytest.mark.slow
@pytest.mark.skipif(not LLAMACPP_VOCABS.is_dir(), reason="needs llama.cpp's source tree (scripts/build_llamacpp.sh)")
def test_bpe_tokenizer_equals_autotokenizer_on_large_vocabularies(tmp_path):
    pytest.importorskip("transformers")
    check_equal({k: v for k, v in tokenizer_dirs(tmp_path, llamacpp=True).items() if k not in ("toy", "gpt2 class")})


def test_autotokenizer_where_transformers_adds_a_token(tmp_path):
    """A special token named in tokenizer_config.json but missing from tokenizer.json: transformers
    adds it, so the vocabulary is read through transformers."""
    from tests.gguf.families import write_bpe_tokenizer

    write_bpe_tokenizer(tmp_path)
    config_file = tmp_path / "tokenizer_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "mask_token": "<new-mask>"}))
    assert not qv.BPETokenizer.applies(tmp_path)
    pytest.importorskip("transformers")
    assert not isinstance(qv.load_bpe_tokenizer(tmp_path), qv.BPETokenizer)
