"""README.md is the front door: its first bash block is the two set-up commands CI runs (.ci/run), every
quantkit command it shows exists with the options it names, and its links lead to pages that exist.
The reference tables that used to live here are in docs/models.md (tests/test_docs.py)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import click
import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def code_blocks(text: str) -> list[tuple[str, list[str]]]:
    """(language, lines) of every fenced block."""
    blocks, lang, lines = [], None, []
    for line in text.splitlines():
        if lang is None and line.startswith("```"):
            lang, lines = line[3:].strip(), []
        elif lang is not None and line.startswith("```"):
            blocks.append((lang, lines))
            lang = None
        elif lang is not None:
            lines.append(line)
    return blocks


def shell_commands(lines: list[str]) -> list[list[str]]:
    """The words of each simple command in shell lines: continuations joined, comments dropped,
    split at && and |."""
    joined = "\n".join(lines).replace("\\\n", " ")
    commands = []
    for line in joined.splitlines():
        words = shlex.split(line, comments=True)
        current: list[str] = []
        for word in words + ["&&"]:
            if word in ("&&", "|", "||", ";"):
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(word)
    return commands


def quantkit_invocations(text: str) -> list[list[str]]:
    """The arguments after `quantkit` (or `-m quantkit`) of every command in the page's shell blocks."""
    found = []
    for lang, lines in code_blocks(text):
        if lang not in ("bash", "sh", ""):
            continue
        for words in shell_commands(lines):
            for i, word in enumerate(words):
                if word == "quantkit" and (i == 0 or words[i - 1] == "-m"):
                    found.append(words[i + 1:])
                    break
    return found


def test_first_bash_block_is_the_two_setup_commands():
    """.ci/run runs exactly this block: install + the main job on a bundled default, then the tests."""
    lang, lines = code_blocks(README.read_text())[0]
    commands = [line for line in lines if line.strip()]
    assert lang == "bash" and len(commands) == 2
    assert "pip install" in commands[0] and "quantkit quantize" in commands[0]
    assert commands[1].startswith("python -m pytest")


def resolve(invocation: list[str]) -> tuple[click.Command, list[str], str]:
    """The click command an invocation names, the words after its name, and its name."""
    from typer.main import get_command

    from quantkit.cli.app import app

    command: click.Command = get_command(app)
    words, names = list(invocation), []
    while hasattr(command, "commands") and words and not words[0].startswith("-"):
        name = words.pop(0)
        assert name in command.commands, f"quantkit has no command {' '.join(names + [name])}"
        command = command.commands[name]
        names.append(name)
    return command, words, " ".join(names)


def test_readme_shows_a_command_for_every_common_job():
    shown = {resolve(invocation)[2] for invocation in quantkit_invocations(README.read_text())}
    assert {"quantize", "serve-check", "plan", "merge"} <= shown


@pytest.mark.parametrize("page", ["README.md"] + sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")))
def test_every_shown_option_exists(page):
    """Each `--flag` of each quantkit command a page shows is an option of that command."""
    unknown = []
    for invocation in quantkit_invocations((ROOT / page).read_text()):
        command, words, name = resolve(invocation)
        options = {opt for param in command.params for opt in (*param.opts, *param.secondary_opts)}
        options |= {"--help"}
        for word in words:
            flag = word.split("=", 1)[0]
            if re.fullmatch(r"--?[A-Za-z][\w-]*", flag) and flag not in options:
                unknown.append(f"quantkit {name} {flag}")
    assert unknown == []


def test_readme_is_a_front_door():
    """Short: what quantkit does, one block per common job, which method for which runtime, links. The reference
    lives in docs/ (every page reachable from README or docs/index.md)."""
    text = README.read_text()
    assert len(text.splitlines()) <= 180
    assert "## Common jobs" in text and "## Which method for which runtime" in text
    linked = set(re.findall(r"\]\(docs/([\w.-]+\.md)", text))
    index = (ROOT / "docs" / "index.md").read_text()
    pages = {p.name for p in (ROOT / "docs").glob("*.md")}
    assert "index.md" in linked
    assert [page for page in sorted(pages) if page not in linked and f"]({page})" not in index] == []
