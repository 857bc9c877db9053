"""The few-row CPU matmul form: measured on a model's weights, set on its `Linear` modules,
taken by its drafter; either form computes the same product (to fp32 rounding)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from speckv.models.common import small_rows
from speckv.models.common.layers import Linear
from speckv.models.common.small_rows import (
    FormTimings,
    choose_transposed_rows,
    measure_small_row_form,
    set_small_row_form,
    small_row_form_of,
    use_fastest_small_row_form,
)


def test_a_clear_measurement_decides_and_an_unclear_one_keeps_the_cpus_default():
    timings = [FormTimings(2, 0.100, 0.080),  # W @ x^T clearly faster
               FormTimings(3, 0.100, 0.105),  # within the margin: noise
               FormTimings(4, 0.100, 0.130)]  # clearly slower
    assert choose_transposed_rows(timings, default=frozenset()) == {2}
    assert choose_transposed_rows(timings, default=frozenset({2, 3, 4})) == {2, 3}
    assert choose_transposed_rows(timings, frozenset(), margin=0.0) == {2}
    with pytest.raises(ValueError):
        FormTimings(2, -1.0, 0.1)


@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("bias", [False, True])
def test_both_forms_compute_the_same_product(num_rows, bias):
    gen = torch.Generator().manual_seed(num_rows)
    layer = Linear(96, 160, bias=bias)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(160, 96, generator=gen))
        if bias:
            layer.bias.copy_(torch.randn(160, generator=gen))
    x = torch.randn(num_rows, 96, generator=gen)
    plain = layer(x)
    set_small_row_form(layer, frozenset({num_rows}))
    transposed = layer(x)
    assert transposed.is_contiguous() and transposed.shape == (num_rows, 160)
    # fp32 sums of 96 products of N(0, 1) terms, accumulated in another order: ~1e-6 relative
    torch.testing.assert_close(transposed, plain, rtol=1e-5, atol=1e-4)


def test_a_model_that_fits_in_the_cache_keeps_the_plain_form(monkeypatch):
    def no_timing(*args, **kwargs):
        raise AssertionError("a cache-resident model must not be timed")

    monkeypatch.setattr(small_rows, "time_forms", no_timing)
    model = nn.Sequential(Linear(64, 64), nn.ReLU(), Linear(64, 64))
    assert use_fastest_small_row_form(model) == frozenset()
    assert small_row_form_of(model) == frozenset()


def test_a_model_is_measured_once_per_architecture_and_every_linear_takes_the_choice(
        monkeypatch):
    calls = []

    def timed(weights, *args, **kwargs):
        calls.append(sum(w.numel() * w.element_size() for w in weights))
        return [FormTimings(2, 1.0, 0.5), FormTimings(3, 1.0, 1.0), FormTimings(4, 1.0, 1.5)]

    monkeypatch.setattr(small_rows, "time_forms", timed)
    # 2 rows: a clear win; 3: unclear, the default's; 4: a clear loss, whatever the default
    monkeypatch.setattr(small_rows, "DEFAULT_TRANSPOSED_ROWS",
                        {torch.backends.cpu.get_cpu_capability(): frozenset({3, 4})})
    monkeypatch.setattr(small_rows, "_CHOSEN", {})
    monkeypatch.setattr(small_rows, "STREAMED_BYTES", 1 << 20)

    def build():  # 4 x 1 MiB of weights: the first one is streamed
        return nn.Sequential(*(Linear(512, 512, bias=False) for _ in range(4)))

    first, second = build(), build()
    assert use_fastest_small_row_form(first) == {2, 3}
    assert all(m.transposed_rows == {2, 3} for m in first if isinstance(m, Linear))
    assert use_fastest_small_row_form(second) == {2, 3}
    assert calls == [1 << 20]  # once, and only STREAMED_BYTES of weights
    wider = nn.Sequential(*(Linear(1024, 512, bias=False) for _ in range(2)))
    measure_small_row_form(wider)
    assert len(calls) == 2  # another architecture: measured again


def test_time_forms_times_each_requested_row_count_in_both_forms():
    weights = [torch.randn(64, 32), torch.randn(16, 64)]
    timings = small_rows.time_forms(weights, rows=(2, 3), num_reps=1)
    assert [t.num_rows for t in timings] == [2, 3]
    assert all(t.linear_s >= 0 and t.transposed_s >= 0 for t in timings)
