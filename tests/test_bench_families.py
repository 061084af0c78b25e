"""scripts/bench_families.py: the matrix it renders from a saved run, docs/models.md's measured block equal to the
saved run's rendering, and --page rewriting only that block (the run itself is a benchmark)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "bench_families.py"
SAVED = ROOT / "docs" / "bench_families.json"
BEGIN = ("<!-- measured: family-matrix (python scripts/bench_families.py --render docs/bench_families.json --page "
         "docs/models.md) -->")
END = "<!-- end measured -->"


def rendered(path: Path) -> list[str]:
    return subprocess.run([sys.executable, str(SCRIPT), "--render", str(path)], capture_output=True, text=True,
                          check=True).stdout.splitlines()


def test_render_writes_each_cell_by_its_exit_code(tmp_path):
    run = {"methods": ["fp8", "mlx"], "families": {"x": {
        "fp8": {"exit": 0, "seconds": 3.25, "message": "", "proof": "reload"},
        "mlx": {"exit": 2, "seconds": 0.5, "message": "mlx: no model"}}}}
    (tmp_path / "run.json").write_text(json.dumps(run))
    assert rendered(tmp_path / "run.json") == ["| family | `fp8` | `mlx` |", "|---|---|---|",
                                               "| `x` | ✅ 3.2 s reload | 2 refused [1] |", "",
                                               "Refusals (exit 2 before work):", "", "- [1] mlx: no model"]


def test_docs_models_shows_the_saved_matrix():
    lines = (ROOT / "docs" / "models.md").read_text().splitlines()
    assert lines[lines.index(BEGIN) + 1:lines.index(END)] == rendered(SAVED)


def test_page_rewrites_only_the_measured_block(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(f"# title\n\nprose\n{BEGIN}\nstale\n{END}\nafter\n")
    subprocess.run([sys.executable, str(SCRIPT), "--render", str(SAVED), "--page", str(page)], check=True)
    assert page.read_text() == "# title\n\nprose\n" + "\n".join([BEGIN, *rendered(SAVED), END]) + "\nafter\n"


def test_the_matrix_has_a_row_for_every_mixture_of_experts_family():
    """The MoE families of tests/families (Granite 4's MoE variant and Llama 4's text model among them) are rows
    of the matrix beside the dense ones (built only when the benchmark runs)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_families", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.family_builders()
    from tests.families.test_moe import FAMILIES, REFUSED

    assert {*FAMILIES, *REFUSED, "qwen2_moe", "granitemoehybrid (MoE)", "granitemoehybrid"} <= set(rows)
