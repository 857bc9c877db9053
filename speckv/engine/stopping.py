"""When a request stops on a token: the one rule the runner (and the toy runner) applies.

Owns `first_stop`: given the tokens sampled in one step (accepted drafts + bonus), where the
request ends and why. Stop strings are text and belong to the output processor.
"""

from __future__ import annotations

from collections.abc import Sequence

from speckv.engine.messages import FinishReason, StopLimits


def first_stop(
    sampled: Sequence[int], num_tokens: int, num_prompt_tokens: int, limits: StopLimits
) -> tuple[int, FinishReason | None]:
    """(tokens of `sampled` to keep, the reason they end the request or None). `num_tokens`:
    the request's real tokens before `sampled`. Pure."""
    num_output = num_tokens - num_prompt_tokens
    num_sampled = len(sampled)
    if (num_output + num_sampled < limits.max_tokens
            and num_tokens + num_sampled < limits.max_model_len
            and limits.stop_token_ids.isdisjoint(sampled)):
        return num_sampled, None  # no token stops it (the loop below would find none)
    for index, token in enumerate(sampled):
        if token in limits.stop_token_ids:
            return index + 1, FinishReason.STOP
        if (num_output + index + 1 >= limits.max_tokens
                or num_tokens + index + 1 >= limits.max_model_len):
            return index + 1, FinishReason.LENGTH
    return len(sampled), None
