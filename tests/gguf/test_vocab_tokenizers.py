"""quantkit.gguf.vocab.BPETokenizer (tokenizers alone) against transformers' AutoTokenizer: the
same GGUF token list, token types, pre-tokenizer check hash and pipeline (what
quantkit.gguf.pretokenizer reads) for the test tokenizers, and AutoTokenizer wherever transformers
would change the tokenizer; a SentencePiece-style tokenizer.json written as gguf-py's LlamaHfVocab
reads it, and one llama.cpp cannot read exactly refused before work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quantkit.gguf import vocab as qv
from quantkit.gguf.pretokenizer import pipeline, reading

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
        ours, theirs = pipeline(direct.backend_tokenizer), pipeline(auto.backend_tokenizer)
        assert (ours.normalizer, ours.pre_tokenizer, ours.merges) == (theirs.normalizer, theirs.pre_tokenizer,
                                                                      theirs.merges), name
        assert reading(ours) == reading(theirs), name


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


def vocab_fields(model_dir: Path, kind: str, vocab_size: int, out: Path) -> tuple[object, dict]:
    """quantkit's tokenizer.* keys for `kind`, written alone to a GGUF file and read back."""
    import gguf

    from tests.gguf.helpers import fields

    writer = gguf.GGUFWriter(str(out), "llama")
    info = qv.add_vocab(writer, model_dir, {"vocab_size": vocab_size}, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    return info, fields(out)


@pytest.mark.parametrize("kind", ["llama", "gemma", "gemma3"])
def test_spm_style_tokenizer_json_as_llama_hf_vocab(kind, tmp_path):
    """A SentencePiece-style tokenizer.json alone (a Gemma fine-tune's): gguf-py's LlamaHfVocab tokens,
    scores and types (as llama.cpp's Gemma 4 converter writes them), padded to vocab_size, the
    tokenizer.json merges, BPE with llama.cpp's SentencePiece-style pre-tokenizer, BOS as
    transformers adds it; add_space_prefix only where the converter class writes it (GemmaModel)."""
    pytest.importorskip("transformers")
    import gguf
    from transformers import AutoTokenizer

    from tests.gguf.families import write_spm_json_tokenizer

    tok = tmp_path / "tok"
    tok.mkdir()
    write_spm_json_tokenizer(tok, "gemma")
    info, meta = vocab_fields(tok, kind, 520, tmp_path / "vocab.gguf")
    tokens, scores, types = zip(*gguf.LlamaHfVocab(tok).all_tokens())
    pad = range(len(tokens), 520)
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "sarvam-moe"
    assert info.pre_source == "spm-style" and info.size == 520
    assert meta["tokenizer.ggml.tokens"] == [t.decode() for t in tokens] + [f"[PAD{i}]" for i in pad]
    assert meta["tokenizer.ggml.scores"] == pytest.approx(list(scores) + [-1000.0] * len(pad))
    assert meta["tokenizer.ggml.token_type"] == list(types) + [gguf.TokenType.UNUSED] * len(pad)
    merges = json.loads((tok / "tokenizer.json").read_text())["model"]["merges"]
    assert meta["tokenizer.ggml.merges"] == [" ".join(m) for m in merges]
    hf = AutoTokenizer.from_pretrained(tok)
    assert meta["tokenizer.ggml.add_bos_token"] == (hf("a").input_ids[:1] == [meta["tokenizer.ggml.bos_token_id"]])
    assert meta.get("tokenizer.ggml.add_space_prefix") == (False if kind == "gemma" else None)
    byte_ids = [hf.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)]
    assert {meta["tokenizer.ggml.token_type"][i] for i in byte_ids} == {gguf.TokenType.BYTE}


def test_spm_style_tokenizer_json_without_sequence_decoder_refused(tmp_path):
    """gguf-py's LlamaHfVocab (the token list, as the converter reads it) needs a Sequence decoder."""
    pytest.importorskip("transformers")
    from quantkit.errors import UnsupportedError
    from tests.gguf.families import write_spm_json_tokenizer

    write_spm_json_tokenizer(tmp_path, "gemma")
    data = json.loads((tmp_path / "tokenizer.json").read_text())
    (tmp_path / "tokenizer.json").write_text(json.dumps({**data, "decoder": {"type": "ByteFallback"}}))
    with pytest.raises(UnsupportedError, match="decoder is ByteFallback"):
        qv.check_vocab(tmp_path, "gemma3")


def test_prepending_tokenizer_json_refused_before_work(cli, model_copy, tmp_path):
    """A tokenizer.json alone whose tokenizer prepends '▁' (transformers' LlamaTokenizer): no llama.cpp
    tokenizer reads it exactly, so `quantize --method gguf` stops with exit 2 before any work; with
    the model's tokenizer.model beside it the SentencePiece vocabulary is written instead."""
    pytest.importorskip("transformers")
    from tests.gguf.families import write_spm_json_tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_copy / name).unlink()
    write_spm_json_tokenizer(model_copy, "llama")
    out = tmp_path / "out"
    result = cli("quantize", model_copy, "--method", "gguf", "--gguf-type", "Q8_0", "-o", out)
    assert result.exit_code == 2 and "prepends" in result.stderr and "tokenizer.model" in result.stderr, result.output
    assert not out.exists()
    from tests.gguf.families import write_spm_tokenizer

    write_spm_tokenizer(tmp_path)
    (model_copy / "tokenizer.model").write_bytes((tmp_path / "tokenizer.model").read_bytes())
    assert not qv.uses_bpe(model_copy, "llama")
    qv.check_vocab(model_copy, "llama")


def test_conversion_warning_printed(cli, model_copy, tmp_path):
    """A tokenizer.model that transformers reads with Metaspace 'first': the conversion's warning (text
    that begins with a space or follows a special token tokenizes differently in llama.cpp) is printed
    on stderr, once, and recorded in quantkit.json."""
    pytest.importorskip("transformers")
    from tests.gguf.families import write_spm_tokenizer

    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model_copy / name).unlink()
    write_spm_tokenizer(model_copy)
    out = tmp_path / "out"
    result = cli("quantize", model_copy, "--method", "gguf", "--gguf-type", "Q8_0", "--imatrix", "none",
                 "--eval-windows", "0", "-o", out)
    assert result.exit_code == 0, result.output
    printed = [line.split("warning: ", 1)[1] for line in result.stderr.splitlines() if "warning: tokenizer" in line]
    recorded = json.loads((out / "quantkit.json").read_text())["targets"][0]["details"]["gguf"]["vocab"]["warnings"]
    assert len(printed) == 1 and "begins with a space, or follows a special token" in printed[0], result.stderr
    assert printed == recorded
