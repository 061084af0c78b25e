"""A conversion's saved progress: which tensors of a partly written .gguf are complete.

The .gguf is written in file order: header, metadata and tensor infos, then each tensor's data
(aligned). After each tensor, a small JSON state file beside the run's work records that tensor's
name, offset, size and sha256, replaced atomically (a temporary file, fsynced, renamed over it).
The state also holds the sha256 of the header the conversion writes and of the imatrix it weights
the tensors with: a later conversion with another header (types, shapes, metadata, vocabulary) or
another imatrix starts the file from the beginning.

To continue, the recorded tensors are verified against the file in order (offset, size, sha256);
the file is cut after the last one that matches and writing goes on from the next. Whatever the
interruption left after it (a torn tensor, padding) is overwritten, so the finished file is the
bytes an uninterrupted conversion writes.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

CHUNK = 1 << 24  # bytes hashed at a time when verifying


@dataclass(frozen=True)
class WrittenTensor:
    name: str
    offset: int  # from the start of the file
    nbytes: int
    sha256: str


@dataclass
class Progress:
    header_sha256: str
    imatrix_sha256: str
    tensors: list[WrittenTensor] = field(default_factory=list)


def imatrix_digest(imatrix: dict | None) -> str:
    """sha256 of an imatrix ({tensor name: importance vector}), names in order; "" for none."""
    if not imatrix:
        return ""
    digest = hashlib.sha256()
    for name in sorted(imatrix):
        digest.update(name.encode() + b"\0")
        digest.update(np.ascontiguousarray(imatrix[name], dtype=np.float32).tobytes())
    return digest.hexdigest()


def load(path: Path) -> Progress | None:
    """The saved progress, or None when there is none or it cannot be read."""
    try:
        data = json.loads(Path(path).read_text())
        tensors = [WrittenTensor(str(t["name"]), int(t["offset"]), int(t["nbytes"]), str(t["sha256"]))
                   for t in data["tensors"]]
        return Progress(str(data["header_sha256"]), str(data["imatrix_sha256"]), tensors)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save(path: Path, progress: Progress) -> None:
    """Replace the state file atomically (written in full and fsynced before the rename)."""
    from quantkit.io.export import replace_json

    replace_json(Path(path), asdict(progress))


def file_sha256(fh, offset: int, nbytes: int) -> str | None:
    """sha256 of nbytes of an open file from offset; None when the file is shorter."""
    digest = hashlib.sha256()
    fh.seek(offset)
    left = nbytes
    while left:
        chunk = fh.read(min(CHUNK, left))
        if not chunk:
            return None
        digest.update(chunk)
        left -= len(chunk)
    return digest.hexdigest()


def verified(path: Path, saved: Progress, wanted: list[WrittenTensor]) -> list[WrittenTensor]:
    """The saved tensors that are still in the file as recorded, in order, up to the first that is
    not: same name, offset and size as this conversion plans (`wanted`: name, offset, nbytes), and
    the file's bytes there hash to the recorded sha256."""
    good: list[WrittenTensor] = []
    with open(path, "rb") as fh:
        for done, plan in zip(saved.tensors, wanted):
            same_place = (done.name, done.offset, done.nbytes) == (plan.name, plan.offset, plan.nbytes)
            if not same_place or file_sha256(fh, done.offset, done.nbytes) != done.sha256:
                break
            good.append(done)
    return good
