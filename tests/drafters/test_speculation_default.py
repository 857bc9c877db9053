"""Speculation is on by default only where the held-out figure reaches 1.1x, and the banner
quotes that figure with the prompt set it was measured on."""

from __future__ import annotations

import pytest

from speckv.drafters import builtin
from speckv.drafters.builtin import MeasuredSpeedup, speculation_default
from speckv.engine.speculation_choice import choose_speculation

COMMAND = "speckv bench spec-decode"


def _measured(at_1: float, prompt_set: str | None = "heldout-v1") -> MeasuredSpeedup:
    return MeasuredSpeedup({1: at_1, 8: 1.0}, 1.62, 3, COMMAND, prompt_set)


@pytest.mark.parametrize(("measured", "on", "words"), [
    (None, False, ["no benchmark recorded"]),
    (_measured(1.45, None), False, ["1.45x", "not measured on held-out prompts"]),
    (_measured(1.05), False, ["1.05x", "heldout-v1", "below the 1.1x", COMMAND]),
    (_measured(1.1), True, ["1.10x", "heldout-v1", "1.62"]),
])
def test_the_default_follows_the_held_out_figure(measured, on, words):
    default = speculation_default(measured)
    assert default.on is on
    for word in words:
        assert word in default.reason


@pytest.mark.parametrize(("at_1", "method"), [(1.04, None), (1.3, "eagle3")])
def test_generate_and_serve_say_what_was_measured(monkeypatch, at_1, method):
    monkeypatch.setattr(builtin, "measured_speedup", lambda: _measured(at_1))
    choice = choose_speculation("builtin", None, None, 3)
    assert choice.method == method
    assert f"{at_1:.2f}x decode tokens/s at batch 1 on the held-out prompt set heldout-v1" \
        in choice.summary
    # asking for the head explicitly runs it whatever was measured
    assert choose_speculation("builtin", "eagle3", None, 3).method == "eagle3"
