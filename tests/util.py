"""Helpers shared by tests."""

# Small calibration for speed. The micro model is barely trained, so its next-token
# distributions are flat and top-1 flips on near-ties even when KLD is ~5e-4: loosen only
# top-1 (a later --min-top1 on the same command line wins).
FAST_CALIB = ("--num-samples", "4", "--seq-len", "64", "--eval-windows", "4", "--min-top1", "0.8")


def leftovers(parent, name: str) -> list[str]:
    """Anything at or beside OUT that a failed run could have left (OUT itself or staging dirs)."""
    return sorted(p.name for p in parent.iterdir() if p.name == name or p.name.startswith(f".{name}."))
