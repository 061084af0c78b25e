"""`quantkit push`: an artifact quantkit wrote, published on the Hugging Face Hub (quantkit.run.push)."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from quantkit.cli.common import MODEL, REPORTS, handle_errors, progress, results_console, write_json


@handle_errors
def push_command(
    output: Path = typer.Argument(..., help="The -o directory of a quantkit quantize run (one artifact, or OUT/<target> for each of several).", rich_help_panel=MODEL),
    repo: str = typer.Argument(..., metavar="ORG/NAME", help="The Hub repo; {name} is a target's name (one repo per target of a run with several).", rich_help_panel=MODEL),
    private: bool = typer.Option(False, "--private", help="Create a missing repo private.", rich_help_panel=MODEL),
    subfolders: bool = typer.Option(False, "--subfolders", help="Several targets into one repo, each in the folder of its name.", rich_help_panel=MODEL),
    only: list[str] = typer.Option([], "--only", metavar="NAME[,NAME]", help="Push only these targets; repeatable.", rich_help_panel=REPORTS),
    json_path: Optional[str] = typer.Option(None, "--json", help="Write what was pushed as JSON to FILE ('-' = stdout).", rich_help_panel=REPORTS),
) -> None:
    """Push artifacts that passed their gate to the Hugging Face Hub, each repo in one commit.

    Examples:

      quantkit push ./my-model-gptq my-org/my-model-gptq

      quantkit push ./dist my-org/my-model-{name} --private      (a run with several targets: one repo each)

      quantkit push ./dist my-org/my-model-quantized --subfolders      (one repo, a folder per target)

    Only an artifact whose gate passed is pushed (its quantkit.json says so); the card is rendered for the
    repo; a missing repo is created, and deleted again if the commit fails. Pushing an unchanged artifact
    again uploads nothing. The token is the hub library's (HF_TOKEN or `hf auth login`). Exit codes: 0 ok,
    1 internal error, 2 bad input or a refused push (nothing pushed).
    """
    from quantkit.errors import InputError
    from quantkit.run import push
    from quantkit.run.card import Place
    from quantkit.run.recipe import check_repo_template

    try:
        check_repo_template(repo)
    except ValueError as exc:
        raise InputError(str(exc), hint="e.g. quantkit push ./out my-org/my-model-fp8") from None
    folders = push.artifact_folders(output)
    wanted = [name.strip() for names in only for name in names.split(",") if name.strip()] or list(folders)
    unknown = [name for name in wanted if name not in folders]
    if unknown:
        raise InputError(f"--only: {output} has no artifact named {', '.join(unknown)}; it has {', '.join(folders)}",
                         hint=f"e.g. --only {next(iter(folders))}")
    places = {name: Place(repo.replace("{name}", name), name if subfolders else None) for name in wanted}
    if len(places) > 1 and not subfolders and "{name}" not in repo:
        raise InputError(f"{len(places)} targets would push to the same repo {repo}",
                         hint="put {name} in the repo (one repo per target), or add --subfolders")
    push.check_push([p.repo for p in places.values()], offline=False)
    pushed = push.push(push.uploads_for(folders, places), private, progress)
    write_json(json_path, {"pushed": pushed})
    for name, result in pushed.items():
        results_console(json_path).print(f"pushed {name}: {result['commit_url']}", highlight=False)
