"""SymbolicKV: a stand-in for the paged KV tensors that records what each slot was computed from.

Owns the facts a cold run writes (`expected_at`) and the check a hit is held to (`mismatch`,
`HitMismatch`); `ToyRunner` writes and checks through it, `PagedSymbolicKV` (paged_kv.py)
keeps the same facts in real paged tensors for the KV connectors.
"""

from __future__ import annotations

from collections.abc import Sequence


class HitMismatch(AssertionError):
    """A prefix-cache hit served KV that a cold run would not have written."""


class SymbolicKV:
    """A stand-in for the paged KV tensors that records what each slot was computed from.

    target[slot] = the token at that position; draft[slot] = the tokens after it that the
    drafter's KV at that position was computed from (k of them for k-module MTP). A cache hit
    is correct exactly when every hit slot holds what a cold run of the hitting request would
    write: `expected_at(tokens, position)`.
    """

    def __init__(self, num_blocks: int, block_size: int, draft_depth: int) -> None:
        self.block_size = block_size
        self.draft_depth = draft_depth
        self.target: list[int | None] = [None] * (num_blocks * block_size)
        self.draft: list[tuple[int, ...] | None] = [None] * (num_blocks * block_size)

    def slot(self, block_ids: Sequence[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + (
            position % self.block_size
        )

    def write(self, block_ids: Sequence[int], sequence: Sequence[int], start: int,
              end: int, draft_start: int) -> None:
        """Compute positions [start, end) over `sequence` (real tokens + drafts): target KV
        there, draft KV at [draft_start, end) from the tokens after each position."""
        for position in range(start, end):
            self.target[self.slot(block_ids, position)] = sequence[position]
        for position in range(draft_start, end):
            self.draft[self.slot(block_ids, position)] = tuple(
                sequence[position + 1 : position + 1 + self.draft_depth]
            )

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Each (source, destination) block's facts into the destination, all sources read
        first (as the runner's batched copy does)."""
        size = self.block_size
        rows = [(self.target[src * size:(src + 1) * size], self.draft[src * size:(src + 1) * size])
                for src, _ in copies]
        for (_, dst), (target, draft) in zip(copies, rows):
            self.target[dst * size:(dst + 1) * size] = target
            self.draft[dst * size:(dst + 1) * size] = draft

    def expected_at(self, tokens: Sequence[int], position: int) -> tuple[int, tuple[int, ...]]:
        return tokens[position], tuple(tokens[position + 1 : position + 1 + self.draft_depth])

    def read(self, block_ids: Sequence[int], position: int) -> tuple[object, object]:
        slot = self.slot(block_ids, position)
        return self.target[slot], self.draft[slot]

    def mismatch(self, block_ids: Sequence[int], tokens: Sequence[int], num_positions: int,
                 num_draft_positions: int) -> str | None:
        """Where positions [0, num_positions) do not hold the target KV of `tokens`, or
        positions [0, num_draft_positions) not the draft KV a cold run writes; None if they
        all do."""
        for position in range(max(num_positions, num_draft_positions)):
            target, draft = self.read(block_ids, position)
            expected_target, expected_draft = self.expected_at(tokens, position)
            if position < num_positions and target != expected_target:
                return f"position {position}: target KV of {target!r}, a cold run {expected_target}"
            if position < num_draft_positions and draft != expected_draft:
                return f"position {position}: draft KV of {draft!r}, a cold run {expected_draft}"
        return None
