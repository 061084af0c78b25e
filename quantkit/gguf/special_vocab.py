"""gguf-py's SpecialVocab with the rules of llama.cpp's own gguf-py copy (llama.cpp 0c1e570).

The gguf package on PyPI (0.19) and the gguf-py that convert_hf_to_gguf.py imports differ in how
they decide tokenizer.ggml.add_bos_token / add_eos_token / add_sep_token and in two keys:

* the flags read from tokenizer.json's post_processor win over tokenizer_config.json's
  add_{bos,eos,sep}_token (PyPI: the other way round);
* a ByteLevel post-processor means "add neither BOS nor EOS" unless a template says otherwise;
* a TemplateProcessing whose leading special token is not tokenizer_config.json's bos_token
  (nor cls_token) becomes the BOS when tokenizer_config.json names none;
* normalizer Lowercase / StripAccents (also inside a Sequence or a BertNormalizer) are written
  as tokenizer.ggml.normalizer.lowercase / .strip_accents.

Everything else (special ids, merges, chat template) is gguf-py's own code. This subclass
recomputes the flags after gguf-py's loading, with the newer rules.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf

NORMALIZER_KEYS = {"lowercase": "tokenizer.ggml.normalizer.lowercase",
                   "strip_accents": "tokenizer.ggml.normalizer.strip_accents"}


class SpecialVocab(gguf.SpecialVocab):
    def __init__(self, path, load_merges: bool = False, special_token_types=None, n_vocab: int | None = None):
        super().__init__(path, load_merges=load_merges, special_token_types=special_token_types, n_vocab=n_vocab)
        tokenizer = read_json(Path(path) / "tokenizer.json")
        config = read_json(Path(path) / "tokenizer_config.json")
        self.normalizer_flags = normalizer_flags(tokenizer.get("normalizer") or {})
        if tokenizer:
            flags, bos = post_processor_flags(tokenizer, config)
            if (bos_id := added_token_id(tokenizer, bos)) is not None:
                self.special_token_ids.pop("bos", None)  # read before config.json's bos_token_id
                self._set_special_token("bos", bos_id)
            if "sep" in self.add_special_token:
                flags.setdefault("sep", self.add_special_token["sep"])
            for typ in self.special_token_types:
                entry = config.get(f"add_{typ}_token")
                if isinstance(entry, bool) and typ not in flags:
                    flags[typ] = entry
            self.add_special_token = flags

    def add_to_gguf(self, gw, quiet: bool = False) -> None:
        super().add_to_gguf(gw, quiet=quiet)
        for name, value in self.normalizer_flags.items():
            gw.add_bool(NORMALIZER_KEYS[name], value)


def read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def added_token_id(tokenizer: dict, content) -> int | None:
    if content is None:
        return None
    return next((t.get("id") for t in tokenizer.get("added_tokens", []) if t.get("content") == content), None)


def normalizer_flags(normalizer: dict) -> dict[str, bool]:
    """SpecialVocab._parse_normalizer of llama.cpp's gguf-py."""
    kind = normalizer.get("type")
    if kind == "Lowercase":
        return {"lowercase": True}
    if kind == "StripAccents":
        return {"strip_accents": True}
    if kind == "BertNormalizer":
        return {k: normalizer[k] for k in ("lowercase", "strip_accents") if k in normalizer}
    flags: dict[str, bool] = {}
    if kind == "Sequence":
        for inner in normalizer.get("normalizers", []):
            flags.update(normalizer_flags(inner))
    return flags


def post_processor_flags(tokenizer: dict, config: dict) -> tuple[dict[str, bool], str | None]:
    """({bos/eos/sep: add?} from tokenizer.json's post_processor, a BOS token to adopt or None).

    Token values are compared as tokenizer_config.json stores them, as llama.cpp's gguf-py does.
    """
    bos, cls = config.get("bos_token"), config.get("cls_token")
    if not bos and cls and config:
        bos = cls
    flags: dict[str, bool] = {}
    adopt = None
    processor = tokenizer.get("post_processor") or {}
    for step in processor.get("processors", [processor]) if processor else []:
        kind = step.get("type")
        if kind == "ByteLevel":
            flags.setdefault("bos", False)
            flags.setdefault("eos", False)
        elif kind == "RobertaProcessing":
            flags.update(bos=True, eos=True, sep=True)
        elif kind == "TemplateProcessing":
            adopt = template_flags(step.get("single", []), bool(config), bos, cls, flags) or adopt
    return flags, adopt


def template_flags(single: list, has_config: bool, bos, cls, flags: dict[str, bool]) -> str | None:
    """TemplateProcessing<single>'s leading / trailing special tokens -> add_bos / add_eos."""
    if len(single) <= 1:
        return None
    first = single[0].get("SpecialToken", {}).get("id")
    adopt = None
    if first:
        known = not has_config or first in (bos, cls)
        if not known and not bos:
            adopt = first
        flags["bos"] = known or not bos or not cls  # a missing bos/cls token becomes `first`
    if single[-1].get("SpecialToken", {}).get("id"):
        flags["eos"] = True  # a different trailing token replaces the EOS (gguf-py, both versions)
    return adopt
