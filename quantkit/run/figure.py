"""The model card's figure: how the KL divergence from the base spreads over the held-out positions, as
a PNG written with matplotlib (imported here only, on the Agg backend: no display, no network)."""

from __future__ import annotations

import math
from pathlib import Path

from quantkit.run.report import TargetReport


def position(value: float, edges: tuple[float, ...]) -> float:
    """Where VALUE falls on the bar axis: bar 0 holds what is below the first edge, bar k+1 spans edges k to k+1
    (drawn from k + 0.5 to k + 1.5, log-spaced), the last bar what is above the last edge."""
    if value < edges[0]:
        return -0.5 + max(value, 0.0) / edges[0]
    if value >= edges[-1]:
        return len(edges) - 0.5
    steps = (math.log10(value) - math.log10(edges[0])) / (math.log10(edges[1]) - math.log10(edges[0]))
    return 0.5 + steps


def kld_figure(target: TargetReport, path: Path) -> Path | None:
    """The histogram of the target's per-position KL divergence (metrics.kld_histogram) with its mean, its 99th
    percentile and the gate's limit marked; None when the metrics carry no histogram."""
    from quantkit.eval.evaluate import KLD_EDGES

    counts = target.metrics.kld_histogram if target.metrics else None
    if not counts or not sum(counts):
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    total = sum(counts)
    figure = Figure(figsize=(7.0, 3.2), dpi=100)
    axes = figure.add_subplot()
    axes.bar(range(len(counts)), [c / total for c in counts], width=0.9, color="#4c78a8")
    axes.set_xticks([k + 0.5 for k in range(len(KLD_EDGES))], [f"{e:.0e}" for e in KLD_EDGES], rotation=45,
                    fontsize=7)  # the bin edges, between the bars
    axes.set_xlabel("KL divergence per position (base to quantized), nats")
    axes.set_ylabel("share of positions")
    m = target.metrics
    marks = [(m.kld_mean, f"mean {m.kld_mean:.2g}", "#e45756"), (m.kld_p99, f"p99 {m.kld_p99:.2g}", "#f58518")]
    limit = next((c.threshold for c in (target.gate.checks if target.gate else []) if c.name == "kld_mean"), None)
    if limit is not None:
        marks.append((limit, f"gate max_kld {limit:g}", "#54a24b"))
    for value, label, color in marks:
        axes.axvline(position(value, KLD_EDGES), color=color, linestyle="--", linewidth=1.2, label=label)
    axes.legend(fontsize=7, frameon=False)
    axes.set_title(f"{target.name} ({target.method}): {total} positions", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, format="png", metadata={"Software": None})
    return path
