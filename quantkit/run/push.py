"""Publishing artifacts on the Hugging Face Hub: `quantize --push-to-hub` / a recipe's `push:` after a
run that passed, and `quantkit push OUT org/name` for an artifact written before.

Only an artifact whose gate passed is pushed, read back from its own directory (its quantkit.json
says what it is and how it measured). Each repo gets one commit with every file of its artifacts and
a card rendered for the repo (quantkit.run.card: the run command names the repo); the message names
each method and its gate's verdict. A repo that is missing is created (private on request) and
deleted again when the commit fails, so a refused push leaves no partial repo. The hub library
skips the files the repo already holds unchanged: pushing the same artifact again uploads nothing
and makes no commit. Upload goes through huggingface_hub (Xet where hf_xet is installed, else LFS).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from quantkit.errors import InputError, InternalError, QuantkitError
from quantkit.run.card import FIGURE, Place, model_card, repo_card, verdict_word
from quantkit.run.report import RunReport, TargetReport

Progress = Callable[[str], None]
SKIPPED = ("README.md",)  # rendered for the repo instead of copied


@dataclass(frozen=True)
class Upload:
    """One artifact directory going to its place on the Hub, with the report its quantkit.json holds."""

    folder: Path
    target: TargetReport
    report: RunReport
    place: Place


def check_push(repos: list[str], offline: bool) -> None:
    """Before any work: pushing needs the network and a token that can write (exit 2 otherwise)."""
    if not repos:
        return
    if offline:
        raise InputError(f"pushing to {repos[0]} needs the network, and offline mode is on (--offline, recipe "
                         "`offline: true` or HF_HUB_OFFLINE=1)",
                         hint="drop offline mode for this run, or push the artifact later: quantkit push OUT REPO")
    from huggingface_hub import HfApi, get_token

    if get_token() is None:
        raise InputError(f"pushing to {repos[0]} needs a Hugging Face token, and none is set",
                         hint="set HF_TOKEN (in CI: from the secret store) or run `hf auth login`")
    try:
        role = HfApi().whoami().get("auth", {}).get("accessToken", {}).get("role")
    except Exception as exc:
        raise push_error(exc, repos[0]) from None
    if role == "read":
        raise InputError(f"the Hugging Face token is read-only: it cannot push to {repos[0]}",
                         hint="use a token with write access (a 'write' or fine-grained token) in HF_TOKEN")


def load_report(folder: Path) -> RunReport:
    """The report in FOLDER/quantkit.json (an artifact's, or a run's OUT)."""
    record = folder / "quantkit.json"
    if not record.is_file():
        raise InputError(f"{folder} has no quantkit.json: it is not an output quantkit wrote",
                         hint="give the -o directory of a quantkit quantize run")
    try:
        return RunReport.from_dict(json.loads(record.read_text()))
    except (ValueError, KeyError, TypeError) as exc:
        raise InputError(f"{record} cannot be read: {exc}".splitlines()[0],
                         hint="the output is damaged: run quantkit quantize again") from None


def read_artifact(folder: Path) -> tuple[TargetReport, RunReport]:
    """The target and run report of an artifact directory quantkit wrote."""
    report = load_report(folder)
    if len(report.targets) != 1:
        raise InputError(f"{folder / 'quantkit.json'} describes {len(report.targets)} targets, not one artifact",
                         hint="push the run's directory, OUT: each OUT/<target> is pushed from its own quantkit.json")
    return report.targets[0], report


def artifact_folders(out: Path) -> dict[str, Path]:
    """Target name -> artifact directory of a run's OUT (OUT itself for one target, OUT/<target> for several),
    for the targets the last run into OUT wrote or found up to date: a target that failed there is left out,
    even where an older artifact of it is still in OUT."""
    targets = load_report(out).targets
    if len(targets) == 1 and not (out / targets[0].name / "quantkit.json").is_file():
        return {targets[0].name: out}
    return {t.name: out / t.name for t in targets
            if t.status in ("passed", "skipped") and (out / t.name / "quantkit.json").is_file()}


def uploads_for(folders: dict[str, Path], places: dict[str, Place]) -> list[Upload]:
    """The artifacts to push (those with a place), each read back and checked: gate passed, files present."""
    uploads = []
    for name, place in places.items():
        target, report = read_artifact(folders[name])
        check_upload(folders[name], target)
        uploads.append(Upload(folders[name], target, report, place))
    return uploads


def check_upload(folder: Path, target: TargetReport) -> None:
    """Only an artifact whose gate was measured and passed, with every file its record lists."""
    verdict = verdict_word(target)
    if verdict != "PASS":
        raise InputError(f"{target.name} did not pass its gate ({verdict}): quantkit pushes only artifacts that "
                         "passed", hint="measure it (eval windows > 0) and make it pass; nothing was pushed")
    missing = [name for name in target.files if not (folder / name).exists()]
    if missing:
        raise InputError(f"{folder} lacks {', '.join(missing[:3])}, listed in its quantkit.json",
                         hint="the artifact is incomplete: run quantkit quantize again; nothing was pushed")


def push(uploads: list[Upload], private: bool, progress: Progress = lambda message: None) -> dict[str, dict]:
    """Each repo's artifacts in one commit; target name -> what was pushed (repo, subfolder, commit_url, commit)."""
    results: dict[str, dict] = {}
    for repo in dict.fromkeys(u.place.repo for u in uploads):
        group = [u for u in uploads if u.place.repo == repo]
        progress(f"pushing {', '.join(u.target.name for u in group)} to {repo}")
        try:
            info = commit(repo, group, private)
        except QuantkitError as exc:
            done = sorted({r["repo"] for r in results.values()})
            exc.message += f" (pushed before it: {', '.join(done)})" if done else ""
            raise
        for u in group:
            results[u.target.name] = {"repo": repo, "subfolder": u.place.subfolder, "commit_url": info.commit_url,
                                      "commit": info.oid}
        progress(f"pushed {repo}: {info.commit_url}")
    return results


