"""A model on the Hugging Face Hub as a run's input: `org/name[@revision]` resolved to a commit sha
before anything is read, only the files a run reads fetched into the hub library's cache (HF_HOME),
a disk check from the repo's file sizes before the download, and the cache alone when offline
(HF_HUB_OFFLINE=1, --offline, recipe `offline: true`).

What is fetched: the safetensors weights (the shards the index names, when there is one), config.json,
generation config, tokenizer, chat template and processor files, the model card (its license goes on
the artifact's card); custom code (*.py) only with trust_remote_code. Never a pickle (*.bin, *.pt), a
.gguf or a file in a subfolder: a repo whose only weights are pickles is refused before the download.
Every hub library error a user can meet becomes a ModelError (exit 2) with a hint.
"""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path

from quantkit.errors import ModelError
from quantkit.units import size_text

HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*)(?:@(?P<revision>[^\s@/][^\s@]*))?$")
COMMIT_SHA = re.compile(r"^[0-9a-f]{40}$")

# Files beside the weights that a run reads (tokenizer, processor, generation config, chat template)
# and the model card; kept in step with quantkit.io.export.SIDE_FILES, which copies them to the artifact.
READ_FILES = ("config.json", "README.md")
INDEX = "model.safetensors.index.json"
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class HubSource:
    """Where a model came from on the Hub: the id, the revision asked, the commit it resolved to, and
    the files read (path in the repo -> bytes)."""

    repo_id: str
    revision: str
    sha: str
    endpoint: str
    files: dict[str, int] = field(default_factory=dict)

    @property
    def pinned(self) -> str:
        """The id at its commit: what a rerun of the recorded recipe reads."""
        return f"{self.repo_id}@{self.sha}"

    def as_dict(self) -> dict:
        return {**asdict(self), "bytes": sum(self.files.values())}


