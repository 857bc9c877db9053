"""Typed results the KV cache manager hands to the scheduler."""

from __future__ import annotations

from dataclasses import dataclass

from speckv.cache.block import KVCacheBlock


@dataclass(frozen=True)
class BlockCopy:
    """Copy one block's KV (every layer: target and drafter) from `src_block_id` to
    `dst_block_id` before the step's forward: block reuse at a divergence point."""

    group_id: int
    src_block_id: int
    dst_block_id: int


@dataclass(frozen=True)
class CacheHit:
    """The longest usable cached prefix of a request: blocks per group, all of equal length.

    `num_computed_tokens` is at most `N - 1`: a whole number of alignment units, plus, with
    `copy_sources` (one block per group, divergent block reuse), the first `B - L` tokens of
    the next block, which the request takes as a copy of that cached block (it names another
    successor; the request recomputes the block's last L positions). `copy_next_step`: such a
    block is being computed in this very step (a copy reads KV an earlier step wrote), so the
    same lookup next step would take a copy.
    """

    blocks: tuple[list[KVCacheBlock], ...]
    num_computed_tokens: int
    copy_sources: tuple[KVCacheBlock, ...] = ()
    copy_next_step: bool = False

    @property
    def block_ids(self) -> tuple[list[int], ...]:
        return tuple([block.block_id for block in group] for group in self.blocks)


@dataclass(frozen=True)
class Allocation:
    """Block ids newly given to a request in one `allocate_slots` call, per group: the hit's
    blocks (first scheduling) then the freshly allocated ones, in block-table order. The
    scheduler forwards them to the model runner as its block-table delta, with `copies` (the
    hit's divergent block reuse: into the first freshly allocated block of each group)."""

    new_block_ids: tuple[list[int], ...]
    copies: tuple[BlockCopy, ...] = ()
