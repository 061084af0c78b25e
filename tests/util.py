"""Helpers shared by tests."""

FAST_CALIB = ("--num-samples", "4", "--seq-len", "64", "--eval-windows", "4")


def leftovers(parent, name: str) -> list[str]:
    """Anything at or beside OUT that a failed run could have left (OUT itself or staging dirs)."""
    return sorted(p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}."))
