"""The demo's tables fit an 80-column terminal (or a pipe) without cutting a column."""

from __future__ import annotations

from rich.console import Console

from speckv.bench import hash_cost
from speckv.bench.hash_cost import DEMO, METHODS, Case, Row
from speckv.commands import demo


def test_hashing_table_fits_80_columns(monkeypatch):
    def fake_measure(plan):
        assert plan is DEMO
        return [Row(Case("text", 32 * 1024 + 1, b), {m: 1.234 + i for i, m in enumerate(METHODS)})
                for b in (16, 1024)]

    monkeypatch.setattr(hash_cost, "measure", fake_measure)
    console = Console(width=80, record=True, force_terminal=False)
    demo._hashing_cost(console)
    text = console.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    for needed in ("adopted (lookahead L=1)", "naive adopted", "B=16", "B=1024", "(+", "x)"):
        assert needed in text