def parse_hub_id(spec: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when SPEC reads `org/name[@revision]`; None otherwise."""
    if spec.startswith((".", "/", "~")):
        return None
    match = HUB_ID.match(spec)
    return (match["repo"], match["revision"]) if match else None


def recorded_base(model: dict) -> str:
    """The base a quantkit.json's `model` record names: its directory where it exists on this machine,
    else the Hub id pinned to the commit it was fetched at (an artifact made elsewhere)."""
    hub = model.get("hub")
    if hub and not Path(model["path"]).exists():
        return f"{hub['repo_id']}@{hub['sha']}"
    return model["path"]


def offline_mode(asked: bool) -> bool:
    """--offline / recipe `offline: true`, or the hub library's own switch (HF_HUB_OFFLINE=1)."""
    from huggingface_hub import constants

    return asked or bool(constants.HF_HUB_OFFLINE)


def fetch(repo_id: str, revision: str | None, offline: bool = False,
          trust_remote_code: bool = False) -> tuple[Path, HubSource]:
    """The local snapshot of REPO_ID at REVISION holding the files a run reads, and where it came from.
    Online: the revision is resolved to its commit, the file list read, the disk checked, then the
    missing files downloaded. Offline (or when the Hub cannot be reached): the hub library's cache only."""
    import httpx
    from huggingface_hub.errors import OfflineModeIsEnabled, RevisionResolutionError

    revision = revision or "main"
    if offline_mode(offline):
        return from_cache(repo_id, revision, trust_remote_code, "offline mode is on (HF_HUB_OFFLINE=1 or --offline)")
    try:
        sha, tree = remote_listing(repo_id, revision)
    except (httpx.TransportError, OfflineModeIsEnabled, RevisionResolutionError) as exc:
        why = f"the Hub cannot be reached ({first_line(exc.__cause__ or exc)})"
        return from_cache(repo_id, revision, trust_remote_code, why)
    except Exception as exc:
        raise hub_error(exc, repo_id, revision) from None
    files = choose_files(repo_id, tree, trust_remote_code, lambda name: read_remote_json(repo_id, sha, name))
    check_download_disk(repo_id, sha, files)
    path = download(repo_id, sha, files)
    return path, HubSource(repo_id, revision, sha, endpoint(), files)


def remote_listing(repo_id: str, revision: str) -> tuple[str, dict[str, int]]:
    """The commit REVISION resolves to (recorded in the cache's refs/, so that an offline run finds it) and
    every file of the repo there (path -> bytes)."""
    from huggingface_hub import HfApi
    from huggingface_hub.hf_api import RepoFile

    api = HfApi()
    sha = api.resolve_revision(repo_id, revision=revision).resolved
    listing = api.list_repo_tree(repo_id, revision=sha, recursive=True)
    tree = {f.path: f.size for f in listing if isinstance(f, RepoFile)}
    return sha, tree


def from_cache(repo_id: str, revision: str, trust_remote_code: bool, why: str) -> tuple[Path, HubSource]:
    """The snapshot the hub library's cache holds for REPO_ID at REVISION (a branch or tag through the
    cache's refs), with every file a run reads; ModelError naming WHY the cache was used otherwise."""
    from huggingface_hub import constants, get_cached_repo_tree, snapshot_download
    from huggingface_hub.errors import CachedRepoTreeNotFoundError, LocalEntryNotFoundError

    try:
        tree = {f.path: f.size for f in get_cached_repo_tree(repo_id, revision=revision)}
        files = choose_files(repo_id, tree, trust_remote_code, lambda name: read_cached_json(repo_id, revision, name))
        path = Path(snapshot_download(repo_id, revision=revision, allow_patterns=sorted(files), local_files_only=True))
    except (CachedRepoTreeNotFoundError, LocalEntryNotFoundError, FileNotFoundError):
        raise ModelError(f"{repo_id}@{revision} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}), and "
                         f"{why}", hint="run once with the network to fill the cache (the same command, without "
                         "--offline), or pass a local checkpoint directory") from None
    return path, HubSource(repo_id, revision, path.name, endpoint(), files)


def choose_files(repo_id: str, tree: dict[str, int], trust_remote_code: bool, read_json) -> dict[str, int]:
    """The files of TREE (path -> bytes) a run reads; READ_JSON(name) reads a small JSON file of the repo
    (the safetensors index, whose shards are the weights when it is there)."""
    from quantkit.io.export import SIDE_FILES

    top = {path: size for path, size in tree.items() if "/" not in path}
    if "config.json" not in top:
        raise ModelError(f"{repo_id} has no config.json at its top level", hint="give the id of a transformers "
                         "checkpoint (config.json and *.safetensors), or a local checkpoint directory")
    weights = weight_names(repo_id, top, read_json)
    extras = [*READ_FILES, *SIDE_FILES, *([p for p in top if p.endswith(".py")] if trust_remote_code else [])]
    return {path: top[path] for path in sorted({*weights, *extras}) if path in top}


def weight_names(repo_id: str, top: dict[str, int], read_json) -> list[str]:
    """The safetensors files to fetch: the index and the shards it names, else model.safetensors, else every
    top-level *.safetensors. A repo without safetensors is refused before anything is downloaded."""
    if INDEX in top:
        shards = sorted(set((read_json(INDEX) or {}).get("weight_map", {}).values()))
        missing = [s for s in shards if s not in top]
        if not shards or missing:
            raise ModelError(f"{repo_id}: {INDEX} names shards the repo does not hold ({', '.join(missing[:3])})"
                             if missing else f"{repo_id}: {INDEX} has no weight_map",
                             hint="the repo is incomplete at this revision: give another revision, or a local "
                                  "directory")
        return [INDEX, *shards]
    if "model.safetensors" in top:
        return ["model.safetensors"]
    found = [p for p in top if p.endswith(".safetensors")]
    if found:
        return found
    if any(p.endswith(PICKLES) for p in top):
        raise ModelError(f"{repo_id} holds only pickle weights (.bin/.pt); quantkit loads safetensors only",
                         hint="use a revision or a repo with *.safetensors weights (or convert it once: "
                              "model.save_pretrained(dir, safe_serialization=True))")
    if any(p.endswith(".gguf") for p in top):
        raise ModelError(f"{repo_id} holds only .gguf files; quantkit quantizes safetensors checkpoints",
                         hint="give the id of the original checkpoint; a .gguf is measured with quantkit eval")
    raise ModelError(f"{repo_id} has no *.safetensors weight files", hint="give the id of a transformers "
                     "checkpoint with *.safetensors weights, or a local checkpoint directory")


def read_remote_json(repo_id: str, sha: str, name: str) -> dict | None:
    from huggingface_hub import hf_hub_download

    try:
        return json.loads(Path(hf_hub_download(repo_id, name, revision=sha)).read_text())
    except Exception as exc:
        raise hub_error(exc, repo_id, sha) from None


def read_cached_json(repo_id: str, revision: str, name: str) -> dict | None:
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo_id, name, revision=revision)
    return json.loads(Path(found).read_text()) if isinstance(found, str) else None


