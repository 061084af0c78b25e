"""docs/ states what the code does: the generated tables of docs/models.md and docs/gate.md equal the code's
tables, and the pages link to each other, to headings and to files that exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
GENERATED = {"architectures": "models.md", "families": "models.md", "vlm-families": "models.md",
             "vlm-towers": "models.md", "moe": "models.md", "runtimes": "models.md", "gates": "gate.md",
             "engines": "serving.md", "engine-variables": "serving.md", "auto-candidates": "auto.md"}


def test_every_generated_table_is_on_its_page():
    from quantkit.run.support import docs_tables, generated_blocks

    assert sorted(GENERATED) == sorted(docs_tables())
    on_pages = {name: page.name for page in DOCS.glob("*.md") for name in generated_blocks(page.read_text())}
    assert on_pages == GENERATED


@pytest.mark.parametrize("name", sorted(GENERATED))
def test_docs_table_equals_the_code(name):
    """Each block equals quantkit.run.support's table; `python scripts/make_docs_tables.py` rewrites them."""
    from quantkit.run.support import docs_tables, generated_blocks

    assert generated_blocks((DOCS / GENERATED[name]).read_text())[name] == docs_tables()[name]


def test_generated_tables_name_the_code_tables():
    """The tables are built from the lists the methods' checks read, not from a copy of them."""
    from quantkit.arch.mappings import supported_model_types
    from quantkit.arch.moe import MOE_LAYOUTS
    from quantkit.arch.vlm import FAMILIES
    from quantkit.gguf.convert import supported_architectures
    from quantkit.methods import METHODS, get_method, runtimes_for
    from quantkit.methods.nf4 import moe_model_types
    from quantkit.mlx.checkpoint import MLX_MODEL_TYPES
    from quantkit.run.support import docs_tables

    tables = docs_tables()

    def cell(method_cell: str) -> list[str]:
        row = next(line for line in tables["architectures"] if line.startswith(f"| {method_cell} |"))
        return re.findall(r"`([A-Za-z0-9_]+)`", row.split("|")[2].split(":", 1)[1])

    assert cell("`awq`, `smoothquant`") == supported_model_types()
    assert cell("`gguf`") == supported_architectures()
    assert cell("`mlx`") == sorted(MLX_MODEL_TYPES)
    assert cell("`fp8`, `gptq`, `autoround`")[: len(MOE_LAYOUTS)] == sorted(MOE_LAYOUTS)
    nf4_types = cell("`nf4`")
    assert nf4_types[: len(moe_model_types())] == moe_model_types()
    assert set(MOE_LAYOUTS) <= set(moe_model_types())
    assert [re.search(r"\(`(\w+)`\)", line).group(1) for line in tables["vlm-towers"][2:]] == list(FAMILIES)
    runtime_names = {line.split(" | ")[1] for line in tables["runtimes"][2:]}
    assert {r.name for m in METHODS for r in runtimes_for(get_method(m), get_method(m).options())} <= runtime_names


def test_gate_table_is_each_methods_default_gate():
    from quantkit.methods import get_method
    from quantkit.run.support import docs_tables

    rows = {tuple(cell.strip() for cell in line.split("|")[1:3]): line for line in docs_tables()["gates"][2:]}
    assert rows[("`fp8`", "all")].endswith("| 2% | 0.01 | 95% |")
    q4 = next(line for (method, options), line in rows.items() if method == "`gguf`" and "`Q4_K_M`" in options)
    gate = get_method("gguf").default_gate(get_method("gguf").options(gguf_type="Q4_K_M"))
    assert q4.endswith(f"| {gate['max_ppl_increase']:.0%} | {gate['max_kld']:.2f} | {gate['min_top1']:.0%} |")


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
