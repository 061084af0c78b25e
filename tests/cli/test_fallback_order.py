"""--fallback's order end to end: on the general-case model the weighted-error proxy ranks the probes poorly, so
the raises follow the KL divergence measured block by block and unit by unit; with a proxy trusted (the
threshold lowered), the proxy's order and nothing more measured."""

from __future__ import annotations

import json

GATE = ("--max-kld", "0.00013", "--min-top1", "0", "--max-ppl-increase", "10")
CALIB = ("--num-samples", "16", "--seq-len", "64", "--eval-windows", "4")


def fallback_report(cli, model, out) -> dict:
    result = cli("quantize", model, "--method", "fp8", "--fallback", "--max-size", "+100%", *CALIB, *GATE, "-o", out)
    assert result.exit_code == 0, result.output
    return json.loads((out / "quantkit.json").read_text())["targets"][0]["details"], result.stderr


def test_the_fallback_orders_the_raises_by_measurement_where_the_proxy_ranks_poorly(cli, odd_model, tmp_path,
                                                                                   monkeypatch):
    from quantkit.mixed import ordering

    details, stderr = fallback_report(cli, odd_model, tmp_path / "measured")
    used = details["fallback"]["ordering"]
    assert used == details["sensitivity"]["ordering"] and used["used"] == "measured"
    assert used["rank_correlation"] < used["threshold"] == ordering.TRUSTED_RHO
    assert used["blocks"] == 2 and used["units"] >= 2 and used["split"]
    assert "fallback order: the weighted error ranks the probes with rho" in stderr
    assert "raises in the measured order" in stderr
    steps = details["fallback"]["steps"]
    assert steps[-1]["passed"] and not steps[0]["passed"]
    # the first raise is a unit of a block the measurement split (the most damaging blocks)
    from quantkit.mixed.sensitivity import role_and_depth

    assert {f"block {role_and_depth(name)[1]}" for name in steps[1]["raised"]} <= set(used["split"])

    monkeypatch.setattr(ordering, "TRUSTED_RHO", -1.0)  # every rank correlation trusted: the proxy's order
    trusted, stderr = fallback_report(cli, odd_model, tmp_path / "proxy")
    assert trusted["fallback"]["ordering"]["used"] == "proxy" and "blocks" not in trusted["fallback"]["ordering"]
    assert "raises in the proxy order" in stderr and "KL divergence of 2 blocks" not in stderr
