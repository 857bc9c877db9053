"""A run of blocks one request cached together, as the pool's divergent-block index records
it: blocks `[start, end)` of the request's chain, each block's tokens and its L successor
tokens read from the request's (growing) token list, so noting a run copies nothing.

The index is keyed by a block's successor-free content, `(parent hash, its B tokens)` (b""
stands for the parent of a chain's first block): two blocks with the same key hold the same
target KV, whatever token follows them.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

# (parent hash or b"", the block's B tokens): what a block holds, its successors aside
ContentKey = tuple[bytes, tuple[int, ...]]
FIRST_PARENT = b""  # no chain hash is empty: the parent of a chain's first block


@dataclass(frozen=True)
class SuccessorRun:
    """Blocks `[start, end)` of one request's chain, cached together (divergent-block index)."""

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

    def first_entry(self) -> tuple[ContentKey, tuple[bytes, Any]]:
        """(content key, (hash, successors)) of the chain's first block (start must be 0)."""
        return ((FIRST_PARENT, tuple(self.token_ids[: self.block_size])),
                (self.block_hashes[0], self.successors(0)))

    def entries(self, start: int, end: int) -> Iterator[tuple[ContentKey, tuple[bytes, Any]]]:
        """(content key, (hash, successors)) of blocks [start, end), start >= 1 (one slice
        per block: faster here than B strided slices, for short runs and long ones)."""
        size, tokens, hashes = self.block_size, self.token_ids, self.block_hashes
        contents = [tuple(tokens[low : low + size])
                    for low in range(start * size, end * size, size)]
        return zip(zip(hashes[start - 1 : end - 1], contents),
                   zip(hashes[start:end], self.successor_slice(start, end)))
