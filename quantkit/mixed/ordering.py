"""The order of the gate-driven fallback's raises: the damage model's (the cheap proxy), or measured.

The damage model (quantkit.mixed.sensitivity) is gain x weighted error, the gains measured on a few probes
per role and interpolated over depth. It is only worth following where the weighted error ranks what the
probes measured: Spearman's rho of the error against the probes' KL divergence (`proxy_agreement`). At
TRUSTED_RHO or above, or where rho cannot be computed (under three probes, or no spread), the proxy's order
is kept. Below it the proxy carries too little information to spend measured gate steps on its order, and
the damage is measured where it is instead, in two rounds of the same single-unit probes:

1. every decoder block with all its quantized layers at the plain precision, alone (one probe per block,
   each forward starting at its block);
2. every unit (a fused group or a layer) of the blocks that carry most of the blocks' measured KL divergence
   (SPLIT_SHARE of their sum, the most damaging first; a quarter of the blocks at most), alone.

Each round's probes take as many calibration windows as one pass of them through the model pays for (at least
one), so round 1 costs about one probe per block and round 2 about as much again.

A unit's damage is then its measured KL divergence; a unit of a block that was not split gets the share of
its block's KL divergence its measured units leave, split by the proxy's damage. The raises then follow these
damages per added byte (quantkit.mixed.budget.raise_sequence) and the search predicts from them.

TRUSTED_RHO = 0.5: with the 14 probes of a 7-role decoder (two per role), a rank correlation below about 0.46
is not significant at the 5% level (one-sided); below 0.5 the proxy's order is hardly better than chance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

from quantkit.mixed.sensitivity import role_and_depth

TRUSTED_RHO = 0.5  # the proxy's rank correlation below which the raises are ordered by measurement
SPLIT_SHARE = 0.9  # round 2 splits the most damaging blocks until they carry this share of the blocks' KLD
SPLIT_AT_MOST = 4  # ... and splits no more than one block in this many
PROXY, MEASURED = "proxy", "measured"


@dataclass
class Ordering:
    """Which order the raises take, and why (details.sensitivity.ordering, details.fallback.ordering)."""

    used: str  # PROXY or MEASURED
    rank_correlation: float | None
    threshold: float
    reason: str
    blocks: int = 0  # round 1: blocks measured alone
    units: int = 0  # round 2: units measured alone
    windows: int = 0  # calibration windows each measured on
    seconds: float = 0.0
    split: list[str] = field(default_factory=list)  # the blocks round 2 split into units

    def as_dict(self) -> dict:
        return {"used": self.used, "rank_correlation": self.rank_correlation, "threshold": self.threshold,
                "reason": self.reason, **({"blocks": self.blocks, "units": self.units, "windows": self.windows,
                                           "seconds": self.seconds, "split": self.split}
                                          if self.used == MEASURED else {})}


def choose(rank_correlation: float | None, threshold: float | None = None) -> Ordering:
    """The proxy's order where its rank correlation with the probes is at least `threshold` (default
    TRUSTED_RHO) or unknown, else measured (module docstring)."""
    threshold = TRUSTED_RHO if threshold is None else threshold
    if rank_correlation is None:
        return Ordering(PROXY, None, threshold, "too few probes (or no spread) to judge the proxy: its order")
    if rank_correlation >= threshold:
        return Ordering(PROXY, rank_correlation, threshold,
                        f"the weighted error ranks the probes with rho {rank_correlation:.2f} >= {threshold:g}")
    return Ordering(MEASURED, rank_correlation, threshold,
                    f"the weighted error ranks the probes with rho {rank_correlation:.2f} < {threshold:g}: "
                    "blocks and units measured alone")


def block_of(unit) -> Hashable:
    """The decoder block a unit (quantkit.mixed.budget.Unit) belongs to: its first member's layer index, or
    the unit's own name outside the decoder layers."""
    depth = role_and_depth(unit.members[0].name)[1]
    return unit.name if depth is None else depth


def block_label(block: Hashable) -> str:
    return f"block {block}" if isinstance(block, int) else str(block)


def by_block(units: Sequence) -> dict[Hashable, list]:
    """The units grouped by block_of, in their order."""
    blocks: dict[Hashable, list] = {}
    for unit in units:
        blocks.setdefault(block_of(unit), []).append(unit)
    return blocks


def blocks_to_split(block_klds: dict[Hashable, float], sizes: dict[Hashable, int],
                    share: float = SPLIT_SHARE) -> list[Hashable]:
    """The blocks whose units round 2 measures alone: the most damaging first until they carry `share` of
    the blocks' summed KL divergence (at least the worst one), and no more than a quarter of the blocks (so
    that round 2 measures about as many units as round 1 blocks); a block of one unit needs no split."""
    total, most = sum(block_klds.values()), max(1, len(block_klds) // SPLIT_AT_MOST)
    chosen, carried = [], 0.0
    for block in sorted(block_klds, key=lambda b: (-block_klds[b], str(b))):
        if chosen and (carried >= share * total or len(chosen) == most):
            break
        chosen.append(block)
        carried += block_klds[block]
    return [b for b in chosen if sizes.get(b, 0) > 1]


def unit_damages(units: Sequence, block_klds: dict[Hashable, float], unit_klds: dict[str, float]) -> dict[str, float]:
    """{unit: damage at its cheapest candidate}: its measured KL divergence where round 2 measured it (or its
    block is the unit alone); else its block's measured KL divergence less its measured units', split over the
    unmeasured units by the proxy's damage (evenly where the proxy sees none)."""
    damages = {}
    for block, members in by_block(units).items():
        if len(members) == 1 and block in block_klds:
            damages[members[0].name] = block_klds[block]
            continue
        measured = {u.name: unit_klds[u.name] for u in members if u.name in unit_klds}
        damages.update(measured)
        rest = [u for u in members if u.name not in measured]
        if not rest:
            continue
        left = max(0.0, block_klds.get(block, 0.0) - sum(measured.values()))
        proxy = {u.name: u.damage(u.candidates[0]) for u in rest}
        weight = sum(proxy.values())
        damages.update({u.name: left * (proxy[u.name] / weight if weight > 0 else 1 / len(rest)) for u in rest})
    return damages


def set_unit_gains(units: Sequence, damages: dict[str, float]) -> None:
    """Each member's gain such that its unit's damage at its cheapest candidate is `damages[unit]` (every
    member of a unit scaled alike; 16-bit stays at no damage)."""
    for unit in units:
        cheapest = unit.candidates[0]
        error = sum(m.errors[cheapest] for m in unit.members)
        gain = damages[unit.name] / error if error > 0 else 0.0
        for member in unit.members:
            member.gain = gain
