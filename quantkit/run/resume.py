"""--resume: a run keeps its progress in its staging directory, and a later run continues from it.

A resumable run writes, before any work, the identity of what it makes into
`<staging>/.work/resume/run.json`: the quantkit version, the sha256 of every input file, and the
recipe as resolved (gates and the resume switch left out: they change no byte of an artifact),
and the targets `--only` selects. Each target's method keeps its own saved progress in
`<staging>/.work/resume/<target>/` (quantkit.methods.MethodSpec.resume.unit says what it saves:
gguf, each tensor written to the .gguf, quantkit.gguf.resume; fp8's model-free path, each shard,
quantkit.engines.llmcompressor.model_free).

Under torchrun rank 0 makes or takes over the staging directory (the identity holds the number of ranks: progress
saved by another number is refused, exit 2, naming both) and every rank keeps its share of the saved progress in it
(OUT is on storage every rank sees).

`--resume` takes over the staging directory a dead run (SIGKILL, power loss, the OOM killer)
left beside OUT, or one a --resume run left when it was interrupted or failed (a --resume run
keeps its staging directory on every error); a different identity is refused (exit 2) naming
what differs, and nothing is removed. Without saved progress the run starts fresh and says so.
A run without --resume removes dead runs' staging directories, as always.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable

from quantkit import __version__
from quantkit.errors import InputError, UnsupportedError
from quantkit.io import export

RESUME_DIR = "resume"  # under the staging directory's work directory (export.WORK_DIR)
IDENTITY_FILE = "run.json"
NOT_IDENTITY = ("gate", "resume")  # recipe fields that change no artifact byte


def resume_dir(staging: Path) -> Path:
    return staging / export.WORK_DIR / RESUME_DIR


def target_dir(staging: Path, target: str) -> Path:
    """Where one target's method keeps its saved progress."""
    return resume_dir(staging) / target


def identity(recipe_dump: dict, inputs: dict[str, str], only: list[str], world_size: int = 1) -> dict[str, Any]:
    """What a staging directory's saved progress depends on (see the module docstring); under torchrun, the
    number of ranks too (each rank's saved hidden states are those of its share of the windows)."""
    recipe = {k: v for k, v in recipe_dump.items() if k not in NOT_IDENTITY}
    recipe["targets"] = [{k: v for k, v in t.items() if k != "gate"} for t in recipe_dump.get("targets", [])]
    ranks = {"world_size": world_size} if world_size > 1 else {}
    return {"quantkit_version": __version__, "inputs": inputs, "recipe": recipe, "only": sorted(only), **ranks}


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Nested dicts and lists as {"a.b.0.c": leaf}."""
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = ((str(i), v) for i, v in enumerate(value))
    else:
        return {prefix: value}
    flat: dict[str, Any] = {}
    for key, item in items:
        flat.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    return flat if flat or not prefix else {prefix: value}


def differences(saved: dict, wanted: dict) -> list[str]:
    """One line per differing leaf, "key: saved -> now" (a missing side shows as absent)."""
    old, new = flatten(saved), flatten(wanted)
    absent = "(absent)"
    return [f"{key}: {short(old.get(key, absent))} -> {short(new.get(key, absent))}"
            for key in sorted(old.keys() | new.keys()) if old.get(key, absent) != new.get(key, absent)]


def short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 24 else text[:12] + "…"


def read_identity(staging: Path) -> dict | None:
    try:
        data = json.loads((resume_dir(staging) / IDENTITY_FILE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def has_state(staging: Path) -> bool:
    return read_identity(staging) is not None


def check_same(staging: Path, wanted: dict) -> None:
    """InputError (exit 2) naming what differs between the staging directory's run and this one (first, another
    number of torchrun ranks)."""
    saved = read_identity(staging) or {}
    made, now = saved.get("world_size", 1), wanted.get("world_size", 1)
    if made != now:
        raise InputError(f"--resume: the saved progress in {staging} was made by {made} torchrun rank(s), and this "
                         f"launch has {now}", hint=f"launch again with {made} rank(s) (each rank saved the hidden "
                         "states of its share of the windows), or without --resume to start fresh (that removes "
                         "the saved progress)")
    diff = differences(saved, wanted)
    if not diff:
        return
    shown = "; ".join(diff[:3]) + (f"; and {len(diff) - 3} more" if len(diff) > 3 else "")
    raise InputError(f"--resume: the saved progress in {staging} is from another run ({shown})",
                     hint="run with the same model, recipe and quantkit version, or without --resume to start "
                          "fresh (that removes the saved progress)")


def begin(out: Path, wanted: dict, progress: Callable[[str], None]) -> Path:
    """The staging directory of a --resume run: a dead run's with the same identity (its work directory
    cleared but for the saved progress), or a fresh one (said with a warning), its identity written."""
    staging = export.adopt_staging(out, has_state, lambda s: check_same(s, wanted), progress)
    if staging is None:
        progress(f"warning: --resume: no saved progress for {out}; starting fresh")
        staging = export.make_staging(out, progress)
    else:
        progress(f"resuming from the saved progress in {staging.name}")
        clear_work(staging)
    resume_dir(staging).mkdir(parents=True, exist_ok=True)
    export.replace_json(resume_dir(staging) / IDENTITY_FILE, wanted)
    return staging


def clear_work(staging: Path) -> None:
    """Everything in the work directory but the saved progress (a baseline, offload folders, a merge:
    remade by the resumed run)."""
    for path in (staging / export.WORK_DIR).iterdir():
        if path.name != RESUME_DIR:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()


def check_methods(info, targets: list[tuple[str, Any, Any]]) -> None:
    """Before any work: every target resumes (MethodSpec.resume, and Resume.refused for its options),
    else UnsupportedError (exit 2) naming the methods that do. `targets`: (target name, MethodSpec, options)."""
    from quantkit.methods import METHODS, get_method

    for name, method, options in targets:
        why = "it" if method.resume is None else method.resume.refused(info, options)
        if why is not None:
            able = ", ".join(f"{m.name} (from {m.resume.unit})" for m in map(get_method, METHODS) if m.resume)
            raise UnsupportedError(f"target '{name}': {method.name} does not resume an interrupted run (--resume)"
                                   f"{'' if why == 'it' else ': ' + why}; the methods that do: {able}",
                                   hint="run without --resume, or --only the targets whose method resumes")


def staged_bytes(out: Path) -> int:
    """Bytes already in the staging directories a --resume run could take over (the preflight counts
    only what is still to write)."""
    return sum(f.stat().st_size for s in export.resumable_leftovers(out, has_state)
               for f in s.rglob("*") if f.is_file())
