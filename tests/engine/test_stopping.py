"""The stop rule the runner applies: where a step's sampled tokens end."""

from __future__ import annotations

from speckv.engine.messages import FinishReason, StopLimits
from speckv.engine.stopping import first_stop

LIMITS = StopLimits(stop_token_ids=frozenset({0}), max_tokens=4, max_model_len=100)


def test_nothing_stops_keeps_everything():
    assert first_stop([5, 6], num_tokens=3, num_prompt_tokens=3, limits=LIMITS) == (2, None)


def test_a_stop_token_ends_the_request_and_is_kept():
    assert first_stop([5, 0, 7], 3, 3, LIMITS) == (2, FinishReason.STOP)


def test_max_tokens_cuts_accepted_drafts():
    # one output token already: three more reach max_tokens=4
    assert first_stop([5, 6, 7, 8], 4, 3, LIMITS) == (3, FinishReason.LENGTH)


def test_max_model_len_counts_prompt_and_output():
    limits = StopLimits(frozenset(), max_tokens=50, max_model_len=10)
    assert first_stop([1, 2, 3], 8, 3, limits) == (2, FinishReason.LENGTH)


def test_the_first_reason_wins():
    # the stop token is also the token that reaches max_tokens: it stops ("stop")
    assert first_stop([0], 6, 3, LIMITS) == (1, FinishReason.STOP)
