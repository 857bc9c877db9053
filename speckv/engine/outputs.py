"""RequestOutput: what the engine hands back for one request (a streaming delta or the end).

Owns the typed result: token ids and text (whole output so far plus this step's delta),
cached prompt tokens, time to first token and the finish reason ("stop", "length", "abort",
"error" with `error` set, or None while running).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far
    text: str  # all output text so far ("" without a tokenizer)
    delta_token_ids: list[int]  # output tokens new in this step
    delta_text: str
    num_cached_tokens: int  # prompt tokens served by the prefix cache, tokens
    ttft_s: float | None  # seconds from add_request to the first output token
    finish_reason: str | None  # None while running
    num_preemptions: int = 0
    num_draft_tokens: int = 0  # drafts scheduled for verification, tokens
    num_accepted_tokens: int = 0  # drafts accepted, tokens
    error: str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
