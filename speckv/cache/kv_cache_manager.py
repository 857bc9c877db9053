"""The KV cache manager: the scheduler's one entry point into the prefix cache.

Owns the per-group managers, the hash mode and the hybrid hit rule. It answers "how much of
this request is cached" (`get_computed_blocks`, pure), gives slots (`allocate_slots`, all or
nothing), caches blocks once their hashes exist, and frees. The pool below it owns every
reference count.

Hit length for a prompt of N tokens, alignment unit U (the last prompt token is always
recomputed):

    no drafter / lookahead L=1      floor((N - 1) / U) * U
    lookahead L=k (k-module MTP)    floor((N - k) / U) * U    (blocks need k tokens after them)
    legacy hashes + EAGLE drop      one unit less than the first row, not below 0

Divergent block reuse (lookahead hashes, `HashMode.reuses_divergent_blocks`, every group full
attention with blocks of U tokens, U > L): when the request's own hash of the next block j
misses but a block holding its tokens after the same chain is cached under another successor,
the hit takes a copy of that block and recomputes only its last L positions (their draft KV
is the only part that depends on the successor):

    hit = j * U + (U - L)     whenever block j ends at or before N - 1

so with a drafter the hit is the no-speculation hit minus at most L tokens, at divergence
points and (k-module MTP) at the prompt's end too. The hit then names `copy_sources` (one
block per group), held from `allocate_slots` until `step_executed` (the runner has copied them
into the request's own block j, which is cached under the request's own hash as usual).

Hybrid models: every group must accept the hit, and each may only shorten it. The coordinator
iterates to a fixed point over U-aligned lengths; under the legacy drop it drops one unit once
and iterates again (never a second drop, so it cannot spiral).

KV pools: `num_blocks` an int gives one pool that every group draws from (a block id then has
a row in every group's tensors); one count per group gives each group a pool of its own
(`pools[g]`, block ids 0..n_g - 1 in each, block 0 each pool's null block), so a group's
memory follows what it holds (`speckv.engine.kv_budget` sizes them). Either way each pool is
the sole owner of its blocks' reference counts, free queue and hash map; a request's
allocation is all or nothing across the pools.

Hashes are computed at the hash unit H = gcd of the groups' block sizes; a group with block
size m * H is named by every m-th hash of the chain (a chained hash covers all before it).
Attention groups use the mode's lookahead hashes; Mamba groups keep legacy hashes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Protocol

from speckv.cache.block import KVCacheBlock
from speckv.cache.block_pool import BlockPool, GroupInfo, make_pools
from speckv.cache.events import KVCacheEvent, KVEventSink
from speckv.cache.group_rules import hybrid_fixed_point
from speckv.cache.hash_mode import HashMode
from speckv.cache.hash_units import StridedHashes, alignment
from speckv.cache.hit_check import CachingRequest, HitCheck
from speckv.cache.results import Allocation, BlockCopy, CacheHit
from speckv.cache.retention import RetentionPolicy, TailWidening
from speckv.cache.single_type import (
    FullAttentionManager,
    ReusingFullAttentionManager,
    SingleTypeManager,
    manager_for,
)
from speckv.cache.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec
from speckv.hashing.block_hashing import BlockHashing
from speckv.hashing.functions import HashAlgo, get_hash_algo, make_none_hash


class ManagedRequest(CachingRequest, Protocol):
    """What the manager reads of a request (see `speckv.engine.request.Request`)."""

    num_computed_tokens: int
    spec_token_ids: list[int]

    @property
    def num_tokens(self) -> int: ...

    def get_block_hashes(self, lookahead_tokens: int) -> list[bytes]: ...

    def hash_with_successors(self, lookahead_tokens: int, index: int,
                             successors: Sequence[int]) -> bytes: ...


class KVCacheManager:
    def __init__(
        self,
        specs: Sequence[KVCacheSpec],
        num_blocks: int | Sequence[int],
        hash_mode: HashMode,
        enable_caching: bool = True,
        hit_check: HitCheck | None = None,
        event_sink: KVEventSink | None = None,
        alignment_tokens: int | None = None,
        retention_interval: int | None = None,
        tail_widening: TailWidening = TailWidening.UNIT,
    ) -> None:
        if not specs:
            raise ValueError("a model needs at least one KV cache group")
        block_sizes = [spec.block_size for spec in specs]
        self.hash_block_size = math.gcd(*block_sizes)
        alignment_tokens = alignment(block_sizes, alignment_tokens)
        self.alignment_tokens = alignment_tokens
        has_partial_groups = any(isinstance(spec, SlidingWindowSpec | MambaSpec) for spec in specs)
        if retention_interval is not None and not has_partial_groups:
            raise ValueError(
                "retention_interval applies to sliding-window or Mamba groups; this model has "
                "only full attention"
            )
        self.retention = RetentionPolicy(alignment_tokens, retention_interval)
        self.hash_mode = hash_mode
        self.enable_caching = enable_caching
        self.event_sink = event_sink
        self.pools: tuple[BlockPool, ...] = make_pools(len(specs), num_blocks, enable_caching,
                                                        hit_check, event_sink)
        self.pool = self.pools[0]  # group 0's pool (the only one when shared)
        # each distinct pool once, in group order
        self._distinct_pools = list({id(pool): pool for pool in self.pools}.values())
        self.per_group_pools = len(self._distinct_pools) > 1
        # A sibling diverging right after a kept boundary c hits c - U: under the drop always,
        # with lookahead hashes because the block ending at c has another successor there.
        widen_tails = hash_mode.drops_last_unit or hash_mode.lookahead_tokens > 0
        # block reuse at divergence points: full-attention groups of one block size only (a
        # sliding-window or Mamba group would need its state L tokens before a unit boundary)
        self.reuses_divergent_blocks = (
            hash_mode.reuses_divergent_blocks and enable_caching
            and all(isinstance(spec, FullAttentionSpec) and spec.block_size == alignment_tokens
                    for spec in specs)
            and alignment_tokens > hash_mode.lookahead_tokens
        )
        # request id -> the copy sources it holds until the runner has copied them
        self._copy_sources: dict[str, tuple[KVCacheBlock, ...]] = {}
        self.managers: list[SingleTypeManager] = [
            manager_for(spec, self.pools[group_id],
                        GroupInfo(group_id, spec.block_size,
                                  hash_mode.lookahead_tokens if spec.drafter_writes_kv else 0,
                                  spec.kind, getattr(spec, "sliding_window", None)),
                        self.retention,
                        tail_widening.extra_blocks(alignment_tokens, spec.block_size)
                        if widen_tails else 0,
                        self.reuses_divergent_blocks)
            for group_id, spec in enumerate(specs)]
        # allocations without a hit (every running request's) take no hit blocks
        self._no_hit_blocks: tuple[list, ...] = tuple(() for _ in self.managers)
        # the managers that free blocks behind the computed tokens (sliding window, Mamba)
        self._managers_that_skip = [
            m for m in self.managers
            if type(m).remove_skipped_blocks is not SingleTypeManager.remove_skipped_blocks]
        # Full attention first: it is cheap and usually the binding constraint.
        self._hit_order = sorted(
            range(len(self.managers)),
            key=lambda index: not isinstance(self.managers[index], FullAttentionManager),
        )

    @property
    def lookahead_values(self) -> tuple[int, ...]:
        """The L values whose hash chains requests must keep (one per kind of group)."""
        return tuple(sorted({m.group.lookahead_tokens for m in self.managers}))

    def block_hashing(self, algo: str | HashAlgo, hash_seed: str | None) -> BlockHashing:
        """The request hashing this manager's groups need: the hash unit as block size, one
        chain per lookahead value (none when caching is off). `hash_seed` None: from
        PYTHONHASHSEED, else random (see `make_none_hash`). Every caller builds it here."""
        hash_algo = get_hash_algo(algo) if isinstance(algo, str) else algo
        return BlockHashing(
            hash_algo,
            make_none_hash(hash_algo, hash_seed),
            self.hash_block_size,
            self.lookahead_values if self.enable_caching else (),
        )

    def _group_hashes(self, request: ManagedRequest, manager: SingleTypeManager):
        chain = request.get_block_hashes(manager.group.lookahead_tokens)
        stride = manager.block_size // self.hash_block_size
        return chain if stride == 1 else StridedHashes(chain, stride)

    # ---- reads -------------------------------------------------------------------------------
    def get_computed_blocks(self, request: ManagedRequest) -> CacheHit:
        """The longest cached prefix usable by a new request: at most N - 1 tokens, whole
        alignment units, valid for every group. Pure: nothing is touched until
        `allocate_slots` takes the hit."""
        if not self.enable_caching:
            return CacheHit(tuple([] for _ in self.managers), 0)
        hashes = [self._group_hashes(request, manager) for manager in self.managers]
        hit_length, per_group = self._fixed_point(request, hashes, request.num_tokens - 1)
        if self.hash_mode.drops_last_unit and hit_length > 0:
            # legacy hashes cannot prove the last unit's draft KV: drop it, once
            hit_length, per_group = self._fixed_point(
                request, hashes, hit_length - self.alignment_tokens
            )
        hit_blocks = tuple(blocks[: hit_length // m.block_size] for m, blocks in
                           zip(self.managers, per_group))
        if self.reuses_divergent_blocks:
            sources, next_step = self._divergent_sources(request, hashes, hit_length)
            if sources:
                num_reused = self.alignment_tokens - self.hash_mode.lookahead_tokens
                return CacheHit(hit_blocks, hit_length + num_reused, sources)
            if next_step:
                return CacheHit(hit_blocks, hit_length, copy_next_step=True)
        return CacheHit(hit_blocks, hit_length)

    def _divergent_sources(self, request, hashes, hit_length: int
                           ) -> tuple[tuple[KVCacheBlock, ...], bool]:
        """One cached block per group holding the request's block after the hit under another
        successor (() unless every group has one and the block ends by N - 1), and whether
        every group would have one next step (some are being computed in this one). Pure."""
        unit = self.alignment_tokens
        if hit_length + unit > request.num_tokens - 1:
            return (), False
        index = hit_length // unit
        sources = []
        next_step = False
        for manager, group_hashes in zip(self.managers, hashes):
            assert isinstance(manager, ReusingFullAttentionManager)
            block = manager.find_divergent_block(request, group_hashes, index)
            if block is None:
                if manager.find_divergent_block(request, group_hashes, index, True) is None:
                    return (), False
                next_step = True
            sources.append(block)
        return (() if next_step else tuple(sources)), next_step

    def _fixed_point(self, request, hashes, max_length: int):
        managers = self.managers
        per_group: list[list] = [[] for _ in managers]

        def longest(index: int, candidate: int) -> int:
            manager = managers[index]
            blocks = manager.find_longest_cache_hit(request, hashes[index], candidate)
            per_group[index] = blocks
            return len(blocks) * manager.block_size

        hit_length = hybrid_fixed_point(max_length, self.alignment_tokens, self._hit_order,
                                        longest)
        return hit_length, per_group

    @property
    def hit_order(self) -> tuple[int, ...]:
        """The order the groups are asked for a hit (full attention first)."""
        return tuple(self._hit_order)

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple([block.block_id for block in m.blocks_of(request_id)] for m in self.managers)

    def record_released_blocks(self) -> None:
        """From now on, note every cached block that `allocate_slots` releases behind a
        request's computed tokens (sliding window, old Mamba checkpoints), for a KV connector
        that saves it in the same step (`take_released_block_ids`). Mutates."""
        for manager in self._managers_that_skip:
            if manager.released is None:
                manager.released = {}

    def take_released_block_ids(self, request_id: str) -> tuple[tuple[tuple[int, int], ...], ...]:
        """Per group, the (block index, block id) pairs released from the request since the
        last take ((): none). Their blocks hold their KV until the step's worker phase."""
        if not self._managers_that_skip:
            return ()
        taken = tuple(tuple(m.released.pop(request_id, ()))
                      if m.released is not None else () for m in self.managers)
        return taken if any(taken) else ()

    def drop_released_block_ids(self) -> None:
        """Forget every noted release (their blocks may be reused from the next step). Mutates."""
        for manager in self._managers_that_skip:
            if manager.released:
                manager.released.clear()

    def get_num_free_blocks(self) -> int:
        """Free blocks of all pools together."""
        return sum(pool.get_num_free_blocks() for pool in self._distinct_pools)

    def get_num_blocks(self) -> int:
        """Blocks of all pools together, null blocks excluded."""
        return sum(pool.num_blocks - 1 for pool in self._distinct_pools)

    def group_num_blocks(self) -> tuple[int, ...]:
        """Blocks (null block included) of each group's pool (shared: the same count)."""
        return tuple(pool.num_blocks for pool in self.pools)

    # ---- mutations ---------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: ManagedRequest,
        num_new_tokens: int,
        hit: CacheHit | None = None,
        num_draft_slots: int = 0,
        num_external_tokens: int = 0,
    ) -> Allocation | None:
        """Give the request slots for `num_new_tokens` more tokens (the scheduled drafts
        included) plus `num_draft_slots` slots for the drafter's next proposals, taking
        `hit` on first scheduling. Caches the blocks whose hashes exist and frees blocks that
        fell out of a sliding window. Mutates; the caller then advances
        `request.num_computed_tokens` by the hit, the external tokens and the new tokens.

        `num_external_tokens` (first scheduling only) are tokens right after the hit that a KV
        connector loads into the new blocks before the forward. They count as computed, but
        nothing past the hit is cached in this call: a load can fail, and a hash must never
        name garbage. The next `allocate_slots` (or `cache_computed_blocks`) caches them, after
        the scheduler has rolled back whatever failed.

        Returns None, and changes nothing, when there are not enough free blocks.

            [ computed | hit | external | new tokens (+ drafts) | draft slots ]
                     num_total = computed + hit + external + new + draft slots
        """
        if num_new_tokens <= 0 and num_draft_slots <= 0 and num_external_tokens <= 0:
            # (external tokens alone: the blocks of an asynchronous load, nothing computed yet)
            raise ValueError("allocate_slots needs at least one new token or draft slot")
        if num_external_tokens < 0:
            raise ValueError(f"num_external_tokens must be >= 0, got {num_external_tokens}")
        if hit is None and not num_external_tokens:
            return self._allocate_running(request, num_new_tokens, num_draft_slots)
        return self._allocate_first(request, num_new_tokens, hit, num_draft_slots,
                                    num_external_tokens)

    def _allocate_first(self, request: ManagedRequest, num_new_tokens: int,
                        hit: CacheHit | None, num_draft_slots: int, num_external_tokens: int
                        ) -> Allocation | None:
        """`allocate_slots` on first scheduling: the hit's blocks (and a divergent block's
        copy source) taken, the external tokens' and new tokens' blocks allocated."""
        managers = self.managers
        hit_blocks = hit.blocks if hit is not None else self._no_hit_blocks
        num_hit_tokens = hit.num_computed_tokens if hit is not None else 0
        sources = hit.copy_sources if hit is not None else ()
        request_id = request.request_id
        num_cacheable = request.num_computed_tokens + num_hit_tokens
        num_computed = num_cacheable + num_external_tokens
        num_total = num_computed + num_new_tokens + num_draft_slots
        needed = self._blocks_needed(request_id, num_total, hit_blocks)
        for manager, source in zip(managers, sources):
            key = id(manager.pool)  # touching a free source takes it off the queue
            needed[key] = needed.get(key, 0) + manager.pool.num_free_among((source,))
        if not self._pools_can_give(needed):
            return None
        if sources:  # held before anything is allocated, which could evict them
            for manager, source in zip(managers, sources):
                manager.pool.touch((source,))
            self._copy_sources[request_id] = sources
        new_block_ids = []
        copies: list[BlockCopy] = []
        for manager, blocks, source in zip(managers, hit_blocks,
                                           sources or (None,) * len(managers)):
            if blocks:
                manager.save_new_computed_blocks(request_id, blocks)
                new = manager.allocate_new_blocks(request_id, num_total)
                new_block_ids.append([block.block_id for block in (*blocks, *new)])
            else:  # allocate_new_blocks starts the request's list when it has none
                new = manager.allocate_new_blocks(request_id, num_total)
                new_block_ids.append([block.block_id for block in new] if new else [])
            if source is not None:  # into the block after the hit: the request's own
                copies.append(BlockCopy(manager.group.group_id, source.block_id,
                                        new[0].block_id))
        # Draft positions are not real tokens: their KV may be rejected.
        num_to_cache = min(
            num_computed + num_new_tokens - len(request.spec_token_ids), request.num_tokens
        )
        if num_external_tokens:
            num_to_cache = num_cacheable  # the loaded range is cached once the load succeeded
        self._cache_blocks(request, num_to_cache)
        # only after caching: a block leaving the window may be one a later hit needs
        if num_external_tokens:
            # A connector loads the external range: of a sliding-window or Mamba group only
            # what the hit at its end reads (the window's tail, the state there). The blocks
            # before that hold nothing and are never cached; what the local hit reads stays
            # until the load proved good (a failed load resumes from the local hit).
            for manager in self._managers_that_skip:
                manager.skip_caching_before(request_id, manager.first_kept_block(num_computed))
                manager.remove_skipped_blocks(request_id, num_cacheable)
        else:
            for manager in self._managers_that_skip:
                manager.remove_skipped_blocks(request_id, num_computed)
        return Allocation(tuple(new_block_ids), tuple(copies))

    def _allocate_running(self, request: ManagedRequest, num_new_tokens: int,
                          num_draft_slots: int) -> Allocation | None:
        """`allocate_slots` without a hit or external tokens (a running request's step, the
        common case): the same bookkeeping without the hit's branches."""
        request_id = request.request_id
        num_computed = request.num_computed_tokens
        num_total = num_computed + num_new_tokens + num_draft_slots
        managers = self.managers
        # Draft positions are not real tokens: their KV may be rejected.
        num_to_cache = min(num_computed + num_new_tokens - len(request.spec_token_ids),
                           request.num_tokens)
        if not self._managers_that_skip:
            caching = self.enable_caching
            for manager in managers:
                block_size = manager.block_size
                held = len(manager.req_to_blocks.get(request_id, ()))
                if -(-num_total // block_size) > held or (
                        caching and num_to_cache // block_size
                        > manager.num_cached_blocks.get(request_id, 0)):
                    break
            else:
                # most steps: the request's blocks hold the tokens and no block filled up,
                # so nothing is allocated or cached (what the path below would find)
                return Allocation(tuple([] for _ in managers))
        if not self.per_group_pools:
            num_needed = 0
            for manager in managers:
                num_needed += manager.get_num_blocks_to_allocate(request_id, num_total, ())
            if num_needed > self.pool.get_num_free_blocks():
                return None
        elif not self._pools_can_give(
                self._blocks_needed(request_id, num_total, self._no_hit_blocks)):
            return None  # per-group pools: each pool gives its own groups' blocks
        new_block_ids = tuple([block.block_id for block in
                               manager.allocate_new_blocks(request_id, num_total)]
                              for manager in managers)
        self._cache_blocks(request, num_to_cache)
        # only after caching: a block leaving the window may be one a later hit needs
        for manager in self._managers_that_skip:
            manager.remove_skipped_blocks(request_id, num_computed)
        return Allocation(new_block_ids)

    def _blocks_needed(self, request_id: str, num_total: int,
                       hit_blocks: Sequence[Sequence[KVCacheBlock]]) -> dict[int, int]:
        """Free blocks each pool must give (by `id(pool)`) for the request to hold
        `num_total` tokens in every group, after `hit_blocks`."""
        needed: dict[int, int] = {}
        for manager, blocks in zip(self.managers, hit_blocks):
            key = id(manager.pool)
            needed[key] = needed.get(key, 0) + manager.get_num_blocks_to_allocate(
                request_id, num_total, blocks)
        return needed

    def _pools_can_give(self, needed: dict[int, int]) -> bool:
        return all(needed.get(id(pool), 0) <= pool.get_num_free_blocks()
                   for pool in self._distinct_pools)

    def step_executed(self) -> None:
        """The runner has carried out a step: release the copy sources it has copied, and let
        later lookups reuse the blocks cached so far (their KV is written now). The scheduler
        calls it at the end of every step. Mutates."""
        if self._copy_sources:
            for sources in self._copy_sources.values():
                self._free_sources(sources)
            self._copy_sources.clear()
        if self.reuses_divergent_blocks:
            for pool in self._distinct_pools:
                pool.commit_successors()

    def cache_computed_blocks(self, request: ManagedRequest) -> None:
        """Cache every computed block whose hash exists, e.g. the block whose lookahead the
        last sampled token completed, before the request is freed or preempted. Mutates."""
        self._cache_blocks(request, request.num_computed_tokens)

    def free(self, request: ManagedRequest) -> None:
        """Release all of a request's blocks (and a copy source it still holds). Mutates."""
        for manager in self.managers:
            manager.free(request.request_id)
        sources = self._copy_sources.pop(request.request_id, None)
        if sources:
            self._free_sources(sources)

    def _free_sources(self, sources: Sequence[KVCacheBlock]) -> None:
        for manager, source in zip(self.managers, sources):
            manager.pool.free_blocks((source,))

    def finish(self, request: ManagedRequest) -> None:
        """Cache what the last token completed, then free. Mutates."""
        self.cache_computed_blocks(request)
        self.free(request)

    def reset_prefix_cache(self) -> bool:
        """Forget all cached hashes if no request holds blocks. Mutates."""
        pools = self._distinct_pools
        if any(pool.get_num_free_blocks() < pool.num_blocks - 1 for pool in pools):
            return False  # all or nothing: a block is in use somewhere
        # one AllBlocksCleared for the whole cache
        return all([pool.reset_prefix_cache(record=index == 0)
                    for index, pool in enumerate(pools)])

    def take_events(self) -> list[KVCacheEvent]:
        return self.event_sink.take() if self.event_sink is not None else []

    def _cache_blocks(self, request: ManagedRequest, num_tokens: int) -> None:
        if not self.enable_caching or num_tokens <= 0:
            return
        for manager in self.managers:
            manager.cache_blocks(request, self._group_hashes(request, manager), num_tokens)

    # ---- tests -------------------------------------------------------------------------------
    def check_integrity(self) -> None:
        """Pool invariants plus: every reference count equals the number of (request, group)
        lists holding the block. Pure; raises AssertionError."""
        holders: dict[int, dict[int, int]] = {id(pool): {} for pool in self._distinct_pools}
        for manager in self.managers:
            counts = holders[id(manager.pool)]
            for blocks in manager.req_to_blocks.values():
                for block in blocks:
                    if not block.is_null:
                        counts[block.block_id] = counts.get(block.block_id, 0) + 1
        for sources in self._copy_sources.values():
            for manager, block in zip(self.managers, sources):
                counts = holders[id(manager.pool)]
                counts[block.block_id] = counts.get(block.block_id, 0) + 1
        for pool in self._distinct_pools:
            pool.check_integrity(holders[id(pool)])
