"""Prompt-lookup (n-gram) decoding: drafts copied from earlier in the request's own tokens.

Owns `NgramProposer`. It keeps no state and writes no draft KV (L = 0), so it never changes
block hashes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from speckv.cache.drafter_policy import DrafterPolicy, drafter_policy
from speckv.speculation.proposer import ProposerInput, ProposeTiming


class NgramProposer:
    """Prompt-lookup decoding: find the last n tokens earlier in the request's history and
    propose what followed them (longest n first, most recent match). Writes no draft KV
    (L = 0)."""

    aux_layers: tuple[int, ...] = ()
    policy: DrafterPolicy = drafter_policy("ngram")
    kv_cache = None  # no draft KV

    def __init__(self, num_spec_tokens: int, min_n: int = 1, max_n: int = 3,
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.clock = clock  # times the lookups (the adaptive policy's clock)
        self.last_timing = ProposeTiming()
        if num_spec_tokens < 1 or min_n < 1 or max_n < min_n:
            raise ValueError("NgramProposer needs num_spec_tokens >= 1 and 1 <= min_n <= max_n")
        self.num_spec_tokens = num_spec_tokens
        self.min_n = min_n
        self.max_n = max_n

    def free(self, request_id: str) -> None:
        """Keeps nothing per request."""

    def bind_target_kv(self, kv_cache, layout) -> None:
        """Reads only the request's tokens, never the target's KV."""

    def propose(self, inputs: Sequence[ProposerInput]) -> dict[str, list[int]]:
        start = self.clock()
        drafts = {
            item.request_id: self.lookup(item.token_ids, min(item.max_drafts, self.num_spec_tokens))
            for item in inputs
            if item.wants_drafts and item.max_drafts > 0
        }
        self.last_timing = ProposeTiming(0.0, self.clock() - start)
        return drafts

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
