"""The speculative-decoding seam: what a drafter gets after verification, and what it returns.

Owns the `Proposer` protocol and `NgramProposer` (prompt-lookup decoding). EAGLE / EAGLE3 /
MTP drafters reach the engine through the same protocol (`DrafterProposer` in
`speckv.drafters.proposer`); the engine calls `propose` once per step AFTER the sampled tokens
are appended and BEFORE any finished request is freed, so a drafter writes its draft KV for
every position made final this step (finishing requests included) before the block that
position completes can be cached (SPEC §5: draft KV first, then the hash is used).

For position p of a request, the drafter reads the target's hidden state at p and the real
token at p + 1 (`token_ids[p + 1]`, i.e. the token after it; module j of a k-module MTP reads
`token_ids[p + j]`). A drafter keeps its own `PagedKVCache` with the same `num_blocks` and
`block_size` as the target's, so the same block table and slot mapping address it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from speckv.spec.policy import DrafterPolicy, NgramPolicy


@dataclass(frozen=True)
class ProposerInput:
    """One request's positions made final this step (target KV written, token after known)."""

    request_id: str
    token_ids: Sequence[int]  # all real tokens of the request (prompt + output), after this step
    start: int  # first final position of this step
    end: int  # one past the last final position (= num_computed_tokens after verification)
    # Target hidden states at positions [start, end), each [end - start, hidden]:
    hidden_states: torch.Tensor  # after the final norm (LM-head input)
    prenorm_hidden: torch.Tensor  # last decoder layer output, before the final norm
    aux_hidden_states: tuple[torch.Tensor, ...]  # per requested aux layer (see ModelOutput)
    block_table: Sequence[int]  # physical block ids (group 0), shared with the drafter's cache
    slot_mapping: torch.Tensor  # [end - start] int64 physical slots of positions [start, end)
    wants_drafts: bool  # False: finishing (write draft KV only) or still prefilling
    max_drafts: int  # drafts allowed for this request next step (<= num_spec_tokens)


class Proposer(Protocol):
    num_spec_tokens: int
    policy: DrafterPolicy  # decides lookahead hashes vs the legacy drop (speckv.spec.policy)
    # Target layers whose outputs the drafter reads (EAGLE3); () for none.
    aux_layers: tuple[int, ...]

    def propose(self, inputs: Sequence[ProposerInput]) -> dict[str, list[int]]:
        """Write draft KV for the final positions; return drafts (<= max_drafts) per request
        id for the requests with `wants_drafts`."""
        ...

    def free(self, request_id: str) -> None:
        """Forget a finished / aborted request's per-request state."""
        ...


class NgramProposer:
    """Prompt-lookup decoding: find the last n tokens earlier in the request's history and
    propose what followed them (longest n first, most recent match). Writes no draft KV
    (L = 0)."""

    aux_layers: tuple[int, ...] = ()
    policy: DrafterPolicy = NgramPolicy()

    def __init__(self, num_spec_tokens: int, min_n: int = 1, max_n: int = 3) -> None:
        if num_spec_tokens < 1 or min_n < 1 or max_n < min_n:
            raise ValueError("NgramProposer needs num_spec_tokens >= 1 and 1 <= min_n <= max_n")
        self.num_spec_tokens = num_spec_tokens
        self.min_n = min_n
        self.max_n = max_n

    def free(self, request_id: str) -> None:
        """Keeps nothing per request."""

    def propose(self, inputs: Sequence[ProposerInput]) -> dict[str, list[int]]:
        return {
            item.request_id: self.lookup(item.token_ids, min(item.max_drafts, self.num_spec_tokens))
            for item in inputs
            if item.wants_drafts and item.max_drafts > 0
        }

    def lookup(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest
        suffix of `tokens` (length min_n..max_n). Pure."""
        n_tokens = len(tokens)
        for n in range(min(self.max_n, n_tokens - 1), self.min_n - 1, -1):
            suffix = list(tokens[n_tokens - n :])
            # most recent match that ends before the suffix itself
            for start in range(n_tokens - n - 1, -1, -1):
                if tokens[start] == suffix[0] and list(tokens[start : start + n]) == suffix:
                    follow = list(tokens[start + n : start + n + k])
                    if follow:
                        return follow
        return []
