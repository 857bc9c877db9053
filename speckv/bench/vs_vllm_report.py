"""The numbers of `speckv bench vs-vllm`: one run's measurements, paired ratios, table, JSON, PNG.

Owns `RunPoint` (one workload sent once to one server: output tokens/s, TTFT / TPOT median and
p99, prefix-cache hit rate and acceptance from the server's `/metrics`), the aggregation of
several rounds into one `Row` per (speculative method, workload) with the speckv / vLLM ratio
of each round (the two servers ran turn about within a round, so a round's ratio shares that
moment's machine load) as median and range, each server's speed-up from speculation over its
own no-speculation run, and the renderings. Pure: no servers, no vLLM; tested on its own.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

SERVERS = ("speckv", "vllm")


@dataclass(frozen=True)
class RunPoint:
    """One workload sent once to one server."""

    method: str  # speculative method: none, eagle3
    workload: str
    server: str  # speckv or vllm
    round: int
    output_tok_s: float
    ttft_median_ms: float | None
    ttft_p99_ms: float | None
    tpot_median_ms: float | None
    tpot_p99_ms: float | None
    hit_rate: float | None  # prefix-cache hits / queries, /metrics deltas
    acceptance_length: float | None  # 1 + accepted / verification steps with drafts
    num_failed: int = 0


@dataclass(frozen=True)
class Spread:
    """A paired ratio over rounds: median and range (count: rounds with both servers)."""

    median: float
    low: float
    high: float
    count: int

    def text(self) -> str:
        if self.count == 1:
            return f"{self.median:.2f}x"
        return f"{self.median:.2f}x ({self.low:.2f}-{self.high:.2f})"


@dataclass(frozen=True)
class Row:
    """One (method, workload): each server's medians over rounds and the paired ratios."""

    method: str
    workload: str
    median: dict[str, dict[str, float | None]]  # server -> field -> median over rounds
    throughput_ratio: Spread | None  # speckv / vLLM output tokens/s (higher: speckv faster)
    ttft_ratio: Spread | None  # speckv / vLLM median TTFT (lower: speckv faster)
    tpot_ratio: Spread | None  # speckv / vLLM median TPOT (lower: speckv faster)


_FIELDS = ("output_tok_s", "ttft_median_ms", "ttft_p99_ms", "tpot_median_ms", "tpot_p99_ms",
           "hit_rate", "acceptance_length")


def spread(values: Sequence[float]) -> Spread | None:
    if not values:
        return None
    return Spread(statistics.median(values), min(values), max(values), len(values))


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _paired(points: Sequence[RunPoint], field: str) -> list[float]:
    """speckv / vLLM of `field`, per round where both servers measured it."""
    by_round: dict[int, dict[str, float]] = {}
    for point in points:
        value = getattr(point, field)
        if value is not None and point.num_failed == 0:
            by_round.setdefault(point.round, {})[point.server] = value
    return [pair["speckv"] / pair["vllm"] for _, pair in sorted(by_round.items())
            if len(pair) == 2 and pair["vllm"] > 0]


def aggregate(points: Sequence[RunPoint]) -> list[Row]:
    """One row per (method, workload), in the order first measured."""
    keys = list(dict.fromkeys((p.method, p.workload) for p in points))
    rows = []
    for method, workload in keys:
        mine = [p for p in points if (p.method, p.workload) == (method, workload)]
        # a run with failed requests counts nowhere (its rates are not the server's)
        median = {server: {field: _median([getattr(p, field) for p in mine
                                           if p.server == server and p.num_failed == 0])
                           for field in _FIELDS}
                  for server in SERVERS if any(p.server == server for p in mine)}
        rows.append(Row(method, workload, median,
                        spread(_paired(mine, "output_tok_s")),
                        spread(_paired(mine, "ttft_median_ms")),
                        spread(_paired(mine, "tpot_median_ms"))))
    return rows


