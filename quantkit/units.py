"""Sizes as users write them: `16GiB`, `500MB`, `2G`, `1073741824`."""

from __future__ import annotations

import re

from quantkit.errors import InputError


def parse_size(text: str) -> int:
    """'16GiB', '500MB', '2G', '1073741824' -> bytes."""
    match = re.fullmatch(r"\s*([0-9.]+)\s*([KMGT]?)(i?B?)\s*", text, re.IGNORECASE)
    if not match:
        raise InputError(f"cannot read the size '{text}'", hint="write e.g. 16GiB, 500MB or 2G")
    number, unit, binary = float(match.group(1)), match.group(2).upper(), match.group(3).lower().startswith("i")
    power = "KMGT".index(unit) + 1 if unit else 0
    return int(number * (1024 if binary or not match.group(3) else 1000) ** power)


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB' (binary units, one decimal)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def size_text(n: int) -> str:
    """An artifact's size in MiB, or GiB from 1 GiB up (model cards, Hub messages)."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
