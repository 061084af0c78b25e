"""README.md states what the code does: the supported-architecture table equals the code's tables."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_row(method_cell: str) -> str:
    section = README.read_text().split("### Supported architectures", 1)[1]
    for line in section.splitlines():
        if line.startswith(f"| {method_cell} |"):
            return line.split("|")[2]
    raise AssertionError(f"README has no supported-architecture row for {method_cell}")


def readme_table(header: str) -> list[str]:
    """The README's table lines from the one starting with `header` to the first non-table line."""
    section = header + README.read_text().split(header, 1)[1]
    table = []
    for line in section.splitlines():
        if not line.startswith("|"):
            break
        table.append(line)
    return table


def listed(cell: str) -> list[str]:
    return re.findall(r"[A-Za-z0-9_]+", cell.split(":", 1)[1])


def test_smoothing_architectures_match_the_mapping_table():
    from quantkit.arch.mappings import supported_model_types

    assert listed(readme_row("`awq`, `smoothquant`")) == supported_model_types()


def test_gguf_architectures_match_the_converter_table():
    from quantkit.gguf.convert import supported_architectures

    assert listed(readme_row("`gguf`")) == supported_architectures()


def test_moe_architectures_match_the_moe_table():
    from quantkit.arch.moe import MOE_LAYOUTS

    cell = readme_row("`fp8`, `gptq`, `nf4`")
    assert re.findall(r"[a-z0-9_]+", cell.split("model_type`:", 1)[1]) == sorted(MOE_LAYOUTS)


def test_family_table_is_generated_from_the_methods_tables():
    """README's family x method table equals quantkit.run.support.family_table() (print it to update README)."""
    from quantkit.run.support import family_table

    assert readme_table("| family (`model_type`)") == family_table()


def test_vlm_table_is_generated_from_the_methods_tables():
    """README's VLM family x method table equals quantkit.run.support.vlm_table()."""
    from quantkit.run.support import vlm_table

    assert readme_table("| VLM family (`model_type`)") == vlm_table()


def test_mlx_model_types_match_the_mlx_table():
    from quantkit.mlx.checkpoint import MLX_MODEL_TYPES

    assert listed(readme_row("`mlx`")) == sorted(MLX_MODEL_TYPES)
