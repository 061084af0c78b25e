"""llama.cpp tokenizes quantkit's GGUF as transformers tokenizes the checkpoint, id for id (slow;
skipped without scripts/build_llamacpp.sh's llama-tokenize).

For every tokenizer kind the tests build (tests/gguf/families.py): the toy byte-level BPE ("gpt-2"
split), a SentencePiece tokenizer.model, its tokenizer.json alone in Gemma's form (llama.cpp's
SentencePiece-style BPE), and the real Llama 3 and Qwen2 vocabularies rebuilt from llama.cpp's
vocab files. The text mixes accented Latin, CJK, Cyrillic, emoji (with joiners and skin tones),
digit runs, runs of spaces, tabs and newlines, and code; the comparison includes the BOS/EOS that
each side adds. llama.cpp's SentencePiece tokenizer puts "▁" before every text, also before one
that begins with a space, where transformers' LlamaTokenizer does not (the conversion says so in a
warning): for the tokenizer.model, llama.cpp's ids for " " + text are transformers' for "  " + text.
"""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

from tests.gguf.families import GGUF_VOCABS, build_family
from tests.gguf.helpers import convert_to, need_llama

LLAMACPP_VOCABS = Path(__file__).resolve().parents[2] / "third_party" / "llama.cpp" / "src" / "models"
TEXT = ("Café déjà vu — naïve façade, Ångström, Straße; ¿Qué tal? Ça va, Œuvre.\n"
        "日本語のテキストと中文字符，한국어도 있습니다。\n"
        "Привет, мир! Съешь же ещё этих мягких французских булок.\n"
        "Emoji: 🚀🦙 😶\u200d🌫️ ✅ 👍🏽 🇫🇷\n"
        "Digits: 3 33 333 3333 33333 1234567890 3.14159 1,000,000 ٣٤٥\n"
        "Spaces:  two  spaces,   three,\ttab,\t\ttwo tabs,\n\n\nthree newlines,    \n trailing   \n"
        "Code:\n    def f(x):\n        return x ** 2  # square\n"
        "    if (a != b && c <= d) { printf(\"%d\\n\", a); }\n")
CASES = [("llama31", "bpe"), ("llama31", "spm"), ("gemma3", "spm-json"), ("llama31", "spm-json"),
         ("llama31", "llama-bpe"), ("qwen25", "qwen2")]


def llama_tokenize(tool: Path, model: Path, text: str, scratch: Path) -> list[int]:
    """llama-tokenize's ids for `text` (read from a file byte for byte, BOS as the model asks)."""
    prompt = scratch / "prompt.txt"
    prompt.write_bytes(text.encode("utf-8"))
    run = subprocess.run([str(tool), "-m", str(model), "-f", str(prompt), "--ids", "--no-escape", "--log-disable"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return ast.literal_eval(run.stdout.strip().splitlines()[-1])


def assert_same_ids(ours: list[int], theirs: list[int], hf, label: str) -> None:
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), min(len(ours), len(theirs)))
    assert ours == theirs, (f"{label}: first difference at token {first}: llama.cpp "
                            f"{hf.convert_ids_to_tokens(ours[first:first + 5])} transformers "
                            f"{hf.convert_ids_to_tokens(theirs[first:first + 5])}")


@pytest.mark.slow
@pytest.mark.llamacpp
@pytest.mark.parametrize("family,tokenizer", CASES, ids=[f"{f}-{t}" for f, t in CASES])
def test_llamacpp_tokenizes_as_transformers(family, tokenizer, tmp_path):
    tool = need_llama("llama-tokenize")
    if tokenizer in GGUF_VOCABS and not LLAMACPP_VOCABS.is_dir():
        pytest.skip("needs llama.cpp's source tree (scripts/build_llamacpp.sh)")
    from transformers import AutoTokenizer

    model = build_family(family, tmp_path / "model", tokenizer, vocab_dir=LLAMACPP_VOCABS)
    gguf_file = tmp_path / "model.gguf"
    convert_to(model, gguf_file, "F16")
    hf = AutoTokenizer.from_pretrained(model)
    for text in [TEXT] + ([] if tokenizer == "spm" else [" " + TEXT]):
        ids = hf(text).input_ids
        assert_same_ids(llama_tokenize(tool, gguf_file, text, tmp_path), ids, hf, f"{tokenizer} {text[:12]!r}")
    if tokenizer == "spm":  # as the conversion warns: llama.cpp puts '▁' before a leading space too
        ids = hf("  " + TEXT).input_ids
        assert_same_ids(llama_tokenize(tool, gguf_file, " " + TEXT, tmp_path), ids, hf, "spm, leading space")
