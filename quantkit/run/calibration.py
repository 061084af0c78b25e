"""Calibration and evaluation text: sources, chat rendering, packing into token windows.

Sources (a string):
  * a bundled set: ``default`` (all four mixed), ``prose``, ``chat``, ``code``, ``math``;
  * a local file: ``.txt`` (documents separated by blank lines), ``.jsonl`` / ``.json``
    (records with a text field, or chat ``messages``), ``.parquet`` (a text column);
  * ``hf:NAME[:CONFIG][:SPLIT]``: a Hugging Face dataset, from the local cache only.

The bundled directory is ``$QUANTKIT_CALIBRATION_DIR`` if set, else ``calibration/`` at the
repository root (editable install), else the ``quantkit/_calibration`` package data.

Packing protocol (``make_windows``):
  1. Load documents in a fixed order (file order, then record order).
  2. Tokenize each document without special tokens; concatenate them with EOS between
     documents (when the tokenizer has an EOS).
  3. Cut the stream into consecutive windows of ``seq_len`` tokens; when the tokenizer has
     a BOS each window is BOS + ``seq_len - 1`` text tokens. A trailing partial window is
     dropped.
  4. Shuffle the windows with ``numpy.random.default_rng(seed)``. The first
     ``eval_windows`` are the held-out evaluation set, the next ``num_samples`` the
     calibration set: disjoint by construction. Too few windows is a CalibrationError.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

from quantkit.errors import CalibrationError
from quantkit.eval.windows import TokenWindows

if TYPE_CHECKING:

    from quantkit.run.recipe import Calibration

BUNDLED_FILES = {
    "prose": ("prose.txt",),
    "chat": ("chat.jsonl",),
    "code": ("code.txt",),
    "math": ("math.txt",),
}
BUNDLED_FILES["default"] = tuple(f for files in list(BUNDLED_FILES.values()) for f in files)
BUNDLED_NAMES = ("default", "prose", "chat", "code", "math")

TEXT_EXTENSIONS = (".txt",)
JSON_EXTENSIONS = (".jsonl", ".json")
PARQUET_EXTENSIONS = (".parquet",)
KNOWN_EXTENSIONS = TEXT_EXTENSIONS + JSON_EXTENSIONS + PARQUET_EXTENSIONS

HF_PREFIX = "hf:"
HF_SPLIT_NAMES = ("train", "validation", "test", "dev", "eval")
TOKENIZE_BATCH = 256

SOURCE_HINT = (
    f"use a bundled set ({', '.join(BUNDLED_NAMES)}), a .txt/.jsonl/.json/.parquet file, "
    "or hf:NAME[:CONFIG][:SPLIT] for a locally cached dataset"
)


# ---------------------------------------------------------------- locating sources


def bundled_dir() -> Path:
    """The directory holding the bundled sets (see the module docstring)."""
    override = os.environ.get("QUANTKIT_CALIBRATION_DIR")
    if override:
        return Path(override)
    package_dir = Path(__file__).resolve().parents[1]  # quantkit/
    repo_dir = package_dir.parent / "calibration"
    if (repo_dir / "prose.txt").is_file():
        return repo_dir
    return package_dir / "_calibration"


def resolve_source(source: str) -> list[Path] | str:
    """Bundled name or file → list of files; ``hf:`` spec → the spec string."""
    if source.startswith(HF_PREFIX):
        parse_hf_source(source)
        return source
    if source in BUNDLED_FILES:
        return bundled_paths(source)
    return [local_path(source)]


def bundled_paths(name: str) -> list[Path]:
    """The files of a bundled set; an error if the bundled directory is incomplete."""
    directory = bundled_dir()
    paths = [directory / filename for filename in BUNDLED_FILES[name]]
    missing = [p for p in paths if not p.is_file()]
    if missing:
        raise CalibrationError(
            f"bundled calibration set '{name}' not found: missing {missing[0]}",
            hint="set QUANTKIT_CALIBRATION_DIR to the directory holding the bundled "
            "calibration files, or reinstall quantkit",
        )
    return paths


def local_path(source: str) -> Path:
    """A local file source, checked for existence and a known extension."""
    path = Path(source).expanduser()
    if not path.exists():
        raise CalibrationError(f"calibration source '{source}' not found", hint=SOURCE_HINT)
    if not path.is_file():
        raise CalibrationError(
            f"calibration source '{source}' is not a file", hint=SOURCE_HINT
        )
    if path.suffix.lower() not in KNOWN_EXTENSIONS:
        raise CalibrationError(
            f"calibration source '{source}' has an unknown extension '{path.suffix}'",
            hint=f"supported: {', '.join(KNOWN_EXTENSIONS)}; or {SOURCE_HINT}",
        )
    return path


def validate_source(source: str) -> None:
    """Cheap fail-fast check: source exists, extension known, files non-empty."""
    resolved = resolve_source(source)
    if isinstance(resolved, str):
        return
    for path in resolved:
        if path.stat().st_size == 0:
            raise_empty(source, path)


def raise_empty(source: str, path: Path) -> None:
    raise CalibrationError(
        f"calibration source '{source}' is empty ({path})",
        hint="add text to the file or choose another source",
    )


def parse_hf_source(source: str) -> tuple[str, str | None, str]:
    """``hf:NAME[:CONFIG][:SPLIT]`` → (name, config, split); split defaults to train.

    With two parts, the second is a split when it looks like one (train, test[:10%], ...).
    """
    spec, bracket, slicing = source[len(HF_PREFIX):].partition("[")
    parts = spec.split(":")
    parts[-1] += bracket + slicing
    if not parts[0] or len(parts) > 3 or any(not p for p in parts):
        raise CalibrationError(
            f"calibration source '{source}' is not a valid hf: spec",
            hint="write hf:NAME, hf:NAME:SPLIT, hf:NAME:CONFIG or hf:NAME:CONFIG:SPLIT",
        )
    if len(parts) == 3:
        return parts[0], parts[1], parts[2]
    if len(parts) == 2 and looks_like_split(parts[1]):
        return parts[0], None, parts[1]
    if len(parts) == 2:
        return parts[0], parts[1], "train"
    return parts[0], None, "train"


def looks_like_split(text: str) -> bool:
    base = re.split(r"[\[+]", text, maxsplit=1)[0]
    return base in HF_SPLIT_NAMES or "[" in text


# ---------------------------------------------------------------- loading documents


def load_texts(
    source: str, tokenizer=None, *, chat_template: bool = True, text_field: str = "text"
) -> list[str]:
    """All documents of a source, in a fixed order; chat records rendered to text."""
    resolved = resolve_source(source)
    if isinstance(resolved, str):
        records = load_hf_records(resolved, text_field)
        texts = records_to_texts(records, source, tokenizer, chat_template, text_field)
    else:
        texts = []
        for path in resolved:
            texts.extend(load_file(path, source, tokenizer, chat_template, text_field))
    if not texts:
        raise CalibrationError(
            f"calibration source '{source}' holds no text",
            hint="add documents to it or choose another source",
        )
    return texts


def load_file(path: Path, source: str, tokenizer, chat_template: bool, text_field: str):
    """Documents of one local file, dispatched on its extension."""
    suffix = path.suffix.lower()
    if suffix in TEXT_EXTENSIONS:
        return split_documents(read_text(path, source), source, path)
    if suffix == ".jsonl":
        records = parse_jsonl(read_text(path, source), source, path)
    elif suffix == ".json":
        records = parse_json(read_text(path, source), source, path)
    else:
        records = read_parquet(path, source, text_field)
    if not records:
        raise_empty(source, path)
    return records_to_texts(records, source, tokenizer, chat_template, text_field)


def read_text(path: Path, source: str) -> str:
    """UTF-8 file content; an error if unreadable or blank."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CalibrationError(
            f"cannot read calibration source '{source}' ({path}): {exc}",
            hint="the file must be readable UTF-8 text",
        ) from exc
    if not text.strip():
        raise_empty(source, path)
    return text


