"""The KV cache manager: the scheduler's one entry point into the prefix cache.

Owns the per-group managers and the hash mode. It answers "how much of this request is cached"
(`get_computed_blocks`, pure), gives slots (`allocate_slots`, all or nothing), caches blocks once
their hashes exist, and frees. The pool below it owns every reference count.

Hit length for a prompt of N tokens, block size B (the last prompt token is always recomputed):

    no drafter / lookahead L=1      floor((N - 1) / B) * B
    lookahead L=k (k-module MTP)    floor((N - k) / B) * B    (blocks need k tokens after them)
    legacy hashes + EAGLE drop      one block less than the first row, not below 0
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from speckv.cache.block_pool import BlockPool, CachingRequest, GroupInfo, HitCheck
from speckv.cache.events import KVCacheEvent, KVEventSink
from speckv.cache.results import Allocation, CacheHit
from speckv.cache.single_type import SingleTypeManager, manager_for
from speckv.cache.specs import KVCacheSpec
from speckv.spec.policy import HashMode


class ManagedRequest(CachingRequest, Protocol):
    """What the manager reads of a request (see `speckv.engine.request.Request`)."""

    num_computed_tokens: int
    spec_token_ids: list[int]

    @property
    def num_tokens(self) -> int: ...

    def get_block_hashes(self, lookahead_tokens: int) -> list[bytes]: ...


class KVCacheManager:
    def __init__(
        self,
        specs: Sequence[KVCacheSpec],
        num_blocks: int,
        hash_mode: HashMode,
        enable_caching: bool = True,
        hit_check: HitCheck | None = None,
        event_sink: KVEventSink | None = None,
    ) -> None:
        if not specs:
            raise ValueError("a model needs at least one KV cache group")
        block_sizes = {spec.block_size for spec in specs}
        if len(block_sizes) != 1:
            raise ValueError(
                f"groups with different block sizes {sorted(block_sizes)} need the hybrid "
                "coordinator"
            )
        self.block_size = specs[0].block_size
        self.hash_mode = hash_mode
        self.enable_caching = enable_caching
        self.event_sink = event_sink
        self.pool = BlockPool(num_blocks, enable_caching, hit_check, event_sink)
        self.managers: list[SingleTypeManager] = [
            manager_for(
                spec,
                self.pool,
                GroupInfo(group_id, spec.block_size, hash_mode.lookahead_tokens, spec.kind),
            )
            for group_id, spec in enumerate(specs)
        ]

    @property
    def num_groups(self) -> int:
        return len(self.managers)

    @property
    def lookahead_tokens(self) -> int:
        return self.hash_mode.lookahead_tokens

    # ---- reads -------------------------------------------------------------------------------
    def get_computed_blocks(self, request: ManagedRequest) -> CacheHit:
        """The longest cached prefix usable by a new request (at most N - 1 tokens). Pure:
        nothing is touched until `allocate_slots` takes the hit."""
        empty = CacheHit(tuple([] for _ in self.managers), 0)
        if not self.enable_caching:
            return empty
        block_hashes = request.get_block_hashes(self.lookahead_tokens)
        max_length = request.num_tokens - 1
        hit_length = max_length
        per_group = []
        for manager in self.managers:
            blocks = manager.find_longest_cache_hit(request, block_hashes, hit_length)
            hit_length = min(hit_length, len(blocks) * manager.block_size)
            per_group.append(blocks)
        num_blocks = hit_length // self.block_size
        if self.hash_mode.drops_last_unit and num_blocks > 0:
            # legacy hashes cannot prove the last block's draft KV: recompute it
            num_blocks -= 1
        return CacheHit(
            tuple(blocks[:num_blocks] for blocks in per_group), num_blocks * self.block_size
        )

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([block.block_id for block in m.blocks_of(request_id)] for m in self.managers)

    def get_num_free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    # ---- mutations ---------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: ManagedRequest,
        num_new_tokens: int,
        hit: CacheHit | None = None,
        num_lookahead_tokens: int = 0,
    ) -> Allocation | None:
        """Give the request slots for `num_new_tokens` more tokens (the scheduled drafts
        included) plus `num_lookahead_tokens` slots for the drafter's next proposals, taking
        `hit` on first scheduling. Then cache the blocks whose hashes exist. Mutates.

        Returns None, and changes nothing, when there are not enough free blocks.

            [ computed | hit | new tokens (+ drafts) | lookahead slots ]
                                num_total = computed + hit + new + lookahead
        """
        if num_new_tokens <= 0 and num_lookahead_tokens <= 0:
            raise ValueError("allocate_slots needs at least one new token or lookahead slot")
        hit_blocks = hit.blocks if hit is not None else tuple([] for _ in self.managers)
        num_hit_tokens = hit.num_computed_tokens if hit is not None else 0
        request_id = request.request_id
        num_computed = request.num_computed_tokens + num_hit_tokens
        num_total = num_computed + num_new_tokens + num_lookahead_tokens
        num_needed = sum(
            manager.get_num_blocks_to_allocate(request_id, num_total, blocks)
            for manager, blocks in zip(self.managers, hit_blocks)
        )
        if num_needed > self.pool.get_num_free_blocks():
            return None
        new_blocks = []
        for manager, blocks in zip(self.managers, hit_blocks):
            manager.save_new_computed_blocks(request_id, blocks)
            new_blocks.append(manager.allocate_new_blocks(request_id, num_total))
        # Draft positions are not real tokens: their KV may be rejected.
        num_to_cache = min(
            num_computed + num_new_tokens - len(request.spec_token_ids), request.num_tokens
        )
        self._cache_blocks(request, num_to_cache)
        return Allocation(tuple(new_blocks))

    def cache_computed_blocks(self, request: ManagedRequest) -> None:
        """Cache every computed block whose hash exists, e.g. the block whose lookahead the
        last sampled token completed, before the request is freed or preempted. Mutates."""
        self._cache_blocks(request, request.num_computed_tokens)

    def free(self, request: ManagedRequest) -> None:
        """Release all of a request's blocks. Mutates."""
        for manager in self.managers:
            manager.free(request.request_id)

    def finish(self, request: ManagedRequest) -> None:
        """Cache what the last token completed, then free. Mutates."""
        self.cache_computed_blocks(request)
        self.free(request)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes if no request holds blocks. Mutates."""
        return self.pool.reset_prefix_cache()

    def take_events(self) -> list[KVCacheEvent]:
        return self.event_sink.take() if self.event_sink is not None else []

    def _cache_blocks(self, request: ManagedRequest, num_tokens: int) -> None:
        if not self.enable_caching or num_tokens <= 0:
            return
        block_hashes = request.get_block_hashes(self.lookahead_tokens)
        for manager in self.managers:
            manager.cache_blocks(request, block_hashes, num_tokens)

    # ---- tests -------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Pool invariants plus: every reference count equals the number of (request, group)
        lists holding the block. Pure; raises AssertionError."""
        holders: dict[int, int] = {}
        for manager in self.managers:
            for blocks in manager.req_to_blocks.values():
                for block in blocks:
                    if not block.is_null:
                        holders[block.block_id] = holders.get(block.block_id, 0) + 1
        self.pool.check_integrity(holders)
