"""Tables for people: the per-target quality report (stdout)."""

from __future__ import annotations

from rich.table import Table

from quantkit.cli.common import human_bytes, out


def metrics_table(rows: list[dict], title: str) -> Table:
    """rows: {name, metrics, gate} as in the report's targets."""
    table = Table(title=title, title_justify="left")
    for column in ("target", "ppl base", "ppl", "Δppl", "KLD mean", "KLD p99", "top-1", "gate"):
        if column == "target":
            table.add_column(column, overflow="fold", min_width=8)
        else:
            table.add_column(column, justify="right", no_wrap=True)
    for row in rows:
        m, gate = row.get("metrics"), row.get("gate")
        if not m:
            table.add_row(row["name"], *["—"] * 6, "not measured")
            continue
        table.add_row(row["name"], f"{m['ppl_base']:.3f}", f"{m['ppl']:.3f}", f"{m['ppl_increase']:+.2%}",
                      f"{m['kld_mean']:.5f}", f"{m['kld_p99']:.5f}", f"{m['top1']:.2%}", verdict_text(gate))
    return table


def verdict_text(gate: dict | None) -> str:
    if not gate:
        return "—"
    if gate["passed"]:
        return "PASS" if gate["enforced"] else "pass (not enforced)"
    return ("FAIL: " if gate["enforced"] else "fail (not enforced): ") + ", ".join(gate["failed"])


def thresholds_table(rows: list[dict]) -> Table:
    table = Table(title="gate thresholds", title_justify="left")
    for column in ("target", "metric", "value", "threshold", "ok"):
        table.add_column(column)
    for row in rows:
        for check in (row.get("gate") or {}).get("checks", []):
            threshold = "—" if check["threshold"] is None else f"{check['op']} {check['threshold']:g}"
            table.add_row(row["name"], check["name"], f"{check['value']:.6g}", threshold,
                          "yes" if check["passed"] else "NO")
    return table


def print_report(report: dict) -> None:
    targets = report.get("targets", [])
    out.print(metrics_table(targets, "quality (held-out windows vs. the full-precision base)"))
    if any(t.get("gate") for t in targets):
        out.print(thresholds_table(targets))
    for t in targets:
        timing = t.get("timings", {})
        out.print(f"{t['name']}: {t['method']} → {t['format']}; quantize {timing.get('quantize_s', 0):.1f}s, "
                  f"eval {timing.get('eval_s', 0):.1f}s, peak RSS {human_bytes(t.get('peak_rss_bytes', 0))}",
                  highlight=False)
