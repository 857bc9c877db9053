"""The charts say what they show: the workload in the title, each bar's value on it, whole
request counts on a histogram's axis with bins sized to the data, and an oracle line labelled
on the line (no legend over it). Drawn from given numbers; the PNGs are written and read
back."""

from __future__ import annotations

import matplotlib.image

from speckv.measure.charts import BarPanel, bar_pair_figure, save, ttft_histogram_figure

WORKLOAD = "prefix_repetition: 8 prompts, 2 prefixes of 40 + 8-token suffixes"


def test_ttft_histogram_of_8_requests(tmp_path):
    ttfts = [12.0, 15.5, 14.0, 30.0, 31.0, 13.0, 45.0, 16.0]
    fig = ttft_histogram_figure([("server", ttfts, 15.75)], WORKLOAD)
    ax = fig.axes[0]
    assert len(ax.patches) == 5  # bins: the square-root rule, not 40 for 8 requests
    assert sum(patch.get_height() for patch in ax.patches) == len(ttfts)
    ticks = [t for t in ax.get_yticks() if 0 <= t <= ax.get_ylim()[1]]
    assert ticks and all(float(t).is_integer() for t in ticks)  # whole requests
    assert WORKLOAD in fig._suptitle.get_text().replace("\n", " ")
    save(fig, tmp_path / "ttft.png")
    assert matplotlib.image.imread(tmp_path / "ttft.png").shape[0] > 300


def test_bar_charts_label_values_and_the_oracle_line(tmp_path):
    names = ["kv", "round-robin", "random"]
    fig = bar_pair_figure(names, BarPanel([61.2, 20.4, 33.3], "hit rate (%)", "{:.0f}%", "b"),
                          BarPanel([120.0, 340.5, 250.0], "median TTFT (ms)", "{:.0f}", "r"),
                          "speckv bench route", WORKLOAD, 62.0, "unbounded-cache oracle")
    hits, ttft = fig.axes
    assert [t.get_text() for t in hits.texts if t.get_text().endswith("%")][:3] == \
        ["61%", "20%", "33%"]
    assert [t.get_text() for t in ttft.texts] == ["120", "340", "250"]
    assert hits.get_legend() is None  # nothing covers the oracle line
    oracle = [t for t in hits.texts if "oracle" in t.get_text()]
    assert len(oracle) == 1 and oracle[0].get_text() == "unbounded-cache oracle 62%"
    assert hits.get_ylim()[1] > 62.0 * 1.1  # the line and its label fit under the top
    assert "speckv bench route" in fig._suptitle.get_text() and "2 prefixes" in \
        fig._suptitle.get_text()
    save(fig, tmp_path / "route.png")
    assert (tmp_path / "route.png").stat().st_size > 1000
