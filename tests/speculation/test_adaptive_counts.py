"""`AdaptiveSpeculation.observe_acceptance_counts` (the runner's batch as arrays) against
`observe_acceptance` (lists, a loop per request): the same belief and lifetime counts, to
the last bit, over random steps; and the same refusal of impossible counts."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speckv.speculation.adaptive import AdaptiveSpecConfig, AdaptiveSpeculation

# one request: (drafts verified, drafts accepted <= drafts), drafts possibly past max_spec
_request = st.integers(1, 5).flatmap(lambda d: st.tuples(st.just(d), st.integers(0, d)))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4), st.lists(st.lists(_request, max_size=12), min_size=1, max_size=8))
def test_counts_match_the_per_request_loop(max_spec, steps):
    lists = AdaptiveSpeculation(AdaptiveSpecConfig(max_spec, adaptive=False))
    arrays = AdaptiveSpeculation(AdaptiveSpecConfig(max_spec, adaptive=False))
    for step in steps:
        drafts = [d for d, _ in step]
        accepted = [a for _, a in step]
        lists.observe_acceptance(drafts, accepted)
        arrays.observe_acceptance_counts(np.array(drafts, dtype=np.int64),
                                         np.array(accepted, dtype=np.int64))
        assert arrays.acceptance() == lists.acceptance()  # exact: same float additions
        assert arrays.stats() == lists.stats()


@pytest.mark.parametrize("drafts,accepted", [([2], [3]), ([2, 1], [0, -1])])
def test_impossible_counts_are_refused_unchanged(drafts, accepted):
    policy = AdaptiveSpeculation(AdaptiveSpecConfig(3))
    policy.observe_acceptance_counts(np.array([3]), np.array([1]))
    before = policy.acceptance()
    with pytest.raises(ValueError, match="accepted"):
        policy.observe_acceptance_counts(np.array(drafts), np.array(accepted))
    assert policy.acceptance() == before


def test_a_large_batch_rounds_as_the_loop_does():
    """One request, then 32 in a step: adding their count at once would give 0.98 + 32 =
    32.98, adding 1.0 per request gives 32.980000000000004; the belief must not drift."""
    lists = AdaptiveSpeculation(AdaptiveSpecConfig(1, adaptive=False))
    arrays = AdaptiveSpeculation(AdaptiveSpecConfig(1, adaptive=False))
    for n in (1, 32):
        lists.observe_acceptance([1] * n, [0] * n)
        arrays.observe_acceptance_counts(np.ones(n, dtype=np.int64),
                                         np.zeros(n, dtype=np.int64))
    assert arrays.acceptance() == lists.acceptance()
