"""The step's verifications recorded at once (`record_verifications`, what the scheduler calls)
add up to the same statistics as recording them one request at a time."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from speckv.engine.stats import StatsCollector

VERIFICATION = st.integers(1, 6).flatmap(lambda d: st.tuples(st.just(d), st.integers(0, d)))


@given(st.integers(0, 5), st.lists(st.lists(VERIFICATION, max_size=8), max_size=4))
def test_at_once_equals_one_by_one(num_spec_tokens, steps):
    one, batch = StatsCollector(num_spec_tokens), StatsCollector(num_spec_tokens)
    for step in steps:
        for d, a in step:
            one.record_verification(d, a)
        if step:
            batch.record_verifications([d for d, _ in step], [a for _, a in step])
        assert one.take(1, 0, 3, 9) == batch.take(1, 0, 3, 9)


def test_bad_counts_are_refused():
    collector = StatsCollector(3)
    with pytest.raises(ValueError, match="accepted"):
        collector.record_verifications([2], [3])
    with pytest.raises(ValueError, match="one entry per request"):
        collector.record_verifications([2, 1], [1])
