"""quantkit.mixed.ordering: the fallback's raises in the proxy's order where it ranks the probes well, else in
the order measured block by block and unit by unit."""

from __future__ import annotations

import pytest

from quantkit.mixed import budget, ordering
from quantkit.mixed.budget import Unit
from quantkit.mixed.sensitivity import SensitivityRow


def layer(name: str, error: float, gain: float = 1.0) -> SensitivityRow:
    row = SensitivityRow(name, (4, 4), {"fp8": error, "16-bit": 0.0}, "fp8", "fp8")
    row.gain = gain
    return row


def units_of(errors: dict[str, float]) -> list[Unit]:
    return [Unit(name, [layer(name, error)]) for name, error in errors.items()]


def test_the_proxy_orders_the_raises_unless_it_ranks_the_probes_poorly():
    assert ordering.choose(0.9).used == ordering.PROXY
    assert ordering.choose(ordering.TRUSTED_RHO).used == ordering.PROXY  # at the threshold: still trusted
    assert ordering.choose(None).used == ordering.PROXY  # nothing to judge it by
    low = ordering.choose(0.02)
    assert low.used == ordering.MEASURED and "rho 0.02 < 0.5" in low.reason
    assert low.as_dict()["threshold"] == 0.5 and "blocks" in low.as_dict()
    assert "blocks" not in ordering.choose(0.9).as_dict()  # the proxy's order measures nothing more
    assert ordering.choose(0.6, threshold=0.7).used == ordering.MEASURED


def test_units_are_grouped_by_decoder_block():
    units = units_of({"model.layers.0.self_attn.qkv_proj": 1, "model.layers.0.mlp.down_proj": 1,
                      "model.layers.1.mlp.down_proj": 1, "lm_head": 1})
    assert {b: [u.name for u in us] for b, us in ordering.by_block(units).items()} == {
        0: ["model.layers.0.self_attn.qkv_proj", "model.layers.0.mlp.down_proj"],
        1: ["model.layers.1.mlp.down_proj"], "lm_head": ["lm_head"]}
    assert ordering.block_label(3) == "block 3" and ordering.block_label("lm_head") == "lm_head"


def test_the_most_damaging_blocks_are_split_until_they_carry_most_of_the_damage():
    klds = {0: 1.0, 1: 8.0, 2: 0.6, 3: 0.4, **{b: 0.0 for b in range(4, 8)}}
    sizes = dict.fromkeys(klds, 4)
    assert ordering.blocks_to_split(klds, sizes) == [1, 0]  # 8.0 + 1.0 is 90% of 10.0
    assert ordering.blocks_to_split(klds, sizes, share=0.8) == [1]
    assert ordering.blocks_to_split(klds, {**sizes, 1: 1}) == [0]  # a block of one unit is measured already
    assert ordering.blocks_to_split({0: 0.0, 1: 0.0}, {0: 2, 1: 2}) == [0]  # no damage: the first, by name
    even = dict.fromkeys(range(8), 1.0)
    assert ordering.blocks_to_split(even, dict.fromkeys(even, 4)) == [0, 1]  # a quarter of the blocks at most


def test_measured_damages_replace_the_proxy_and_fill_the_rest_of_each_block():
    units = units_of({"model.layers.0.a": 1.0, "model.layers.0.b": 3.0, "model.layers.0.c": 1.0,
                      "model.layers.1.a": 5.0, "model.layers.1.b": 0.0, "lm_head": 2.0})
    damages = ordering.unit_damages(units, {0: 10.0, 1: 2.0, "lm_head": 0.7}, {"model.layers.0.a": 6.0})
    assert damages["model.layers.0.a"] == 6.0  # measured alone
    # block 0's 10.0 less the measured 6.0, split 3:1 by the proxy's damage
    assert damages["model.layers.0.b"] == pytest.approx(3.0) and damages["model.layers.0.c"] == pytest.approx(1.0)
    assert damages["model.layers.1.a"] == pytest.approx(2.0) and damages["model.layers.1.b"] == 0.0
    assert damages["lm_head"] == 0.7  # a block of one unit: its block's measurement
    even = ordering.unit_damages(units_of({"model.layers.0.a": 0.0, "model.layers.0.b": 0.0}), {0: 1.0}, {})
    assert even == {"model.layers.0.a": 0.5, "model.layers.0.b": 0.5}


def test_unit_gains_make_the_raises_follow_the_measurement():
    """The proxy names layer 0 first (largest error); measured, layer 1 costs most: the raise sequence follows
    the measurement, and a fused unit's damage is its measured KL divergence."""
    rows = [layer("model.layers.0.mlp.down_proj", 8.0), layer("model.layers.1.mlp.down_proj", 1.0),
            layer("model.layers.1.self_attn.q_proj", 1.0), layer("model.layers.1.self_attn.k_proj", 3.0)]
    units = [Unit(rows[0].name, [rows[0]]), Unit(rows[1].name, [rows[1]]),
             Unit("model.layers.1.self_attn.qkv_proj", rows[2:])]
    ladder = budget.Ladder(rows, dict.fromkeys((r.name for r in rows), "fp8"), lambda row, p: 1 if p == "fp8" else 2,
                           lambda plan: units)
    assert budget.raise_sequence(ladder)[0].unit == "model.layers.0.mlp.down_proj"
    ordering.set_unit_gains(units, {rows[0].name: 0.1, rows[1].name: 0.2, "model.layers.1.self_attn.qkv_proj": 0.8})
    assert units[2].damage("fp8") == pytest.approx(0.8) and units[2].damage("16-bit") == 0.0
    assert [r.unit for r in budget.raise_sequence(ladder)] == [
        "model.layers.1.self_attn.qkv_proj", "model.layers.1.mlp.down_proj", "model.layers.0.mlp.down_proj"]