def split_documents(text: str, source: str, path: Path) -> list[str]:
    """Plain text → documents separated by blank lines."""
    docs = [d.strip() for d in re.split(r"\n[ \t]*\n", text)]
    docs = [d for d in docs if d]
    if not docs:
        raise_empty(source, path)
    return docs


def parse_jsonl(text: str, source: str, path: Path) -> list[Any]:
    """One JSON value per non-blank line; a malformed line is named in the error."""
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise CalibrationError(
                f"calibration source '{source}': malformed JSON on line {number} of "
                f"{path}: {exc.msg}",
                hint="each line of a .jsonl file must be one JSON object",
            ) from exc
    return records


def parse_json(text: str, source: str, path: Path) -> list[Any]:
    """A JSON list of records (or one record)."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CalibrationError(
            f"calibration source '{source}': malformed JSON at line {exc.lineno} of "
            f"{path}: {exc.msg}",
            hint="a .json source must hold a list of records",
        ) from exc
    return data if isinstance(data, list) else [data]


def read_parquet(path: Path, source: str, text_field: str) -> list[Any]:
    """Rows of a parquet file as dicts holding the text field (or messages)."""
    import pyarrow.parquet as pq

    try:
        schema_names = pq.read_schema(path).names
        columns = [c for c in (text_field, "messages") if c in schema_names]
        if not columns:
            raise_missing_field(source, text_field, schema_names)
        return pq.read_table(path, columns=columns[:1]).to_pylist()
    except (OSError, ValueError) as exc:
        raise CalibrationError(
            f"cannot read calibration source '{source}' as parquet: {exc}",
            hint="check that the file is a valid parquet file",
        ) from exc


def raise_missing_field(source: str, text_field: str, found) -> None:
    raise CalibrationError(
        f"calibration source '{source}' has no '{text_field}' field (nor chat "
        f"'messages'); found: {', '.join(map(str, found)) or 'nothing'}",
        hint="name the field that holds the text: calibration.text_field in the recipe, or --calib-text-field",
    )


def load_hf_records(source: str, text_field: str) -> list[Any]:
    """Rows of a Hugging Face dataset from the local cache only, never the network."""
    name, config, split = parse_hf_source(source)
    try:
        with offline_datasets():
            import datasets

            dataset = datasets.load_dataset(
                name, config, split=split, download_mode="reuse_dataset_if_exists"
            )
    except Exception as exc:  # datasets raises many kinds when offline and uncached
        raise CalibrationError(
            f"calibration dataset '{source}' is not available in the local Hugging Face "
            f"cache ({type(exc).__name__}: {exc})",
            hint=f"on a machine with network run `datasets.load_dataset({name!r}, "
            f"{config!r}, split={split!r})` to fill the cache (HF_HOME), or export the "
            "text to a .jsonl/.parquet file and pass that path",
        ) from exc
    columns = [c for c in (text_field, "messages") if c in dataset.column_names]
    if not columns:
        raise_missing_field(source, text_field, dataset.column_names)
    return dataset.select_columns(columns[:1]).to_list()


@contextmanager
def offline_datasets() -> Iterator[None]:
    """Force datasets and huggingface_hub offline for the duration of a load (restored after)."""
    import datasets.config as config

    from quantkit.io.offline import offline

    saved = (config.HF_DATASETS_OFFLINE, config.HF_HUB_OFFLINE)
    config.HF_DATASETS_OFFLINE = config.HF_HUB_OFFLINE = True
    try:
        with offline():
            yield
    finally:
        config.HF_DATASETS_OFFLINE, config.HF_HUB_OFFLINE = saved


def records_to_texts(records, source: str, tokenizer, chat_template: bool, text_field: str):
    """Records (strings, text dicts or chat dicts) → non-empty document strings."""
    texts = []
    for record in records:
        text = record_to_text(record, source, tokenizer, chat_template, text_field)
        if text.strip():
            texts.append(text)
    return texts


def record_to_text(record, source: str, tokenizer, chat_template: bool, text_field: str):
    """One record → text: a string, its text field, or its rendered chat messages."""
    if isinstance(record, str):
        return record
    if not isinstance(record, dict):
        raise CalibrationError(
            f"calibration source '{source}' holds a {type(record).__name__} record; "
            "expected an object",
            hint=f"each record must be an object with a '{text_field}' field or 'messages'",
        )
    if isinstance(record.get(text_field), str):
        return record[text_field]
    if isinstance(record.get("messages"), list):
        return render_chat(record["messages"], tokenizer, chat_template)
    raise_missing_field(source, text_field, record.keys())


def render_chat(messages: list[dict], tokenizer, chat_template: bool) -> str:
    """Chat messages → text via the tokenizer's chat template, else 'role: content' lines."""
    if chat_template and tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False)
    return "\n".join(f"{m.get('role', 'user')}: {m.get('content', '')}" for m in messages)


