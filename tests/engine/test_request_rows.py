"""RequestRows: the runner's per-row scalars, and the union of the held requests' stop
tokens kept as they come and go."""

from __future__ import annotations

from speckv.engine.messages import StopLimits
from speckv.engine.request_rows import RequestRows


def test_rows_hold_their_scalars_and_grow():
    rows = RequestRows(num_rows=2)
    rows.add(0, 5, 5, StopLimits(frozenset(), 10, 100), seeded=False)
    rows.add(7, 3, 2, StopLimits(frozenset(), 10, 8), seeded=True)  # past the rows: grows
    assert rows.num_tokens[[0, 7]].tolist() == [5, 3]
    # a length stop falls at min(prompt + max_tokens, max_model_len) real tokens
    assert rows.stop_len[[0, 7]].tolist() == [15, 8]
    assert rows.seeded[[0, 7]].tolist() == [False, True]


def test_stop_tokens_are_the_union_of_the_requests_held():
    rows = RequestRows()
    a, b = StopLimits(frozenset({2, 9}), 4, 50), StopLimits(frozenset({9, 11}), 4, 50)
    rows.add(0, 1, 1, a, seeded=False)
    rows.add(1, 1, 1, b, seeded=False)
    assert rows.stop_token_ids.tolist() == [2, 9, 11]
    rows.free(a)  # 9 still stops b
    assert rows.stop_token_ids.tolist() == [9, 11]
    rows.free(b)
    assert rows.stop_token_ids.tolist() == []
