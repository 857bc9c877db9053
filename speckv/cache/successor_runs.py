"""A run of blocks one request cached together, as the pool's successor index records it:
blocks `[start, end)` of the request's chain, and each block's L successor tokens read
from the request's (growing) token list, so noting a run copies nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class SuccessorRun:
    """Blocks `[start, end)` of one request's chain, cached together (successor index)."""

    group_id: int
    block_size: int
    lookahead_tokens: int
    token_ids: Sequence[int]  # the request's real tokens (they only grow)
    block_hashes: Sequence[bytes]  # the request's chain for this group (it only grows)
    start: int
    end: int

    def successors(self, index: int) -> Any:
        """Block `index`'s L successor tokens: an int for L = 1, else a tuple."""
        first = (index + 1) * self.block_size
        if self.lookahead_tokens == 1:
            return self.token_ids[first]
        return tuple(self.token_ids[first : first + self.lookahead_tokens])

    def successor_slice(self, start: int, end: int) -> Sequence[Any]:
        """`successors(i)` for i in [start, end), by C-level strided slices."""
        size, lookahead, tokens = self.block_size, self.lookahead_tokens, self.token_ids
        first, stop = (start + 1) * size, end * size + 1
        if lookahead == 1:
            return tokens[first:stop:size]
        return list(zip(*(tokens[first + m : stop + m : size] for m in range(lookahead))))
