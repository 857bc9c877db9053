"""RequestOutput: what the engine hands back for one request (a streaming delta or the end).

Owns the typed result: token ids and text (whole output so far plus this step's delta),
cached prompt tokens (the local prefix cache's and a KV tier's, reported apart), time to first
token and the finish reason ("stop", "length", "abort", "error" for a prompt `LLM` could not
add or a request that no longer fits the KV cache, or None while running; `error` says why with
"error"), and `acceptance_stats`, the drafts' acceptance over a set of outputs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    text: str  # all output text so far ("" without a tokenizer)
    delta_token_ids: list[int]  # output tokens new in this step
    delta_text: str
    # prompt tokens served by a cache: the local prefix cache and a KV connector's tiers
    num_cached_tokens: int
    ttft_s: float | None  # seconds from add_request to the first output token
    finish_reason: str | None  # None while running
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # drafts scheduled for verification, tokens
    num_accepted_tokens: int = 0  # drafts accepted, tokens
    error: str | None = None
    num_external_cached_tokens: int = 0  # of num_cached_tokens, loaded from a KV tier
    # per draft position j (index j - 1): steps that verified a draft there, and of them the
    # steps that accepted it (a draft after a rejected one counts as rejected)
    num_drafts_by_position: tuple[int, ...] = ()
    num_accepted_by_position: tuple[int, ...] = ()
    # with the final output: what the KV connector returned for the caller (vLLM's field of
    # that name, e.g. where a decode engine finds this request's prefilled blocks)
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def num_local_cached_tokens(self) -> int:
        """Of num_cached_tokens, those the local prefix cache served."""
        return self.num_cached_tokens - self.num_external_cached_tokens

    @property
    def acceptance_by_position(self) -> tuple[float, ...]:
        """Share of the drafts at each position that were accepted."""
        return tuple(a / d if d else 0.0
                     for a, d in zip(self.num_accepted_by_position, self.num_drafts_by_position))

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def acceptance_stats(
    outputs: Iterable[RequestOutput], num_spec_tokens: int
) -> tuple[float, float] | None:
    """(acceptance rate, mean acceptance length) of the drafts in `outputs`; None: no drafts.

    Rate = accepted / drafted tokens. Mean acceptance length = tokens per verification step
    that had drafts = 1 + accepted / steps, with steps estimated as drafted / num_spec_tokens
    (exact when every such step drafted `num_spec_tokens`)."""
    num_drafts = num_accepted = 0
    for output in outputs:
        num_drafts += output.num_draft_tokens
        num_accepted += output.num_accepted_tokens
    if not num_drafts:
        return None
    return num_accepted / num_drafts, 1 + num_accepted / (num_drafts / num_spec_tokens)
