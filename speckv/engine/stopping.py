"""When a request stops on a token: the one rule the runner (and the toy runner) applies.

Owns `first_stop`: given the tokens sampled in one step (accepted drafts + bonus), where the
request ends and why; and `may_stop`, the batch's filter in front of it (which requests
`first_stop` could end: the others keep every token and go on). Stop strings are text and
belong to the output processor.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

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


def may_stop(tokens: np.ndarray, first_rows: np.ndarray, num_sampled: np.ndarray,
             num_tokens: np.ndarray, stop_lens: np.ndarray, stop_token_ids: np.ndarray
             ) -> np.ndarray:
    """[n] bool: where `first_stop` may end request i, whose sampled tokens are
    tokens[first_rows[i] : first_rows[i] + num_sampled[i]]: a length limit within them
    (`num_tokens` real tokens before, `stop_lens` the count a length stop falls at, as
    `RequestRows.stop_len`) or one of `stop_token_ids` (the union of the requests' stop
    tokens) among them. False: it certainly keeps them all and goes on. Pure."""
    stops = num_tokens + num_sampled >= stop_lens
    if stop_token_ids.shape[0]:
        hits = np.zeros(tokens.shape[0] + 1, dtype=np.int64)  # [rows + 1] stop tokens before
        np.cumsum(np.isin(tokens, stop_token_ids), out=hits[1:])
        stops |= hits[first_rows + num_sampled] > hits[first_rows]
    return stops
