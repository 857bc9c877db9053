"""`speckv bench hash` on a tiny plan: the guard passes and every cell is reported."""

from __future__ import annotations

import argparse
import json

from rich.console import Console

from speckv.bench import hash_cost
from speckv.measure import hash_cost as hash_inputs

TINY = hash_cost.Plan((2 * 1024 + 1,), (16, 128), ("text", "mm"), 2, 1, "tiny")


def test_measure_tiny_plan_and_render() -> None:
    rows = hash_cost.measure(TINY)
    assert [(row.case.input_kind, row.case.block_size) for row in rows] == [
        ("text", 16), ("text", 128), ("mm", 16), ("mm", 128)]
    for row in rows:
        assert set(row.ms) == set(hash_cost.METHODS) and all(v > 0 for v in row.ms.values())
        cell = row.to_json()
        assert cell["pct_vs_legacy"]["legacy"] == 0.0
        json.dumps(cell)
    console = Console(width=100, record=True)
    console.print(hash_cost.render_table(rows, "t"))
    text = console.export_text()
    assert "2K+1" in text and "naive" in text
    assert max(len(line) for line in text.splitlines()) <= 100


def test_mm_inputs_every_1024_tokens() -> None:
    inputs = hash_inputs.make_inputs("mm", 4097)
    assert [item.offset for item in inputs.mm_items] == [0, 1024, 2048, 3072]
    assert all(item.length == 512 for item in inputs.mm_items)


def test_arguments() -> None:
    parser = argparse.ArgumentParser()
    hash_cost.add_arguments(parser)
    args = parser.parse_args(["--quick", "--json"])
    assert args.quick and args.json
