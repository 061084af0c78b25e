"""The package's layers (scripts/structure.py reads every module's imports with ast, module level and inside
functions): each module imports only from its own layer and the ones below it, no import circle, and nothing
outside quantkit/methods/ and quantkit/formats/ branches on a method or format name."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.util import REPO, script_module

PACKAGE = REPO / "quantkit"


@pytest.fixture(scope="module")
def structure():
    with script_module("structure") as module:
        yield module


@pytest.fixture(scope="module")
def edges(structure):
    return structure.graph(PACKAGE)


def test_the_layer_order_is_the_documented_one(structure):
    """docs/development.md lists the layers from the bottom up, as the test checks them."""
    text = (REPO / "docs" / "development.md").read_text()
    order = text.split("<!-- layers -->", 1)[1].split("<!-- end layers -->", 1)[0]
    assert " < ".join(structure.LAYERS) in " ".join(order.split())


def test_every_module_is_in_a_layer(structure, edges):
    assert structure.unknown_layers(edges) == []
    assert len(edges) > 100 and "quantkit.formats.gguf" in edges  # the walk found the package


def test_imports_point_downward_only(structure, edges):
    assert structure.back_arrows(edges) == []


def test_no_import_circles(structure, edges):
    assert structure.circles(edges) == []


def test_no_method_or_format_branches_outside_their_modules(structure):
    found = {file: [hit for hit in hits if hit[1] != "engine"]
             for file, hits in structure.branches_outside_owners(PACKAGE).items()}
    assert {file: hits for file, hits in found.items() if hits} == {}


def test_the_walk_finds_what_it_looks_for(structure, tmp_path):
    """The checks on a made-up package: a lazy import up a layer, a circle, a branch on a format name."""
    root = tmp_path / "quantkit"
    for folder in ("eval", "run", "methods"):
        (root / folder).mkdir(parents=True)
        (root / folder / "__init__.py").write_text("")
    (root / "__init__.py").write_text("")
    (root / "eval" / "a.py").write_text("def f():\n    from quantkit.run import b\n")
    (root / "run" / "b.py").write_text("from quantkit.eval.a import f\n\nKIND = 'gguf'\n")
    (root / "run" / "c.py").write_text("def g(kind):\n    return kind in ('gguf', 'mlx') or {'vllm': 1, 'mlx': 2}\n")
    (root / "methods" / "d.py").write_text("def h(kind):\n    return kind == 'gguf'\n")
    edges = structure.graph(root)
    assert edges["quantkit.eval.a"] == {"quantkit.run.b"} and edges["quantkit.run.b"] == {"quantkit.eval.a"}
    assert structure.back_arrows(edges) == [("quantkit.eval.a", "quantkit.run.b")]
    assert structure.circles(edges) == [["quantkit.eval.a", "quantkit.run.b"]]
    hits = structure.branches_outside_owners(root)
    assert list(hits) == ["quantkit/run/c.py"]  # methods/ owns its names; a plain constant is no branch
    assert [kind for _line, kind, _text in hits["quantkit/run/c.py"]] == ["method/format"]
    assert structure.kind_of({"vllm", "mlx"}) == "engine" and structure.kind_of({"mlx"}) == "method/format"


def test_lines_per_package_add_up(structure):
    lines = structure.lines_per_package(PACKAGE)
    assert sum(lines.values()) == sum(len(p.read_text().splitlines()) for p in Path(PACKAGE).rglob("*.py"))