def missing_bytes(repo_id: str, sha: str, files: dict[str, int]) -> int:
    """Bytes of FILES the cache does not hold yet at commit SHA."""
    from huggingface_hub import try_to_load_from_cache

    return sum(size for name, size in files.items()
               if not isinstance(try_to_load_from_cache(repo_id, name, revision=sha), str))


def check_download_disk(repo_id: str, sha: str, files: dict[str, int]) -> None:
    """Refuse (exit 2, with the numbers) a download larger than the free space where the cache lives."""
    from huggingface_hub import constants

    need = missing_bytes(repo_id, sha, files)
    where = existing_parent(Path(constants.HF_HUB_CACHE))
    free = shutil.disk_usage(where).free
    if need > free:
        raise ModelError(f"not enough disk space for {repo_id}: the download is {size_text(need)} "
                         f"({len(files)} files at {sha[:12]}), {size_text(free)} is free in {where}",
                         hint="free some space, or point HF_HOME (the hub library's cache) at a larger disk")


def download(repo_id: str, sha: str, files: dict[str, int]) -> Path:
    """FILES at commit SHA into the cache, with the hub library's progress bars (the CLI shows them on a
    terminal only). The hub library retries a dropped transfer from the byte it reached; a download that
    still fails is exit 2, and the same command fetches only the files the cache does not hold yet (a
    file cut short starts over: huggingface_hub >= 1.x keeps no partial file between processes)."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, revision=sha, allow_patterns=sorted(files)))
    except Exception as exc:
        raise hub_error(exc, repo_id, sha, downloading=True) from None


def hub_error(exc: Exception, repo_id: str, revision: str, downloading: bool = False) -> Exception:
    """The hub library's error as a ModelError (exit 2) with the next step; anything else unchanged."""
    import httpx
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    login = "set HF_TOKEN (or run `hf auth login`) with a token that can read it"
    if isinstance(exc, GatedRepoError):
        return ModelError(f"access to the gated model {repo_id} was refused ({status(exc)})",
                          hint=f"accept the model's conditions on its Hub page, then {login}")
    if isinstance(exc, RevisionNotFoundError) or (isinstance(exc, RepositoryNotFoundError) and not downloading
                                                  and revision != "main" and repo_exists(repo_id)):
        return ModelError(f"{repo_id} has no revision '{revision}'",
                          hint=f"give a branch, tag or commit sha of {repo_id}, e.g. {repo_id}@main")
    if isinstance(exc, RepositoryNotFoundError):
        return ModelError(f"'{repo_id}' is not a local directory, and {endpoint()} has no model {repo_id} (or it is "
                          "private and the token cannot read it)",
                          hint=f"check the path or the id; for a private or gated model {login}")
    if downloading and isinstance(exc, (httpx.HTTPError, HfHubHTTPError, OSError)):
        return ModelError(f"the download of {repo_id} stopped: {first_line(exc)}",
                          hint="run the same command again: the files already downloaded stay in the hub "
                               "library's cache (HF_HOME) and are not fetched again")
    if isinstance(exc, HfHubHTTPError):
        return ModelError(f"the Hub answered {status(exc)} for {repo_id}: {first_line(exc)}",
                          hint="try again later, or pass a local checkpoint directory")
    return exc


def repo_exists(repo_id: str) -> bool:
    """Whether REPO_ID can be read at its main branch (to tell a missing revision from a missing repo on
    servers that answer both with 'repository not found')."""
    from huggingface_hub import HfApi

    try:
        HfApi().model_info(repo_id, revision="main")
    except Exception:
        return False
    return True


def status(exc: Exception) -> str:
    response = getattr(exc, "response", None)
    return f"HTTP {response.status_code}" if response is not None else type(exc).__name__


def first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path
