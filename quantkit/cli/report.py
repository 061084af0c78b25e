"""Tables for people: the per-target quality report."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from quantkit.cli.common import human_bytes

if TYPE_CHECKING:
    from quantkit.eval.evaluate import GateResult, Metrics
    from quantkit.run.report import RunReport, TargetReport
    from quantkit.serve.check import ServeReport

Row = tuple[str, "Metrics | None", "GateResult | None"]  # (target name, metrics, gate verdict)


def metrics_table(rows: list[Row], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    table.add_column("target", overflow="fold", min_width=8)
    for column in ("ppl base", "ppl", "Δppl", "KLD mean", "KLD p99", "top-1", "gate"):
        table.add_column(column, justify="right", no_wrap=True)
    for name, m, gate in rows:
        if m is None:
            table.add_row(name, *["—"] * 6, "not measured")
            continue
        table.add_row(name, f"{m.ppl_base:.3f}", f"{m.ppl:.3f}", f"{m.ppl_increase:+.2%}",
                      f"{m.kld_mean:.5f}", f"{m.kld_p99:.5f}", f"{m.top1:.2%}", verdict_text(gate))
    return table


def verdict_text(gate: GateResult | None) -> str:
    if gate is None:
        return "—"
    if gate.passed:
        return "PASS" if gate.enforced else "pass (not enforced)"
    return ("FAIL: " if gate.enforced else "fail (not enforced): ") + ", ".join(gate.failed)


def thresholds_table(rows: list[Row]) -> Table:
    from quantkit.run.report import threshold_text

    table = Table(title="gate thresholds", title_justify="left")
    for column in ("target", "metric", "value", "threshold", "ok"):
        table.add_column(column)
    for name, _metrics, gate in rows:
        for check in gate.checks if gate else []:
            table.add_row(name, check.name, f"{check.value:.6g}", threshold_text(check),
                          "yes" if check.passed else "NO")
    return table


def tasks_table(rows: list[tuple[str, list]], title: str) -> Table:
    """One row per target and task metric (quantkit.eval.tasks.TaskResult or its dict form)."""
    from quantkit.run.report import stat_text as score_text

    table = Table(title=title, title_justify="left")
    for column in ("target", "task", "metric", "samples", "base", "artifact", "recovery", "min", "ok"):
        table.add_column(column, justify="left" if column in ("target", "task", "metric") else "right")
    for name, results in rows:
        for r in results:
            r = r if isinstance(r, dict) else r.as_dict()
            table.add_row(name, r["task"], r["metric"], str(r["samples"]), score_text(r["base"], r["base_stderr"]),
                          score_text(r["score"], r["stderr"]), f"{r['recovery']:.3f}", f"{r['min_recovery']:g}",
                          "yes" if r["passed"] else "NO")
    return table


def print_report(report: RunReport, console: Console, out: Path, quiet: bool = False) -> None:
    """The quality tables (unless quiet), then one summary line per target."""
    rows = [(t.name, t.metrics, t.gate) for t in report.targets]
    if not quiet:
        console.print(metrics_table(rows, "quality (held-out windows vs. the full-precision base)"))
        task_rows = [(t.name, t.tasks) for t in report.targets if t.tasks]
        if task_rows:
            console.print(tasks_table(task_rows, "task accuracy (lm-eval) vs. the full-precision base"))
        if any(t.gate for t in report.targets):
            console.print(thresholds_table(rows))
        for t in report.targets:
            if ladder := t.details.get("auto"):
                console.print(ladder_table(t.name, ladder))
            if section := t.details.get("kv_cache_types"):
                console.print(kv_table(section, f"{t.name}: KV cache (own: over the same weights; total: vs. the "
                                                "base)"))
    multi = len(report.recipe.get("targets") or []) > 1
    for t in report.targets:
        console.print(summary_line(t, out / t.name if multi else out), highlight=False, markup=False)
        if line := starved_experts_text(t.details):
            console.print(f"{t.name}: {line}", highlight=False, markup=False)


STATUS = {"passed": "✅ passed", "failed": "❌ failed", "skipped": "— skipped", "unneeded": "· unneeded",
          "pending": "· pending"}


def ladder_table(name: str, ladder: dict) -> Table:
    """--method auto's ladder: each candidate in the order its answer is read, its size, verdict, seconds and why."""
    chosen = ladder["chosen"]
    title = (f"{name}: --method auto --for {ladder['for']} ({ladder['engine']} on {ladder['device']}, "
             f"{ladder['context']} tokens x {ladder['batch']} of KV cache): "
             + (f"chose {chosen}" if chosen else "none passed"))
    table = Table(title=title, title_justify="left")
    for column, justify in (("candidate", "left"), ("size", "right"), ("bits/w", "right"), ("kernel", "left"),
                            ("verdict", "left"), ("KLD", "right"), ("s", "right"), ("why", "left")):
        table.add_column(column, justify=justify)
    for row in ladder["ladder"]:
        size = human_bytes(row["artifact_bytes"]) if row["artifact_bytes"] else f"~{human_bytes(row['estimated_bytes'])}"
        verdict = STATUS.get(row["status"], row["status"]) + (" (chosen)" if row["candidate"] == chosen else "")
        table.add_row(row["candidate"], size if row["estimated_bytes"] else "", f"{row['bits_per_weight']:.2f}",
                      row["runtime"] or "", verdict, f"{row['kld_mean']:.3g}" if row["kld_mean"] is not None else "",
                      f"{row['seconds']:.1f}" if row["seconds"] is not None else "", row["why"])
    for line in ladder["guide"]:
        table.caption = (table.caption + "; " if table.caption else "guide: ") + line
    return table


