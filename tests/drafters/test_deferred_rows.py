"""The lazy catch-up's row store: a request's deferred rows are appended in place, read back
exactly, survive the store's growth, and a slot is reused only after its release."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speckv.drafters.deferred_rows import DeferredRows, ranges


def _sources(num_rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, 4, generator=g), torch.randn(num_rows, 4, generator=g)


def test_ranges():
    assert ranges(np.array([5, 0, 9]), np.array([2, 0, 3])).tolist() == [5, 6, 9, 10, 11]


def test_rows_appended_over_steps_read_back_in_order_through_growth():
    store = DeferredRows(slot_rows=4)
    expected: dict[str, list[torch.Tensor]] = {}
    for step in range(3):  # 10 requests, one row each step: more than the first 8 slots
        hidden, aux = _sources(10, seed=step)
        ids = [f"r{i}" for i in range(10)]
        spans = [store.take(r) for r in ids]
        store.extend(ids, spans, np.full(10, 7 + step), np.full(10, 8 + step), (hidden, aux),
                     np.arange(10)[::-1].copy())
        for i, r in enumerate(ids):
            expected.setdefault(r, []).append(torch.stack([hidden[9 - i], aux[9 - i]]))
    for r, rows in expected.items():
        span = store.get(r)
        assert (span.start, span.end) == (7, 10)
        got_hidden, got_aux = store.rows(span)
        assert torch.equal(torch.stack([got_hidden, got_aux], dim=1), torch.stack(rows))
    spans = [store.get("r3"), store.get("r8")]
    gathered = store.gather(store.slot_rows_index(spans))
    assert torch.equal(gathered[0], torch.cat([store.rows(s)[0] for s in spans]))


def test_a_slot_is_reused_only_after_release():
    store = DeferredRows(slot_rows=2)
    hidden, aux = _sources(1, seed=0)
    store.extend(["a"], [None], np.array([0]), np.array([1]), (hidden, aux), np.array([0]))
    held = store.take("a")
    assert not store and held is not None
    store.extend(["b"], [None], np.array([0]), np.array([1]), (hidden + 1, aux), np.array([0]))
    assert store.get("b").slot != held.slot  # "a"'s rows are still being read
    assert torch.equal(store.rows(held)[0], hidden)
    store.release(held)
    store.extend(["c"], [None], np.array([0]), np.array([1]), (hidden, aux), np.array([0]))
    assert store.get("c").slot == held.slot
    store.drop("c")
    assert store.get("c") is None


def test_spans_longer_than_a_slot_or_not_continuing_are_refused():
    store = DeferredRows(slot_rows=2)
    hidden, aux = _sources(3, seed=1)
    with pytest.raises(ValueError, match="more than 2"):
        store.extend(["a"], [None], np.array([0]), np.array([3]), (hidden, aux), np.arange(3))
    store.extend(["a"], [None], np.array([0]), np.array([1]), (hidden, aux), np.arange(1))
    span = store.take("a")
    with pytest.raises(ValueError, match="where it ends"):
        store.extend(["a"], [span], np.array([2]), np.array([3]), (hidden, aux), np.arange(1))