# ---------------------------------------------------------------- packing


def make_windows(tokenizer, spec: Calibration) -> TokenWindows:
    """Load, tokenize, pack and split a source into calibration and evaluation windows."""
    check_spec(spec)
    texts = load_texts(
        spec.source, tokenizer, chat_template=spec.chat_template, text_field=spec.text_field
    )
    stream = token_stream(tokenizer, texts)
    windows = pack_windows(stream, spec.seq_len, tokenizer.bos_token_id)
    needed = spec.eval_windows + spec.num_samples
    if len(windows) < needed:
        raise_too_few(spec, len(windows), len(stream), tokenizer.bos_token_id is not None)
    return split_windows(windows, spec, texts_sha256(texts))


def check_spec(spec: Calibration) -> None:
    """Reject impossible sizes before any work."""
    if spec.seq_len < 2 or spec.num_samples < 0 or spec.eval_windows < 0 or spec.num_samples + spec.eval_windows < 1:
        raise CalibrationError(
            f"invalid calibration sizes for '{spec.source}': seq_len={spec.seq_len}, "
            f"num_samples={spec.num_samples}, eval_windows={spec.eval_windows}",
            hint="use seq_len >= 2 and at least one calibration or evaluation window",
        )


def token_stream(tokenizer, texts: list[str]) -> list[int]:
    """Tokenize documents in batches; join them with EOS between documents."""
    eos = tokenizer.eos_token_id
    stream: list[int] = []
    for start in range(0, len(texts), TOKENIZE_BATCH):
        batch = texts[start:start + TOKENIZE_BATCH]
        for ids in tokenizer(batch, add_special_tokens=False)["input_ids"]:
            if stream and eos is not None:
                stream.append(eos)
            stream.extend(ids)
    return stream


