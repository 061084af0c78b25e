"""docs/ states what the code does: the generated tables of docs/models.md equal the code's tables, and
the pages link to each other and to files that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
MODELS = DOCS / "models.md"


def test_every_generated_table_is_on_the_page():
    from quantkit.run.support import docs_tables, generated_blocks

    assert sorted(generated_blocks(MODELS.read_text())) == sorted(docs_tables())


@pytest.mark.parametrize("name", ["architectures", "families", "vlm-families", "vlm-towers", "moe", "runtimes"])
def test_models_page_table_equals_the_code(name):
    """Each block equals quantkit.run.support's table; `python scripts/make_docs_tables.py` rewrites them."""
    from quantkit.run.support import docs_tables, generated_blocks

    assert generated_blocks(MODELS.read_text())[name] == docs_tables()[name]


def test_generated_tables_name_the_code_tables():
    """The tables are built from the lists the methods' checks read, not from a copy of them."""
    from quantkit.arch.mappings import supported_model_types
    from quantkit.arch.moe import MOE_LAYOUTS
    from quantkit.arch.vlm import FAMILIES
    from quantkit.gguf.convert import supported_architectures
    from quantkit.methods import METHODS, get_method
    from quantkit.mlx.checkpoint import MLX_MODEL_TYPES
    from quantkit.run.support import docs_tables

    tables = docs_tables()

    def cell(method_cell: str) -> list[str]:
        row = next(line for line in tables["architectures"] if line.startswith(f"| {method_cell} |"))
        return re.findall(r"`([A-Za-z0-9_]+)`", row.split("|")[2].split(":", 1)[1])

    assert cell("`awq`, `smoothquant`") == supported_model_types()
    assert cell("`gguf`") == supported_architectures()
    assert cell("`mlx`") == sorted(MLX_MODEL_TYPES)
    assert cell("`fp8`, `gptq`, `autoround`, `nf4`") == sorted(MOE_LAYOUTS)
    assert [re.search(r"\(`(\w+)`\)", line).group(1) for line in tables["vlm-towers"][2:]] == list(FAMILIES)
    runtime_names = {line.split(" | ")[1] for line in tables["runtimes"][2:]}
    assert {r.name for m in METHODS for r in get_method(m).runtimes} <= runtime_names


def test_render_replaces_a_stale_block_and_keeps_the_prose():
    from quantkit.run.support import render

    stale = ("intro\n<!-- generated: moe (python scripts/make_docs_tables.py) -->\n| old |\n"
             "<!-- end generated -->\noutro\n")
    fresh = render(stale)
    assert "| old |" not in fresh and fresh.startswith("intro\n") and fresh.endswith("<!-- end generated -->\noutro\n")
    assert "`mixtral`" in fresh


def test_index_lists_every_page():
    index = (DOCS / "index.md").read_text()
    pages = sorted(p.name for p in DOCS.glob("*.md") if p.name != "index.md")
    assert [page for page in pages if f"]({page})" not in index] == []


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md")) + ["../README.md"])
def test_relative_links_resolve(page):
    text = (DOCS / page).read_text()
    broken = [target for target in re.findall(r"\]\(([^)#:\s]+)(?:#[^)]*)?\)", text)
              if not (DOCS / page).parent.joinpath(target).exists()]
    assert broken == []


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", sorted(p.name for p in (ROOT / "docs").glob("*.md")) + ["../README.md"])
def test_anchors_name_a_heading(page):
    source = DOCS / page
    missing = []
    for target, anchor in re.findall(r"\]\(([^)#:\s]*)#([^)\s]+)\)", source.read_text()):
        linked = source.parent.joinpath(target) if target else source
        headings = {slug(line.lstrip("#")) for line in linked.read_text().splitlines() if line.startswith("#")}
        if anchor not in headings:
            missing.append(f"{target}#{anchor}")
    assert missing == []