def summary_line(t: TargetReport, where: Path) -> str:
    """`name: verdict; metrics; method, timings → where` (or why it was not written)."""
    if t.status == "skipped":
        return f"{t.name}: skipped (up to date) → {where}"
    if t.status == "error" or (t.error and t.gate is None):
        return f"{t.name}: {t.status.upper()}: {t.error}; not written"
    parts = [f"{t.name}: {verdict_text(t.gate) if t.gate else 'not measured'}"]
    if t.metrics:
        m = t.metrics
        parts.append(f"Δppl {m.ppl_increase:+.2%}, KLD {m.kld_mean:.5f}, top-1 {m.top1:.2%}")
    parts.append(f"{t.method} → {t.format}, quantize {t.timings.get('quantize_s', 0):.1f}s, "
                 f"eval {t.timings.get('eval_s', 0):.1f}s, peak RSS {human_bytes(t.peak_rss_bytes)}")
    return "; ".join(parts) + (f" → {where}" if t.written else "; not written")


def starved_experts_text(details: dict) -> str:
    """One line naming the MoE experts the router sent fewer calibration tokens than the threshold
    (quantkit.arch.moe), or '' when there are none."""
    starved = details.get("experts_under_min_tokens") or []
    if not starved:
        return ""
    listed = ", ".join(f"{s['router']} expert {s['expert']} ({s['tokens']})" for s in starved[:8])
    more = f" and {len(starved) - 8} more" if len(starved) > 8 else ""
    return (f"{len(starved)} experts were routed fewer than {details['min_expert_tokens']} calibration tokens "
            f"(calibrated on all tokens anyway): {listed}{more}")


def agreement_cells(a, ppl: str) -> list[str]:
    """KLD (lower bound), its p99, tail mass and top-1 of a quantkit.serve.stats.Agreement, then ppl."""
    if a is None:
        return ["—"] * 4 + [ppl]
    return [f"{a.kld_lower_bound:.5f}", f"{a.kld_lower_bound_p99:.5f}", f"{a.tail_mass:.3f}", f"{a.top1:.2%}", ppl]


