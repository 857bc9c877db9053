"""The timing both per-machine form choices share (`speckv.models.common.form_timing`)."""

from __future__ import annotations

import torch

from speckv.models.common.form_timing import streamed_weights, time_two_forms


def test_a_pass_streams_the_first_weights_up_to_the_byte_budget():
    weights = [torch.zeros(256, 256) for _ in range(4)]  # 256 KiB each (fp32)
    assert streamed_weights(weights, 256 << 10) == weights[:1]
    assert streamed_weights(weights, (256 << 10) + 1) == weights[:2]  # the last may run past
    assert streamed_weights(weights, 0) == []
    assert streamed_weights(weights, 1 << 30) == weights


def test_two_forms_are_interleaved_over_every_weight_and_timed_apart():
    weights = [torch.randn(8, 4), torch.randn(3, 8)]
    now = [0.0]
    calls: list[tuple[str, int, tuple[int, ...]]] = []

    def form(name: str, cost_s: float):
        def run(index: int, x: torch.Tensor) -> object:
            calls.append((name, index, tuple(x.shape)))
            now[0] += cost_s  # the clock below reads what the forms spent
            return x @ weights[index].t()
        return run

    timings = time_two_forms(weights, rows=(2, 5), num_reps=3, clock=lambda: now[0],
                             forms=(form("a", 1.0), form("b", 0.25)))
    assert timings == {2: (2.0, 0.5), 5: (2.0, 0.5)}  # 2 weights a pass, whatever the rows
    # per row count: a warm-up pass of each, then 3 rounds of a, b: every pass reads each
    # weight once, with an input of that row count and the weight's input width
    one_round = [("a", 0, (2, 4)), ("a", 1, (2, 8)), ("b", 0, (2, 4)), ("b", 1, (2, 8))]
    assert calls[:16] == one_round * 4
    assert [c[2][0] for c in calls[16:]] == [5] * 16
