"""The PNG charts the benches and the demo write, drawn one way: the workload in the title,
every bar labelled with its value, whole-number ticks on counts, a histogram's bins sized to
its data, and a reference line (an oracle) labelled on the line itself, so no legend covers it.

Owns `bar_pair_figure` (two bar panels side by side: hit rate with its oracle line, and a
latency or throughput), `ttft_histogram_figure`, and `save`. The figures are returned so tests
can read them; matplotlib runs headless (Agg)."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _title(fig: Any, title: str, workload: str) -> None:
    fig.suptitle(f"{title}\n" + textwrap.fill(workload, 110), fontsize=9)


@dataclass(frozen=True)
class BarPanel:
    values: Sequence[float]
    ylabel: str
    fmt: str  # of each bar's label, e.g. "{:.0f}%"
    color: str


def bar_pair_figure(names: Sequence[str], left: BarPanel, right: BarPanel, title: str,
                    workload: str, oracle: float | None = None,
                    oracle_label: str = "oracle") -> Any:
    """Two bar panels; `oracle` (in the left panel's unit) drawn as a dashed line labelled at
    its right end."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(9.5, 4.2))
    for axis, panel in zip(axes, (left, right)):
        bars = axis.bar(list(names), list(panel.values), color=panel.color)
        axis.bar_label(bars, labels=[panel.fmt.format(v) for v in panel.values], fontsize=8,
                       padding=2)
        axis.set_ylabel(panel.ylabel)
        axis.tick_params(axis="x", labelrotation=15, labelsize=8)
        top = max([*panel.values, oracle if axis is axes[0] and oracle is not None else 0.0])
        axis.set_ylim(0, (top or 1.0) * 1.2)  # room above the bars for their labels
    if oracle is not None:
        axes[0].axhline(oracle, linestyle="--", color="grey", linewidth=1)
        axes[0].annotate(f"{oracle_label} {left.fmt.format(oracle)}", xy=(1.0, oracle),
                         xycoords=("axes fraction", "data"), xytext=(-2, 3),
                         textcoords="offset points", ha="right", va="bottom", fontsize=8,
                         color="dimgrey")
    _title(fig, title, workload)
    fig.tight_layout()
    return fig


def histogram_bins(num_values: int) -> int:
    """Square-root rule, 5 to 40 bins: 8 requests get 5, not 40 mostly empty ones."""
    return max(5, min(40, math.ceil(math.sqrt(max(num_values, 1)))))


def ttft_histogram_figure(series: Sequence[tuple[str, Sequence[float], float | None]],
                          workload: str) -> Any:
    """One histogram per (name, TTFTs in ms, median ms), on shared bins; medians dashed."""
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    plt = _plt()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    every = [t for _, values, _ in series for t in values]
    longest = max(len(values) for _, values, _ in series) if series else 0
    bins = np.linspace(0, max(every) if every else 1.0, histogram_bins(longest) + 1)
    for name, values, median in series:
        if values:
            ax.hist(values, bins=bins, alpha=0.55, label=f"{name} (median {median or 0:.0f} ms)")
            ax.axvline(median or 0.0, linestyle="--", linewidth=1)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))  # a count of requests
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("requests")
    ax.legend(fontsize=8)
    _title(fig, "TTFT distribution (dashed: median)", workload)
    fig.tight_layout()
    return fig


def save(fig: Any, path: Path) -> None:
    fig.savefig(path, dpi=110)
    _plt().close(fig)
