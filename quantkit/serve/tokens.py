"""Does the engine tokenize text as the Hugging Face tokenizer does?

serve-check sends token ids, so a tokenizer the engine reads differently (a .gguf whose pre-tokenizer
splits text otherwise, a tokenizer file edited after the gate) would pass it and still serve users who
send text worse. So the engine is also asked for its own ids of the held-out text (Engine.tokenize), and
they are compared with the Hugging Face tokenizer's ids of the same text, id for id: special tokens
added (BOS) and parsed on both sides, as a user's prompt is.

The held-out text is each window decoded without its leading BOS (window_text). Pure Python here: the
engine's answers and the reference ids come in as lists, so a recorded response tests it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass

CONTEXT = 3  # tokens shown on each side of the first difference


@dataclass(frozen=True)
class Difference:
    """Where one text's ids first differ, with the ids and decoded pieces around that position."""

    text: int  # which text (0-based; described 1-based)
    position: int  # the first token index whose ids differ, or where one list ends (0-based; described 1-based)
    length: int  # the Hugging Face tokenizer's number of ids for the text
    engine_length: int
    start: int  # index of the first id shown
    ids: list[int]  # the Hugging Face tokenizer's ids from `start`
    engine_ids: list[int]  # the engine's
    pieces: list[str]  # each id decoded alone (the Hugging Face tokenizer)
    engine_pieces: list[str]

    def describe(self) -> str:
        """One line: the position, then each side's ids and pieces around it."""

        def shown(ids: list[int], pieces: list[str], total: int) -> str:
            cells = ", ".join(f"{i} {p!r}" for i, p in zip(ids, pieces)) or "nothing"
            return ("… " if self.start else "") + cells + (" …" if self.start + len(ids) < total else "")

        return (f"text {self.text + 1}, token {self.position + 1} of {self.length} (engine: {self.engine_length}): "
                f"Hugging Face [{shown(self.ids, self.pieces, self.length)}] vs engine "
                f"[{shown(self.engine_ids, self.engine_pieces, self.engine_length)}]")


@dataclass(frozen=True)
class Tokenization:
    """The engine's ids of the held-out texts against the Hugging Face tokenizer's."""

    texts: int
    tokens: int  # the Hugging Face tokenizer's ids over all texts
    differing: int  # texts whose ids differ
    first: Difference | None  # in the first text that differs

    @property
    def matches(self) -> bool:
        return self.differing == 0

    def as_dict(self) -> dict:
        return {**asdict(self), "matches": self.matches}


def window_text(tokenizer, ids: list[int]) -> str:
    """A window's text: its ids decoded without the leading BOS (which tokenizing adds back), special
    tokens kept as text (which tokenizing parses back)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    body = ids[1:] if bos is not None and ids and ids[0] == bos else ids
    return tokenizer.decode(body, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def reference(tokenizer, windows: list[list[int]]) -> tuple[list[str], list[list[int]]]:
    """(the held-out texts, the Hugging Face tokenizer's ids of each, special tokens added)."""
    texts = [window_text(tokenizer, window) for window in windows]
    return texts, [list(tokenizer(text)["input_ids"]) for text in texts]


def first_difference(ours: list[int], theirs: list[int]) -> int | None:
    """The first index where the lists differ (the shorter one's length when it is a prefix of the
    other), None when they are equal."""
    for i, (a, b) in enumerate(zip(ours, theirs)):
        if a != b:
            return i
    return None if len(ours) == len(theirs) else min(len(ours), len(theirs))


def difference(text: int, ours: list[int], theirs: list[int], position: int,
               piece: Callable[[int], str]) -> Difference:
    start = max(0, position - CONTEXT)
    ids, engine_ids = ours[start:position + CONTEXT + 1], theirs[start:position + CONTEXT + 1]
    return Difference(text, position, len(ours), len(theirs), start, ids, engine_ids,
                      [piece(i) for i in ids], [piece(i) for i in engine_ids])


def compare(ours: list[list[int]], theirs: list[list[int]], piece: Callable[[int], str]) -> Tokenization:
    """The engine's ids (`theirs`) against the Hugging Face tokenizer's (`ours`), text by text; `piece`
    decodes one id for the report."""
    positions = [first_difference(a, b) for a, b in zip(ours, theirs)]
    differing = [i for i, p in enumerate(positions) if p is not None]
    first = difference(differing[0], ours[differing[0]], theirs[differing[0]], positions[differing[0]], piece) \
        if differing else None
    return Tokenization(len(ours), sum(len(ids) for ids in ours), len(differing), first)


def piece_decoder(tokenizer) -> Callable[[int], str]:
    """One id decoded alone by the Hugging Face tokenizer, special tokens included."""
    return lambda token: tokenizer.decode([token], skip_special_tokens=False, clean_up_tokenization_spaces=False)