def pack_windows(stream: list[int], seq_len: int, bos: int | None) -> list[list[int]]:
    """Consecutive windows of seq_len tokens, each starting with BOS when there is one."""
    body = seq_len - 1 if bos is not None else seq_len
    prefix = [bos] if bos is not None else []
    count = len(stream) // body
    return [prefix + stream[i * body:(i + 1) * body] for i in range(count)]


def split_windows(windows: list[list[int]], spec: Calibration, sha256: str) -> TokenWindows:
    """Seeded shuffle; first eval_windows are evaluation, next num_samples calibration."""
    import numpy as np
    import torch

    order = np.random.default_rng(spec.seed).permutation(len(windows))
    chosen = [windows[i] for i in order[: spec.eval_windows + spec.num_samples]]
    tensor = torch.tensor(chosen, dtype=torch.long).reshape(-1, spec.seq_len)
    return TokenWindows(
        calib=tensor[spec.eval_windows:].clone(),
        eval=tensor[: spec.eval_windows].clone(),
        source=spec.source,
        sha256=sha256,
    )


def texts_sha256(texts: list[str]) -> str:
    """SHA-256 of the documents, UTF-8, each followed by a NUL byte."""
    digest = hashlib.sha256()
    for text in texts:
        digest.update(text.encode("utf-8"))
        digest.update(b"\0")
    return digest.hexdigest()


def raise_too_few(spec: Calibration, found: int, tokens: int, has_bos: bool) -> None:
    needed = spec.eval_windows + spec.num_samples
    body = spec.seq_len - 1 if has_bos else spec.seq_len
    raise CalibrationError(
        f"calibration source '{spec.source}' gives {found} windows of {spec.seq_len} "
        f"tokens ({tokens} text tokens), but {needed} are needed "
        f"(num_samples={spec.num_samples} + eval_windows={spec.eval_windows}, "
        f"about {needed * body} text tokens)",
        hint="lower num_samples, eval_windows or seq_len, or add more text to the source",
    )
