"""README's family x method tables, each cell what the method says of the family
(MethodSpec.support over quantkit.arch.families). tests/test_readme.py keeps README equal to
`family_table()` and `vlm_table()`."""

from __future__ import annotations

from quantkit.arch.families import TEXT_FAMILIES, VLM_FAMILIES, Family
from quantkit.methods import METHODS, get_method


def verdict(model_type: str, method: str) -> str:
    """One cell: what `method` does with the family of README's tables whose model_type this is."""
    family = next(f for f in TEXT_FAMILIES + VLM_FAMILIES if f.model_type == model_type)
    return get_method(method).support(family)


def table(header: str, families: list[Family]) -> list[str]:
    """Markdown rows: a header cell, one column per method, one row per family."""
    lines = [f"| {header} | " + " | ".join(f"`{m}`" for m in METHODS) + " |", "|---" * (len(METHODS) + 1) + "|"]
    for family in families:
        cells = [get_method(m).support(family) for m in METHODS]
        lines.append(f"| {family.name} (`{family.model_type}`) | " + " | ".join(cells) + " |")
    return lines


def family_table() -> list[str]:
    """The markdown rows of README's family x method table."""
    return table("family (`model_type`)", TEXT_FAMILIES)


def vlm_table() -> list[str]:
    """The markdown rows of README's VLM family x method table."""
    return table("VLM family (`model_type`)", VLM_FAMILIES)
