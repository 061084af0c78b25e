"""Which llama.cpp BPE pre-tokenizer reads a tokenizer.json exactly as transformers runs it.

A GGUF's BPE vocabulary names a pre-tokenizer (tokenizer.ggml.pre); llama.cpp splits the text with
that name's fixed rules, then applies the merges. quantkit writes a name only where llama.cpp's
rules and the Hugging Face tokenizer split every text the same way, and refuses (exit 2) otherwise;
it never falls back to llama.cpp's "default" split, which no Hugging Face tokenizer uses.

`Pipeline` is what transformers runs (its backend tokenizer's JSON: transformers 5 rebuilds the
normalizer and pre-tokenizer of some classes, e.g. LlamaTokenizer, whatever tokenizer.json says).

Byte-level BPE (GPT-2 style), read by its structure when its check hash is not llama.cpp's:
  * ByteLevel with its built-in regex, no prefix space -> "gpt-2";
  * Split(Llama 3 regex) + ByteLevel without regex -> "llama-bpe" (llama.cpp then ignores merges
    for whole-word hits and adds BOS, so the tokenizer must do both);
  * Split(Qwen2 regex) + ByteLevel without regex -> "qwen2".
  All with no normalizer (llama.cpp's BPE tokenizer normalizes nothing), no byte fallback, no dropout
  and no subword prefix/suffix.

SentencePiece-style BPE (byte fallback, spaces written as U+2581 "▁"; tokenizer.json of Gemma,
or of any model whose tokenizer adds no leading "▁") -> SPM_STYLE_PRE, llama.cpp's pre-tokenizer
for that shape: spaces to "▁", the text split only between newlines and other characters, merges on
raw UTF-8, unknown characters as <0xXX> byte tokens. That is transformers' reading when
  * spaces become "▁" (normalizer Replace(" ", "▁"), a no-op Split on " " after it, or
    Metaspace with prepend_scheme "never" and no split), and nothing else is normalized;
  * nothing is prepended: llama.cpp's BPE tokenizer never adds a leading "▁". (Its SentencePiece
    tokenizer always does, also before text that begins with a space, where Metaspace's "first" and
    "always" do not; and it orders merges by per-token scores, which a tokenizer.json does not
    have. A tokenizer that prepends "▁" is therefore refused: with the model's tokenizer.model
    beside it, quantkit writes llama.cpp's SentencePiece vocabulary, as llama.cpp's converter does);
  * no merge joins a newline to another character (llama.cpp splits there), no merged piece holds
    a space (GGUF merges are "left right" strings), all 256 byte tokens exist, and merges are not
    ignored.

A tokenizer.model is written as llama.cpp's SentencePiece vocabulary, as llama.cpp's converter
writes it; spm_difference says in words where llama.cpp's SentencePiece tokenizer (a "▁" before
every text, also one that begins with a space and one after a special token, when
add_space_prefix; no normalization) reads text otherwise than transformers does, for the
conversion's warnings.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from quantkit.errors import UnsupportedError

LLAMA3_REGEX = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
QWEN2_REGEX = (
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
QWEN2_REGEX_I = (
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"
)
# Split regex of a Sequence[Split, ByteLevel(use_regex=False)] pre-tokenizer -> llama.cpp name.
KNOWN_SPLIT_REGEXES = {LLAMA3_REGEX: "llama-bpe", QWEN2_REGEX: "qwen2", QWEN2_REGEX_I: "qwen2"}
SPM_STYLE_PRE = "sarvam-moe"  # llama.cpp: escape spaces, split "[^\n]+|[\n]+", raw UTF-8 merges
SPACE = "\u2581"
REPLACE_SPACE = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}
PREPEND_SPACE = {"type": "Prepend", "prepend": SPACE}
SPM_HINT = ("put the base model's tokenizer.model beside tokenizer.json (quantkit then writes llama.cpp's "
            "SentencePiece vocabulary, as llama.cpp's converter does)")
PREPENDS = ("llama.cpp's BPE tokenizer never prepends one, and its SentencePiece tokenizer needs the scores of a "
            "tokenizer.model")
BPE_HINT = ("llama.cpp cannot split text as this tokenizer does; its own converter refuses it too "
            "(docs/gguf.md lists the tokenizers quantkit writes)")


@dataclass
class Pipeline:
    """The tokenizer transformers runs, as JSON parts: normalizer, pre-tokenizer and BPE model
    (options, vocab and merges as (left, right) pairs)."""

    normalizer: dict | None
    pre_tokenizer: dict | None
    model: dict
    merges: list[tuple[str, str]]


def pipeline(backend) -> Pipeline:
    """From a tokenizers.Tokenizer (transformers' backend_tokenizer)."""
    data = json.loads(backend.to_str())
    model = data.get("model") or {}
    merges = [tuple(m.split(" ", 1)) if isinstance(m, str) else tuple(m) for m in model.get("merges") or []]
    return Pipeline(data.get("normalizer"), data.get("pre_tokenizer"), model, merges)


def is_spm_style(p: Pipeline) -> bool:
    """BPE with byte fallback: SentencePiece's shape (its spaces are checked by spm_style_problem)."""
    return p.model.get("type") == "BPE" and bool(p.model.get("byte_fallback"))


def reading(p: Pipeline) -> str:
    """The llama.cpp pre-tokenizer name that reads `p` exactly; UnsupportedError where none does."""
    if p.model.get("type") != "BPE":
        raise UnsupportedError(f"tokenizer.json: a {p.model.get('type')} model without tokenizer.model: quantkit "
                               "writes BPE and SentencePiece vocabularies only", hint=SPM_HINT)
    if is_spm_style(p):
        problem = spm_style_problem(p)
        if problem:
            raise UnsupportedError(f"tokenizer.json (SentencePiece-style BPE): {problem}",
                                   hint=SPM_HINT if "prepends" in problem else BPE_HINT)
        return SPM_STYLE_PRE
    name, problem = byte_level_reading(p)
    if problem:
        raise UnsupportedError(f"tokenizer.json (BPE): {problem}", hint=BPE_HINT)
    return name


# ------------------------------------------------------------------ byte-level BPE


def byte_level_reading(p: Pipeline) -> tuple[str, str | None]:
    """(name, None) or ("", the first difference from every llama.cpp pre-tokenizer)."""
    problem = model_problem(p.model)
    if problem:
        return "", problem
    if p.normalizer:
        return "", f"normalizer {p.normalizer.get('type')}: llama.cpp's BPE tokenizer does not normalize text"
    name = structure_name(p.pre_tokenizer)
    if name is None:
        return "", f"pre-tokenizer {describe(p.pre_tokenizer)} is none of llama.cpp's"
    if bool(p.model.get("ignore_merges")) != (name == "llama-bpe"):
        return "", (f"ignore_merges is {bool(p.model.get('ignore_merges'))}, and llama.cpp's '{name}' pre-tokenizer "
                    f"{'ignores' if name == 'llama-bpe' else 'applies'} merges for words in the vocabulary")
    return name, None


def structure_name(pre: dict | None) -> str | None:
    if not pre:
        return None
    if pre.get("type") == "ByteLevel":
        return "gpt-2" if pre.get("use_regex", True) and not pre.get("add_prefix_space") else None
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else []
    if len(steps) == 1:
        return structure_name(steps[0])
    if len(steps) != 2 or [s.get("type") for s in steps] != ["Split", "ByteLevel"]:
        return None
    split, bytelevel = steps
    if bytelevel.get("use_regex", True) or bytelevel.get("add_prefix_space"):
        return None
    if split.get("behavior") != "Isolated" or split.get("invert"):
        return None
    return KNOWN_SPLIT_REGEXES.get((split.get("pattern") or {}).get("Regex"))


def model_problem(model: dict) -> str | None:
    for key in ("dropout", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            return f"the BPE model's {key} is {model[key]!r}, which llama.cpp does not have"
    return None


def describe(part: dict | None) -> str:
    return json.dumps(part, ensure_ascii=False)[:160] if part else "none"


# ------------------------------------------------------------------ SentencePiece-style BPE


def spm_style_problem(p: Pipeline) -> str | None:
    """The first reason SPM_STYLE_PRE would split some text differently, or None."""
    return (model_problem(p.model)
            or ("it ignores merges for words in the vocabulary, which llama.cpp's SentencePiece-style reading "
                "does not" if p.model.get("ignore_merges") else None)
            or space_problem(p.normalizer, p.pre_tokenizer)
            or vocab_problem(p.model.get("vocab") or {})
            or merges_problem(p.merges))


def space_problem(normalizer: dict | None, pre: dict | None) -> str | None:
    """None where spaces become "▁" and nothing else changes or splits the text."""
    steps = normalizer.get("normalizers", []) if normalizer and normalizer.get("type") == "Sequence" else \
        [normalizer] if normalizer else []
    if any(s.get("type") == "Prepend" for s in steps):
        return f"its normalizer prepends '▁' to the text: {PREPENDS}"
    if pre and pre.get("type") == "Metaspace":
        if steps:
            return f"normalizer {describe(normalizer)} before a Metaspace pre-tokenizer"
        if pre.get("replacement") != SPACE:
            return f"Metaspace replaces spaces with {pre.get('replacement')!r}, not '▁'"
        scheme = pre.get("prepend_scheme", "always")
        if scheme != "never":
            return f"its Metaspace pre-tokenizer prepends '▁' (prepend_scheme '{scheme}'): {PREPENDS}"
        if pre.get("split"):
            return ("its Metaspace pre-tokenizer splits the text at every '▁', llama.cpp's SentencePiece-style "
                    "reading only at newlines")
        return None
    if not steps:
        return "spaces stay spaces (no Replace normalizer, no Metaspace), where llama.cpp writes them as '▁'"
    if steps != [REPLACE_SPACE]:
        return f"normalizer {describe(normalizer)}: llama.cpp only replaces spaces with '▁'"
    if pre and not space_split(pre):
        return f"pre-tokenizer {describe(pre)}: llama.cpp splits the text only at newlines"
    return None


def space_split(pre: dict) -> bool:
    """A Split on the string " " after spaces became "▁": it never matches (GemmaTokenizer's)."""
    return pre.get("type") == "Split" and pre.get("pattern") == {"String": " "} and not pre.get("invert")


def vocab_problem(vocab: dict[str, int]) -> str | None:
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in vocab]
    if missing:
        return (f"{len(missing)} of the 256 byte tokens are missing (first {missing[0]}): transformers then gives "
                "the unknown token where llama.cpp drops the byte")
    return None


def merges_problem(merges: list[tuple[str, str]]) -> str | None:
    for left, right in merges:
        if " " in left or " " in right:
            return f"the merge {left!r} + {right!r} holds a space, which a GGUF merge cannot"
        joined = left + right
        if "\n" in joined and joined.strip("\n"):
            return (f"the merge {left!r} + {right!r} joins a newline and other characters, which llama.cpp "
                    "splits apart")
    return None


# ------------------------------------------------------------------ SentencePiece (tokenizer.model)


def spm_difference(p: Pipeline, add_space_prefix: bool) -> str | None:
    """Where llama.cpp's SentencePiece tokenizer (no normalization, spaces as '▁', a '▁' before every
    text when add_space_prefix) splits text otherwise than transformers' reading `p` of the same
    tokenizer.model, in words; None where their rules agree."""
    normalizer = p.normalizer
    steps = normalizer.get("normalizers", []) if normalizer and normalizer.get("type") == "Sequence" else \
        [normalizer] if normalizer else []
    other = [s.get("type") for s in steps if s not in (REPLACE_SPACE, PREPEND_SPACE)]
    if other:
        return (f"transformers normalizes the text ({', '.join(other)}) and llama.cpp does not: text that "
                "normalization changes tokenizes differently")
    pre = p.pre_tokenizer if p.pre_tokenizer and p.pre_tokenizer.get("type") == "Metaspace" else None
    if REPLACE_SPACE not in steps and pre is None:
        return "transformers keeps spaces and llama.cpp writes them as '▁': text with spaces tokenizes differently"
    scheme = pre.get("prepend_scheme", "always") if pre else "never"
    prefix = PREPEND_SPACE in steps or scheme != "never"
    if prefix != add_space_prefix:
        who, other_one = ("transformers", "llama.cpp") if prefix else ("llama.cpp", "transformers")
        return f"{who} puts '▁' before the text and {other_one} does not: the first token of every text differs"
    if prefix and PREPEND_SPACE not in steps:
        after = ", or follows a special token," if scheme == "first" else ""
        return (f"text that begins with a space{after} tokenizes differently: llama.cpp puts '▁' before it, "
                f"transformers (Metaspace prepend_scheme '{scheme}') does not")
    return None
