"""quantkit.gguf.pretokenizer: the llama.cpp pre-tokenizer that reads a BPE tokenizer exactly, or a
refusal naming the difference. Pipelines are written out as transformers' backend JSON has them."""

from __future__ import annotations

import pytest

from quantkit.errors import UnsupportedError
from quantkit.gguf import pretokenizer as pt

BYTES = {f"<0x{b:02X}>": b for b in range(256)}
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
REPLACE = {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}
GEMMA_SPLIT = {"type": "Split", "pattern": {"String": " "}, "behavior": "MergedWithPrevious", "invert": False}


def bpe(byte_fallback: bool = False, ignore_merges: bool = False, vocab=None, **extra) -> dict:
    return {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": byte_fallback, "byte_fallback": byte_fallback,
            "ignore_merges": ignore_merges, "vocab": vocab or {}, "merges": [], **extra}


def split(regex: str) -> dict:
    return {"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}


def spm_style(normalizer=REPLACE, pre=None, merges=(), vocab=None, **model) -> pt.Pipeline:
    return pt.Pipeline(normalizer, pre, bpe(byte_fallback=True, vocab=BYTES if vocab is None else vocab, **model),
                       list(merges))


@pytest.mark.parametrize("pipeline,name", [
    (pt.Pipeline(None, BYTE_LEVEL, bpe(), []), "gpt-2"),
    (pt.Pipeline(None, {"type": "Sequence", "pretokenizers": [BYTE_LEVEL]}, bpe(), []), "gpt-2"),
    (pt.Pipeline(None, split(pt.LLAMA3_REGEX), bpe(ignore_merges=True), []), "llama-bpe"),
    (pt.Pipeline(None, split(pt.QWEN2_REGEX), bpe(), []), "qwen2"),
    (spm_style(), pt.SPM_STYLE_PRE),
    (spm_style(pre=GEMMA_SPLIT), pt.SPM_STYLE_PRE),
    (spm_style(normalizer={"type": "Sequence", "normalizers": [REPLACE]}), pt.SPM_STYLE_PRE),
    (spm_style(normalizer=None, pre={"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "never",
                                     "split": False}), pt.SPM_STYLE_PRE),
    (spm_style(merges=[("\u2581", "t"), ("\n", "\n")]), pt.SPM_STYLE_PRE),
], ids=["gpt-2", "gpt-2 in a sequence", "llama-bpe", "qwen2", "spm-style", "gemma", "replace in a sequence",
        "metaspace never", "newline runs"])
def test_exact_readings(pipeline, name):
    assert pt.reading(pipeline) == name


@pytest.mark.parametrize("pipeline,words,hint", [
    (pt.Pipeline(None, {**BYTE_LEVEL, "add_prefix_space": True}, bpe(), []), "pre-tokenizer", "converter"),
    (pt.Pipeline({"type": "NFC"}, BYTE_LEVEL, bpe(), []), "normalizer NFC", "converter"),
    (pt.Pipeline(None, {"type": "Whitespace"}, bpe(), []), "none of llama.cpp's", "converter"),
    (pt.Pipeline(None, split(pt.LLAMA3_REGEX), bpe(), []), "ignore_merges is False", "converter"),
    (pt.Pipeline(None, split(pt.QWEN2_REGEX), bpe(ignore_merges=True), []), "ignore_merges is True", "converter"),
    (pt.Pipeline(None, BYTE_LEVEL, bpe(dropout=0.1), []), "dropout", "converter"),
    (pt.Pipeline(None, None, {"type": "Unigram", "vocab": []}, []), "Unigram", "tokenizer.model"),
    (spm_style(normalizer={"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"}, REPLACE]}),
     "prepends", "tokenizer.model"),
    (spm_style(normalizer=None, pre={"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "first",
                                     "split": False}), "prepends", "tokenizer.model"),
    (spm_style(normalizer=None, pre={"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "never",
                                     "split": True}), "splits the text at every", "converter"),
    (spm_style(normalizer=None), "spaces stay spaces", "converter"),
    (spm_style(normalizer={"type": "Sequence", "normalizers": [{"type": "NFKC"}, REPLACE]}), "normalizer",
     "converter"),
    (spm_style(pre={"type": "Digits", "individual_digits": True}), "only at newlines", "converter"),
    (spm_style(merges=[("a", "\n")]), "joins a newline", "converter"),
    (spm_style(merges=[("a b", "c")]), "holds a space", "converter"),
    (spm_style(vocab={}), "byte tokens are missing", "converter"),
    (spm_style(ignore_merges=True), "ignores merges", "converter"),
], ids=["prefix space", "normalizer", "whitespace split", "llama3 without ignore_merges", "qwen2 ignoring merges",
        "dropout", "unigram", "prepend normalizer", "metaspace first", "metaspace split", "no space convention",
        "nfkc", "digits", "newline merge", "space in a merge", "no byte tokens", "spm ignoring merges"])
def test_refusals_name_the_difference(pipeline, words, hint):
    with pytest.raises(UnsupportedError) as info:
        pt.reading(pipeline)
    assert info.value.exit_code == 2 and words in str(info.value) and hint in info.value.hint


METASPACE = {"type": "Metaspace", "replacement": "\u2581", "split": False}
PREPEND = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"}, REPLACE]}


@pytest.mark.parametrize("normalizer,pre,prefix,words", [
    (PREPEND, None, True, None),
    (REPLACE, GEMMA_SPLIT, False, None),
    (None, {**METASPACE, "prepend_scheme": "never"}, False, None),
    (None, {**METASPACE, "prepend_scheme": "first"}, True, "begins with a space, or follows a special token"),
    (None, {**METASPACE, "prepend_scheme": "always"}, True, "begins with a space tokenizes differently"),
    (None, {**METASPACE, "prepend_scheme": "first"}, False, "transformers puts '▁' before the text"),
    (REPLACE, None, True, "llama.cpp puts '▁' before the text"),
    ({"type": "Sequence", "normalizers": [{"type": "Precompiled", "precompiled_charsmap": "x"}, REPLACE]}, None, False,
     "normalizes the text (Precompiled)"),
    (None, None, True, "keeps spaces"),
], ids=["prepend", "gemma", "never", "first", "always", "first without prefix", "prefix without", "precompiled",
        "no spaces"])
def test_sentencepiece_differences(normalizer, pre, prefix, words):
    """llama.cpp's SentencePiece tokenizer (a '▁' before every text when add_space_prefix, nothing
    normalized) against transformers' reading of the same tokenizer.model."""
    difference = pt.spm_difference(pt.Pipeline(normalizer, pre, bpe(byte_fallback=True), []), prefix)
    assert difference is None if words is None else words in difference
