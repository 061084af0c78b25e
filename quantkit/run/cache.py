"""--skip-existing: is a target's existing output up to date with this run's inputs?

A target's fingerprint is what its artifact depends on: the sha256 of every input file (the
model's weights, config and tokenizer files, each LoRA adapter's files, the calibration text
files, a QLoRA base's 16-bit original, the gate's task files and their data), the merge settings (adapter weights, merge base), the
target's recipe entry, the calibration settings, its resolved gate thresholds,
whether the gate is enforced, the dtype, and the quantkit version. It is stored with the target
in quantkit.json; an output whose stored fingerprint equals this run's, and whose listed files
are all present, is up to date.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from quantkit import __version__

if TYPE_CHECKING:
    from quantkit.io.checkpoint import ModelInfo
    from quantkit.run.recipe import Gate, Recipe, Target

MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "tokenizer.model", "special_tokens_map.json", "vocab.json", "merges.txt", "added_tokens.json",
               "chat_template.jinja", "chat_template.json")


def input_files(info: ModelInfo, recipe: Recipe) -> dict[str, Path]:
    """Every file the run reads, keyed "model/NAME", "loraI/NAME" and "calibration/NAME"."""
    from quantkit.run.calibration import resolve_source

    files = {f"model/{p.name}": p for p in info.weight_files}
    files.update({f"model/{name}": info.path / name for name in MODEL_FILES if (info.path / name).is_file()})
    for index, adapter in enumerate(recipe.lora):
        files.update({f"lora{index}/{p.name}": p for p in sorted(Path(adapter).iterdir()) if p.is_file()})
    if recipe.original_base and recipe.merge_base == "original":
        original = Path(recipe.original_base)
        files.update({f"original_base/{p.name}": p for p in sorted(original.iterdir())
                      if p.is_file() and (p.suffix == ".safetensors" or p.name in MODEL_FILES)})
    source = resolve_source(recipe.calibration.source)
    if not isinstance(source, str):  # hf: datasets are named by their spec (in the calibration settings)
        files.update({f"calibration/{p.name}": p for p in source})
    files.update(task_input_files(recipe))
    return files


def task_input_files(recipe: Recipe) -> dict[str, Path]:
    """The gate's task files and their local data files, keyed "task/NAME" (a task by name reads the
    Hugging Face cache and is named by its spec in the gate)."""
    gates = [recipe.gate, *(t.gate for t in recipe.targets if t.gate is not None)]
    task_files = sorted({task.file for gate in gates for task in gate.tasks if task.file})
    if not task_files:
        return {}
    from quantkit.eval.tasks import local_files

    return {f"task/{p.name}": p for file in task_files for p in local_files(file)}


def input_hashes(info: ModelInfo, recipe: Recipe) -> dict[str, str]:
    return {key: sha256_file(path) for key, path in input_files(info, recipe).items()}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fingerprint(recipe: Recipe, target: Target, gate: Gate, inputs: dict[str, str],
                enforce_gate: bool) -> dict[str, Any]:
    return {
        "quantkit_version": __version__,
        "inputs": inputs,
        # the repo changes no weight (its card is rendered at push); `for` only where a method auto target has it
        "target": target.model_dump(mode="json", exclude={"push"} | ({"destination"} if target.destination is None
                                                                      else set())),
        "calibration": recipe.calibration.model_dump(mode="json"),
        "merge": {"lora_weights": recipe.lora_weights, "merge_base": recipe.merge_base} if recipe.lora else None,
        "gate": gate.model_dump(mode="json"),
        "gate_enforced": enforce_gate,
        "dtype": recipe.dtype,
        "trust_remote_code": recipe.trust_remote_code,
    }


def existing_entry(out_dir: Path, name: str) -> dict[str, Any] | None:
    """The target's entry in OUT_DIR/quantkit.json, or None when there is none to read."""
    try:
        data = json.loads((out_dir / "quantkit.json").read_text())
    except (OSError, ValueError):
        return None
    targets = data.get("targets") if isinstance(data, dict) else None
    for entry in targets if isinstance(targets, list) else []:
        if isinstance(entry, dict) and entry.get("name") == name:
            return entry
    return None


def up_to_date(out_dir: Path, name: str, wanted: dict[str, Any]) -> dict[str, Any] | None:
    """The existing entry when OUT_DIR holds this target built from the same fingerprint and
    every file it lists is still there; otherwise None (the target runs again)."""
    entry = existing_entry(out_dir, name)
    if entry is None or entry.get("fingerprint") != wanted or entry.get("status", "passed") != "passed":
        return None
    files = entry.get("files")
    if not isinstance(files, list) or not files or not all((out_dir / str(f)).exists() for f in files):
        return None
    return entry
