"""Atomic output: everything is written into a staging directory beside OUT, then renamed.

Nothing partial is ever left at OUT: on failure or Ctrl-C the staging directory is removed.
Also copies the files a user needs beside the weights (tokenizer, processor, generation
config, chat template). The model card and quantkit.json are rendered by quantkit.report.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from quantkit.errors import InputError, OutputExistsError

SIDE_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "chat_template.json",
    "generation_config.json", "preprocessor_config.json", "processor_config.json",
    "video_preprocessor_config.json",
)


def check_output(out: Path, overwrite: bool) -> None:
    """Fail fast: OUT must not exist (unless overwrite) and its parent must be writable."""
    if out.exists() and not overwrite:
        raise OutputExistsError(f"output already exists: {out}", hint="pass --overwrite to replace it")
    if out.exists() and not out.is_dir():
        raise InputError(f"output path exists and is not a directory: {out}")
    parent = out.resolve().parent
    if not parent.is_dir():
        raise InputError(f"output parent directory does not exist: {parent}", hint="create it first")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise InputError(f"output parent directory is not writable: {parent}")


def make_staging(out: Path) -> Path:
    """A fresh hidden directory beside OUT (same filesystem, so the final rename is atomic)."""
    parent = out.resolve().parent
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.staging-", dir=parent))
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(staging, 0o777 & ~umask)  # mkdtemp makes 0700; the result should look like any new dir
    return staging


def discard(staging: Path) -> None:
    shutil.rmtree(staging, ignore_errors=True)


def publish(staging: Path, out: Path, overwrite: bool) -> None:
    """Move the finished staging directory to OUT; an old OUT is replaced only with overwrite."""
    out = out.resolve()
    if out.exists():
        if not overwrite:
            raise OutputExistsError(f"output appeared while running: {out}", hint="pass --overwrite")
        old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
        os.rename(out, old / "out")
        try:
            os.rename(staging, out)
        except BaseException:
            os.rename(old / "out", out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(staging, out)


def copy_side_files(model_dir: Path, dest: Path) -> list[str]:
    """Tokenizer/processor/generation files the artifact needs; never overwrite what the method wrote."""
    copied = []
    for name in SIDE_FILES:
        src = model_dir / name
        if src.is_file() and not (dest / name).exists():
            shutil.copy2(src, dest / name)
            copied.append(name)
    return copied


def add_module_names_to_ignore(dest: Path) -> list[str]:
    """Make a compressed-tensors `ignore` list hold both checkpoint names and module names.

    compressed-tensors (>= 0.19) writes `ignore` in *checkpoint* names: it maps module names back
    through transformers' conversion mapping, as `save_pretrained` does for the weights (Llava:
    `model.vision_tower.X` -> `vision_tower.X`, `lm_head` -> `language_model.lm_head`). vLLM maps
    those names itself, but transformers matches `ignore` against the module names of the model it
    builds on reload without mapping them, so it would wrap the unquantized vision tower, projector
    and lm_head as quantized and read garbage scales (llm-compressor issue #3159). Adding each
    entry's module name (the forward mapping transformers applies when loading) serves both.
    Returns the names added; leaves the file alone when nothing is renamed.
    """
    config_file = dest / "config.json"
    if not config_file.is_file():
        return []
    config = json.loads(config_file.read_text())
    qconfig = config.get("quantization_config") or {}
    ignore = qconfig.get("ignore") or []
    names = [n for n in ignore if not n.startswith("re:")]
    if qconfig.get("quant_method") != "compressed-tensors" or not names:
        return []
    try:
        mapped = _checkpoint_to_module_names(dest, config, names)
    except Exception:  # transformers internals moved: keep the list as written; the gate still measures it
        return []
    added = [m for m in dict.fromkeys(mapped) if m not in ignore]
    if added:
        qconfig["ignore"] = ignore + added
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return added


def _checkpoint_to_module_names(dest: Path, config: dict, names: list[str]) -> list[str]:
    """The module name transformers gives each checkpoint name on load (a meta-device model, no weights)."""
    import torch
    from transformers import AutoConfig
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    from quantkit.model import auto_model_class

    hf_config = AutoConfig.from_pretrained(dest, local_files_only=True)
    with torch.device("meta"):
        model = auto_model_class(config).from_config(hf_config)
    conversions = get_model_conversion_mapping(model)
    if not conversions:
        return []
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    meta_state = model.state_dict()
    modules = dict(model.named_modules())
    mapped = []
    for name in names:
        renamed, _ = rename_source_key(name + ".weight", renamings, converters, model.base_model_prefix, meta_state)
        renamed = renamed.removesuffix(".weight")
        if renamed != name and renamed in modules:
            mapped.append(renamed)
    return mapped


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=False, default=str) + "\n")