def speculation_speedups(points: Sequence[RunPoint], method: str = "eagle3"
                         ) -> dict[str, dict[str, Spread]]:
    """workload -> server -> output tokens/s with `method` over without, paired by round."""
    out: dict[str, dict[str, Spread]] = {}
    for workload in dict.fromkeys(p.workload for p in points):
        for server in SERVERS:
            by_round: dict[int, dict[str, float]] = {}
            for p in points:
                if p.workload == workload and p.server == server and p.num_failed == 0:
                    by_round.setdefault(p.round, {})[p.method] = p.output_tok_s
            ratios = [pair[method] / pair["none"] for pair in by_round.values()
                      if method in pair and pair.get("none")]
            if ratios:
                out.setdefault(workload, {})[server] = spread(ratios)  # type: ignore[assignment]
    return out


def payload(points: Sequence[RunPoint], context: dict[str, Any]) -> dict[str, Any]:
    """The JSON document: context (machine, load, versions, commands), rows, every run."""
    rows = aggregate(points)
    return {**context,
            "rows": [asdict(row) for row in rows],
            "speculation_speedup": {w: {s: asdict(v) for s, v in by.items()}
                                    for w, by in speculation_speedups(points).items()},
            "runs": [asdict(p) for p in points]}


def _num(value: float | None, fmt: str) -> str:
    if value is None:
        return "-"
    return f"{100 * value:.0f}%" if fmt == "%" else format(value, fmt)


def _pair(row: Row, field: str, fmt: str) -> str:
    return " / ".join(_num(row.median.get(s, {}).get(field), fmt) for s in SERVERS)


TABLE_COLUMNS = ("method", "workload", "out tok/s speckv / vLLM", "speckv/vLLM tok/s",
                 "TTFT med ms", "TTFT p99 ms", "TPOT med ms", "TPOT p99 ms", "TTFT ratio",
                 "TPOT ratio", "hit rate", "accept len")


def table_rows(rows: Sequence[Row]) -> list[list[str]]:
    """The table's cells, one list per row, in `TABLE_COLUMNS` order (pairs: speckv / vLLM)."""
    out = []
    for row in rows:
        out.append([row.method, row.workload, _pair(row, "output_tok_s", ".1f"),
                    row.throughput_ratio.text() if row.throughput_ratio else "-",
                    _pair(row, "ttft_median_ms", ".0f"), _pair(row, "ttft_p99_ms", ".0f"),
                    _pair(row, "tpot_median_ms", ".1f"), _pair(row, "tpot_p99_ms", ".1f"),
                    row.ttft_ratio.text() if row.ttft_ratio else "-",
                    row.tpot_ratio.text() if row.tpot_ratio else "-",
                    _pair(row, "hit_rate", "%"), _pair(row, "acceptance_length", ".2f")])
    return out


def write_png(rows: Sequence[Row], path: Path) -> None:
    """Bars: speckv / vLLM output tokens/s per (method, workload), range as error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in rows if r.throughput_ratio is not None]
    fig, ax = plt.subplots(figsize=(max(5.0, 1.1 * len(shown) + 2), 3.8))
    labels = [f"{r.workload}\n{r.method}" for r in shown]
    medians = [r.throughput_ratio.median for r in shown]  # type: ignore[union-attr]
    errors = [[m - r.throughput_ratio.low for m, r in zip(medians, shown)],  # type: ignore
              [r.throughput_ratio.high - m for m, r in zip(medians, shown)]]  # type: ignore
    colors = ["tab:green" if m >= 1.0 else "tab:red" for m in medians]
    ax.bar(range(len(shown)), medians, yerr=errors, color=colors, capsize=4)
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--")
    ax.set_xticks(range(len(shown)), labels)
    ax.set_ylabel("speckv / vLLM output tokens/s")
    ax.set_title("speckv serve vs vLLM CPU (median of rounds, bars: range)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