def commit(repo: str, uploads: list[Upload], private: bool):
    """One commit of UPLOADS to REPO, created first when missing (and deleted again when the commit fails)."""
    from huggingface_hub import HfApi

    api = HfApi()
    created = False
    try:
        if not api.repo_exists(repo):
            api.create_repo(repo, private=private)
            created = True
        return api.create_commit(repo, operations(uploads, repo), commit_message=commit_message(uploads),
                                 commit_description=commit_description(uploads))
    except Exception as exc:
        if created:
            remove_repo(api, repo)
        raise push_error(exc, repo) from None


def remove_repo(api, repo: str) -> None:
    """Delete the repo this push created (best effort: the error being reported is the push's)."""
    try:
        api.delete_repo(repo)
    except Exception:  # noqa: BLE001 - the push's own error is the one to report
        pass


def operations(uploads: list[Upload], repo: str) -> list:
    """Every file of each artifact (README.md rendered for its place), and a root card for subfolders."""
    from huggingface_hub import CommitOperationAdd

    ops = []
    for u in uploads:
        prefix = f"{u.place.subfolder}/" if u.place.subfolder else ""
        for path in artifact_files(u.folder):
            ops.append(CommitOperationAdd(path_in_repo=prefix + path.relative_to(u.folder).as_posix(),
                                          path_or_fileobj=str(path)))
        card = model_card(u.target, u.report, u.place, (u.folder / FIGURE).is_file())
        ops.append(CommitOperationAdd(path_in_repo=prefix + "README.md", path_or_fileobj=card.encode()))
    if any(u.place.subfolder for u in uploads):
        card = repo_card([(u.target, u.report) for u in uploads], repo)
        ops.append(CommitOperationAdd(path_in_repo="README.md", path_or_fileobj=card.encode()))
    return ops


def artifact_files(folder: Path) -> list[Path]:
    """The artifact's files: everything under FOLDER but hidden entries and the card (rendered instead)."""
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name not in SKIPPED
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def commit_message(uploads: list[Upload]) -> str:
    """'quantkit: gptq int4 W4A16 of org/base, gate PASS' (each target's method and verdict)."""
    parts = [f"{u.target.name} ({u.target.method}) gate {verdict_word(u.target)}" for u in uploads]
    hub = uploads[0].report.model.hub
    base = f" of {hub['repo_id']}@{hub['sha'][:12]}" if hub else ""
    return f"quantkit: {'; '.join(parts)}{base}"


def commit_description(uploads: list[Upload]) -> str:
    """One line per target: the gate's metrics."""
    lines = []
    for u in uploads:
        m = u.target.metrics
        lines.append(f"{u.target.name}: {u.target.format}; Δppl {m.ppl_increase:+.2%}, KLD mean {m.kld_mean:.6f}, "
                     f"p99 {m.kld_p99:.6f}, top-1 {m.top1:.2%}")
    return "\n".join(lines)


def push_error(exc: Exception, repo: str) -> Exception:
    """The hub library's error during a push as exit 2 with the next step (a card the Hub refuses is quantkit's
    bug, exit 1)."""
    import httpx
    from huggingface_hub.errors import HfHubHTTPError

    if isinstance(exc, ValueError) and "README.md" in str(exc):
        return InternalError(f"the Hub refused the model card quantkit wrote for {repo}: {' '.join(str(exc).split())}")
    if isinstance(exc, HfHubHTTPError) and exc.response is not None and exc.response.status_code in (401, 403):
        return InputError(f"the Hugging Face token cannot write to {repo} (HTTP {exc.response.status_code}); "
                          f"nothing was pushed to {repo}",
                          hint=f"use a token with write access to {repo.split('/')[0]} in HF_TOKEN (or "
                               "`hf auth login`)")
    if isinstance(exc, HfHubHTTPError):
        code = exc.response.status_code if exc.response is not None else "?"
        return InputError(f"the Hub refused the push to {repo} (HTTP {code}): {first_line(exc)}; nothing was "
                          f"pushed to {repo}",
                          hint="fix what it says, then push again: quantkit push OUT REPO")
    if isinstance(exc, (httpx.HTTPError, OSError)):
        return InputError(f"the push to {repo} failed: {first_line(exc)}; nothing was pushed to {repo}",
                          hint="check the network, then push again: quantkit push OUT REPO")
    return exc


def first_line(exc: Exception) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