def serve_table(report: ServeReport) -> Table:
    """The engine's reading against the base and against quantkit's reading (quantkit serve-check)."""
    e, w = report.engine, report.windows
    ppl = f"{report.ppl.ppl:.3f}" + ("" if report.ppl.ppl_exact else f" ≥ ({report.ppl.targets_outside} outside top-k)")
    title = (f"{Path(report.artifact).name} served by {e['name']} {e['version']} on {e['device']}: "
             f"{w['scored']}/{w['positions']} positions of {w['count']} windows x {w['seq_len']} tokens, "
             f"top-{report.logprobs or 'all'} log-probs"
             + ("" if report.logprobs_normalized else " (not normalized by the engine: KLD scale-free, ppl unchecked)"))
    table = Table(title=title, title_justify="left")
    for column in ("reading", "against", "KLD ≥", "KLD p99 ≥", "tail", "top-1", "ppl"):
        table.add_column(column, justify="left" if column in ("reading", "against") else "right", no_wrap=True)
    table.add_row(e["name"], f"base ({report.base_from})", *agreement_cells(report.vs_base, ppl))
    table.add_row("quantkit", "base, same cells", *agreement_cells(report.reading_vs_base, f"{report.ppl_reading:.3f}"))
    kv = report.kv_cache
    reading = f"quantkit's reading, KV {kv['type']}" if kv else "quantkit's reading"
    table.add_row(e["name"], reading, *agreement_cells(report.vs_reading, f"{report.ppl_reading:.3f}"))
    if kv:
        from quantkit.serve.stats import Agreement

        table.add_row(e["name"], "quantkit's reading, 16-bit KV", *agreement_cells(
            Agreement(**kv["vs_reading_16bit_cache"]), ""))
    if report.reading_vs_base_kld is not None:
        table.add_row("quantkit", "base, full (the gate's KLD)", f"{report.reading_vs_base_kld:.5f}", "", "0.000", "",
                      f"{report.ppl_base:.3f} (base)")
    c = report.ppl_compared
    table.add_row(e["name"], "quantkit's reading, ppl where exact", "", "", "", "",
                  f"{c.engine:.3f} / {c.reading:.3f} on {c.positions} positions")
    g = report.greedy
    table.caption = (f"greedy, {g.prompts} prompts x {g.steps} tokens, {e['name']} vs quantkit: "
                     f"{g.matching_prefix:.1f} tokens before the first difference, {g.identical_share:.1%} identical")
    table.caption_justify = "left"
    return table


def load_table(results: list) -> Table:
    """The load test (quantkit.serve.load.LoadResult per concurrency)."""
    table = Table(title="load test (streamed, greedy; medians per request)", title_justify="left")
    for column in ("concurrent", "prompt tok", "gen tok", "TTFT s", "prefill tok/s", "decode tok/s", "total tok/s"):
        table.add_column(column, justify="right", no_wrap=True)
    for r in results:
        table.add_row(str(r.concurrency), str(r.prompt_tokens), str(r.tokens), f"{r.ttft_s:.3f}",
                      f"{r.prefill_tok_s:.1f}", f"{r.decode_tok_s:.1f}", f"{r.throughput_tok_s:.1f}")
    return table


def serve_checks_table(report: ServeReport) -> Table:
    """serve-check's verdict, one row per check."""
    table = Table(title="serve-check verdict", title_justify="left")
    for column in ("check", "value", "threshold", "ok"):
        table.add_column(column)
    for c in report.checks:
        table.add_row(c.name, f"{c.value:.6g}", f"{c.op} {c.threshold:g}", "yes" if c.passed else "NO")
    return table


def metric_cells(metrics: dict | None) -> tuple[str, str, str]:
    """KLD, Δppl and top-1 of a KV row's metrics; blank where the type was not measured."""
    if metrics is None:
        return "", "", ""
    return f"{metrics['kld_mean']:.5f}", f"{metrics['ppl_increase']:+.2%}", f"{metrics['top1']:.2%}"


def kv_mark(row: dict, chosen: str | None) -> str:
    if row.get("status") == "unneeded":
        return "· unneeded"
    return ("PASS (chosen)" if row["type"] == chosen else "PASS") if row["passed"] else "FAIL"


def kv_table(section: dict, title: str) -> Table:
    """A report's KV-cache section (quantkit.eval.kv.measure: "types", "chosen"), one row per type: bytes per
    token, its own damage over the same weights, the total against the base, and the chosen one marked."""
    table = Table(title=title, title_justify="left")
    table.add_column("KV type", overflow="fold", min_width=8)
    for column in ("bytes/token", "vs 16-bit", "own KLD", "own Δppl", "own top-1", "total KLD", "total Δppl",
                   "total top-1", "gate"):
        table.add_column(column, justify="right", no_wrap=True)
    for row in section["types"]:
        table.add_row(row["type"], f"{row['bytes_per_token']:,.0f}", f"{1 - row['saving']:.0%}",
                      *metric_cells(row["own"]), *metric_cells(row["total"]), kv_mark(row, section["chosen"]))
    return table
