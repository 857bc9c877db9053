"""Typed results the KV cache manager hands to the scheduler."""

from __future__ import annotations

from dataclasses import dataclass

from speckv.cache.block import KVCacheBlock


@dataclass(frozen=True)
class CacheHit:
    """The longest usable cached prefix of a request: blocks per group, all of equal length.

    `num_computed_tokens` is a whole number of alignment units and at most `N - 1`.
    """

    blocks: tuple[list[KVCacheBlock], ...]
    num_computed_tokens: int

    @property
    def block_ids(self) -> tuple[list[int], ...]:
        return tuple([block.block_id for block in group] for group in self.blocks)


@dataclass(frozen=True)
class Allocation:
    """Block ids newly given to a request in one `allocate_slots` call, per group: the hit's
    blocks (first scheduling) then the freshly allocated ones, in block-table order. The
    scheduler forwards them to the model runner as its block-table delta."""

    new_block_ids: tuple[list[int], ...]
