"""The block pool: the single owner of reference counts, the free queue and the hash map.

Every other cache component asks the pool; none of them touches `ref_cnt`, the free queue or
`cached_blocks` directly. Public methods say whether they mutate.

Free-queue policy:
- a request's blocks are freed tail first, so the end of a chain is evicted before its start
  (a later request can still hit the prefix);
- blocks that hold no hash go to the head and are reused before any cached block.

Divergent block reuse (groups whose manager asks for it) reads one more map per group, the
divergent-block index: `(parent hash, B tokens) -> (hash, L successor tokens)` of the latest
block cached with that content, whatever its successors (b"" stands for a chain's first
block's parent). A request whose own hash of block j misses looks up its block j's content
there and finds a block that holds its tokens after its chain under another successor. Caching
a run of blocks only notes the run (references to the request's append-only hash chain and
tokens, O(1); a chain's first block is entered at once, O(B)); runs become copyable one step
late (`commit_successors`: a copy reads its source at the start of a step, so only blocks
whose KV an earlier step wrote may be sources), and are folded into the map (one slice per
block, one `dict.update` per run) by the first lookup past a chain's first block that needs
it. So a cold miss (its first block differs) and a whole hit pay nothing for the index.
The blocks noted in this step have an index of their own, folded the same way, cleared at
the commit (a request finding its block there waits a step and copies it then). Runs beyond
twice the pool's blocks are forgotten oldest first, entries whose block was evicted since are
skipped at lookup and dropped when the map outgrows the pool.

The KV events of cached blocks are built in `pool_events.py`; `make_pools` gives a KV cache
manager one pool every group shares, or one per group.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from speckv.cache.block import (
    NULL_BLOCK_ID,
    CacheKey,
    FreeBlockQueue,
    KVCacheBlock,
    make_cache_key,
    split_cache_key,
)
from speckv.cache.events import AllBlocksCleared, BlockRemoved, KVEventSink
from speckv.cache.hit_check import CachingRequest, HitCheck, TrustHashes, content_of
from speckv.cache.pool_events import record_stored
from speckv.cache.successor_runs import FIRST_PARENT, ContentKey, SuccessorRun


@dataclass(frozen=True)
class GroupInfo:
    """The KV cache group being cached, as KV events describe it."""

    group_id: int
    block_size: int
    lookahead_tokens: int  # L of this group's hash chain
    kind: str = "full_attention"
    sliding_window: int | None = None


class BlockPool:
    """Blocks, their reference counts, the free queue and the hash map (one dict per group,
    `block hash -> block`)."""

    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        hit_check: HitCheck | None = None,
        event_sink: KVEventSink | None = None,
    ) -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (one is the null block), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.hit_check: HitCheck = hit_check if hit_check is not None else TrustHashes()
        self.event_sink = event_sink
        self.blocks = [KVCacheBlock(block_id) for block_id in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # group id -> {block hash -> block}: keyed by the bare hash, so a lookup or an insert
        # builds no key (the hot loops are C-level dict probes)
        self._cached: dict[int, dict[bytes, KVCacheBlock]] = {}
        # the divergent-block index (see the module docstring), per group id: content key ->
        # (hash, successors), successors one int for L = 1, else an L-tuple
        self._by_content: dict[int, dict[ContentKey, tuple[bytes, Any]]] = {}
        # the same for the runs noted this step (copyable from the next step on)
        self._pending_by_content: dict[int, dict[ContentKey, tuple[bytes, Any]]] = {}
        self._pending_runs: list[SuccessorRun] = []  # noted this step
        self._num_pending_folded = 0  # of `_pending_runs`, folded into `_pending_by_content`
        self._runs: deque[SuccessorRun] = deque()  # committed, not folded into `_by_content` yet
        self._num_run_blocks = 0  # blocks in `_runs`
        # NULL_BLOCK_ID stands for "no KV here" (e.g. outside a sliding window); never freed.
        self.null_block = self.free_queue.popleft()
        assert self.null_block.block_id == NULL_BLOCK_ID
        self.null_block.is_null = True

    # ---- reads -------------------------------------------------------------------------------
    @property
    def cached_blocks(self) -> dict[CacheKey, KVCacheBlock]:
        """Every cached block by cache key (a snapshot, for tests and tools). Pure."""
        return {
            make_cache_key(block_hash, group_id): block
            for group_id, blocks in self._cached.items()
            for block_hash, block in blocks.items()
        }

    def cached_map(self, group_id: int) -> dict[bytes, KVCacheBlock]:
        """The live `block hash -> block` map of one group; read it, never change it."""
        blocks = self._cached.get(group_id)
        if blocks is None:
            blocks = self._cached[group_id] = {}
        return blocks

    def get_num_free_blocks(self) -> int:
        """Blocks that `get_new_blocks` can hand out (free, cached or not). Pure."""
        return len(self.free_queue)

    def get_cached_block(self, block_hash: bytes, group_id: int) -> KVCacheBlock | None:
        """The block cached under `(block_hash, group_id)`, if any. Pure."""
        blocks = self._cached.get(group_id)
        return blocks.get(block_hash) if blocks is not None else None

    def successor_of(self, parent_hash: bytes | None, token_ids: tuple[int, ...],
                     group_id: int) -> tuple[bytes, Any] | None:
        """(hash, successors) of the latest committed block of a group holding `token_ids`
        after `parent_hash` (None: a chain's first block), under any successors, if any; the
        block may have been evicted since. Folds the committed runs into the index first (the
        only mutation)."""
        if parent_hash is None:
            parent_hash = FIRST_PARENT
        elif self._runs:
            self._fold_runs()
        index = self._by_content.get(group_id)
        return index.get((parent_hash, token_ids)) if index is not None else None

    def pending_successor_of(self, parent_hash: bytes | None, token_ids: tuple[int, ...],
                             group_id: int) -> tuple[bytes, Any] | None:
        """As `successor_of`, among the runs noted this step (not yet copyable). Folds them
        into this step's index first (the only mutation)."""
        if parent_hash is None:
            parent_hash = FIRST_PARENT
        elif self._num_pending_folded < len(self._pending_runs):
            self._fold_pending()
        index = self._pending_by_content.get(group_id)
        return index.get((parent_hash, token_ids)) if index is not None else None

    def noted_this_step(self, block_hash: bytes, index: int, group_id: int) -> bool:
        """Whether a run noted this step names `block_hash` at chain position `index`: the
        block cached under it now may be one whose KV this step computes (a hash evicted
        earlier can be cached again, in a new block). Pure, O(1) per run."""
        return any(run.group_id == group_id and run.start <= index < run.end
                   and run.block_hashes[index] == block_hash for run in self._pending_runs)

    def num_free_among(self, blocks: Sequence[KVCacheBlock]) -> int:
        """How many of `blocks` sit in the free queue (touching them takes them off). Pure."""
        return self.free_queue.count_in(blocks[self.null_prefix_len(blocks):])

    def null_prefix_len(self, blocks: Sequence[KVCacheBlock]) -> int:
        """The number of null blocks `blocks` starts with. Pure.

        Sliding-window and Mamba block lists start with thousands of nulls (a long hit, or
        blocks released behind the window); skipping them in bulk keeps hybrid models as
        cheap as one group. Binary search for the boundary, then a C-level check that the
        prefix really is all nulls (`count` short-cuts on identity).
        """
        null = self.null_block
        if not blocks or blocks[0] is not null:
            return 0
        low, high = 1, len(blocks)  # blocks[low - 1] is null; the answer is in [low, high]
        while low < high:
            mid = (low + high) // 2
            if blocks[mid] is null:
                low = mid + 1
            else:
                high = mid
        if blocks[:low].count(null) != low:  # not a clean prefix: no shortcut
            return 0
        return low

    # ---- mutations ---------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take `num_blocks` blocks off the free queue (evicting their hashes). Mutates."""
        if num_blocks > len(self.free_queue):
            raise ValueError(
                f"cannot get {num_blocks} blocks: only {len(self.free_queue)} free"
            )
        blocks = self.free_queue.popleft_n(num_blocks)
        cached_blocks = []
        for block in blocks:
            block.ref_cnt = 1
            if block.block_hash is not None:
                cached_blocks.append(block)
        if cached_blocks:  # free cached blocks are reused in LRU order: evict their hashes
            self._record_removed(self._evict(cached_blocks))
        return blocks

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A request starts using cached blocks: take them off the free queue. Mutates."""
        queue = self.free_queue.ordered
        if isinstance(blocks, list):
            blocks = blocks[self.null_prefix_len(blocks):]
        for block in blocks:
            if block.ref_cnt == 0:
                if block.is_null:
                    continue
                try:
                    del queue[block]
                except KeyError:
                    raise RuntimeError(f"{block} is not in the free queue") from None
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in eviction order (first = evicted first).
        Blocks without a hash go to the head of the queue. Mutates."""
        queue = self.free_queue.ordered
        hashless: list[KVCacheBlock] = []
        try:
            for block in ordered_blocks:
                ref_cnt = block.ref_cnt
                if ref_cnt == 1:
                    if block.block_hash is None:
                        hashless.append(block)
                    else:  # cached blocks join the tail as they reach 0, in order
                        queue[block] = None
                elif ref_cnt <= 0:
                    if block.is_null:
                        continue
                    raise RuntimeError(f"double free of {block}")
                block.ref_cnt = ref_cnt - 1
        finally:  # even on a double free, queue what reached 0 (the pool stays consistent)
            if hashless:
                self.free_queue.appendleft_n(hashless)

    def cache_full_blocks(
        self,
        request: CachingRequest,
        blocks: Sequence[KVCacheBlock],
        block_hashes: Sequence[bytes],
        num_cached_blocks: int,
        num_full_blocks: int,
        group: GroupInfo,
    ) -> None:
        """Enter blocks `[num_cached_blocks, num_full_blocks)` of a request under their hashes
        (`block_hashes[i]` names `blocks[i]`) and record one BlockStored. Mutates.

        A block whose hash is already cached under another block stays hashless: the cache
        keeps one copy per content.
        """
        if not self.enable_caching or num_full_blocks <= num_cached_blocks:
            return
        if len(block_hashes) < num_full_blocks:
            raise ValueError(
                f"{num_full_blocks} blocks to cache but only {len(block_hashes)} hashes"
            )
        group_id = group.group_id
        cached = self.cached_map(group_id)
        stores_content = self.hit_check.stores_content
        records = self.event_sink is not None
        stored_hashes: list[bytes] = []
        stored_indices: list[int] = []
        index = num_cached_blocks
        for block, block_hash in zip(blocks[num_cached_blocks:num_full_blocks],
                                     block_hashes[num_cached_blocks:num_full_blocks]):
            # skip blocks outside a window, hit blocks already cached, and duplicates
            if not (block.is_null or block.block_hash is not None or block_hash in cached):
                block.block_hash = block_hash
                block.group_id = group_id
                cached[block_hash] = block
                if stores_content:
                    parent = block_hashes[index - 1] if index > 0 else b""
                    start = index * group.block_size
                    block.content = content_of(
                        request, parent, start, start + group.block_size, group.lookahead_tokens
                    )
                if records:
                    stored_hashes.append(block_hash)
                    stored_indices.append(index)
            index += 1
        if stored_hashes:
            record_stored(self.event_sink, request, block_hashes, stored_indices, stored_hashes,
                          group)

    def note_successors(
        self,
        request: CachingRequest,
        block_hashes: Sequence[bytes],
        start: int,
        end: int,
        group: GroupInfo,
    ) -> None:
        """Note that blocks `[start, end)` of `request` were cached (their hashes exist), for
        the divergent-block index; they are copyable after the next `commit_successors`.
        `block_hashes` and the request's tokens must only ever grow (a request's chain and
        real tokens do). Mutates, O(1) (O(B) for a chain's first block)."""
        if not self.enable_caching or end <= start:
            return
        run = SuccessorRun(group.group_id, group.block_size, group.lookahead_tokens,
                           request.all_token_ids, block_hashes, start, end)
        self._pending_runs.append(run)
        if start == 0:
            key, entry = run.first_entry()
            self._index_of(self._pending_by_content, run.group_id)[key] = entry

    def commit_successors(self) -> None:
        """Let lookups copy the runs noted so far (call once their KV is written: after the
        step that computes them). Mutates."""
        pending = self._pending_runs
        if not pending:
            return
        for run in pending:
            if run.start == 0:
                key, entry = run.first_entry()
                self._index_of(self._by_content, run.group_id)[key] = entry
            self._runs.append(run)
            self._num_run_blocks += run.end - run.start
        pending.clear()
        self._pending_by_content.clear()
        self._num_pending_folded = 0
        limit = 2 * self.num_blocks
        while self._num_run_blocks > limit:  # oldest first: their blocks are evicted first
            old = self._runs.popleft()
            self._num_run_blocks -= old.end - old.start
        self._drop_stale_entries()

    def _fold_runs(self) -> None:
        """Enter the committed runs into `_by_content` (C-level slices, one update each)."""
        self._fold_into(self._by_content, self._runs)  # first blocks: entered at the commit
        self._runs.clear()
        self._num_run_blocks = 0
        self._drop_stale_entries()

    def _fold_pending(self) -> None:
        """Enter the runs noted this step and not folded yet into `_pending_by_content`."""
        # first blocks were entered when noted
        self._fold_into(self._pending_by_content, self._pending_runs[self._num_pending_folded:])
        self._num_pending_folded = len(self._pending_runs)

    def _fold_into(self, indexes: dict[int, dict[ContentKey, tuple[bytes, Any]]],
                   runs: Iterable[SuccessorRun]) -> None:
        """Enter every run's blocks but a chain's first (entered eagerly) into `indexes`."""
        for run in runs:
            first = max(run.start, 1)
            if first < run.end:
                self._index_of(indexes, run.group_id).update(run.entries(first, run.end))

    def _drop_stale_entries(self) -> None:
        """At most one live entry per cached block: past twice the pool, drop the entries
        whose block was evicted since."""
        for group_id, index in list(self._by_content.items()):
            if len(index) > 2 * self.num_blocks:
                cached = self.cached_map(group_id)
                self._by_content[group_id] = {
                    key: entry for key, entry in index.items() if entry[0] in cached}

    @staticmethod
    def _index_of(indexes: dict[int, dict[ContentKey, tuple[bytes, Any]]], group_id: int
                  ) -> dict[ContentKey, tuple[bytes, Any]]:
        index = indexes.get(group_id)
        if index is None:
            index = indexes[group_id] = {}
        return index

    def reset_prefix_cache(self, record: bool = True) -> bool:
        """Forget every cached hash, if no request holds a block. Mutates.

        Returns False (and changes nothing) while blocks are in use. `record`: emit the
        AllBlocksCleared event (a cache of several pools emits it once).
        """
        num_used = self.num_blocks - 1 - self.get_num_free_blocks()
        if num_used > 0:
            return False
        for blocks in self._cached.values():
            for block in blocks.values():
                block.block_hash = None
                block.content = None
            blocks.clear()
        self._by_content.clear()
        self._pending_by_content.clear()
        self._pending_runs.clear()
        self._num_pending_folded = 0
        self._runs.clear()
        self._num_run_blocks = 0
        if self.event_sink is not None and record:
            self.event_sink.record(AllBlocksCleared())
        return True

    def evict_cached_blocks(self, keys: Iterable[CacheKey]) -> int:
        """Drop the hashes of free cached blocks (e.g. on request of an operator). Mutates.

        Returns the number of hashes dropped; blocks in use keep theirs.
        """
        evicted: list[KVCacheBlock] = []
        seen: set[int] = set()
        for key in keys:
            block = self.get_cached_block(*split_cache_key(key))
            if block is None or block.ref_cnt > 0 or block.block_id in seen:
                continue
            seen.add(block.block_id)
            evicted.append(block)
        removed = self._evict(evicted)
        # now hashless: move them to the front so they are reused first
        self.free_queue.remove_n(evicted)
        self.free_queue.appendleft_n(evicted[::-1])
        self._record_removed(removed)
        return len(evicted)

    # ---- internals ---------------------------------------------------------------------------
    def _evict(self, blocks: list[KVCacheBlock]) -> dict[int, list[bytes]]:
        """Drop the hashes of cached `blocks`; returns the dropped hashes by group."""
        removed: dict[int, list[bytes]] = {}
        cached = self._cached
        for block in blocks:
            block_hash, group_id = block.block_hash, block.group_id
            assert block_hash is not None
            del cached[group_id][block_hash]
            block.block_hash = None
            block.content = None
            hashes = removed.get(group_id)
            if hashes is None:
                removed[group_id] = [block_hash]
            else:
                hashes.append(block_hash)
        return removed

    def _record_removed(self, removed: dict[int, list[bytes]]) -> None:
        if self.event_sink is None:
            return
        for group_id, hashes in removed.items():
            self.event_sink.record(BlockRemoved(block_hashes=hashes, group_idx=group_id))

    def check_integrity(self, expected_ref_cnts: dict[int, int] | None = None) -> None:
        """Raise AssertionError if the pool's invariants do not hold (for tests). Pure.

        free + used = total; free blocks have ref 0 and used ones > 0; the hash map and the
        blocks' keys agree; the queue's links are sound; with `expected_ref_cnts` (block id →
        number of holders) every reference count is exactly that.
        """
        self.free_queue.check_links()
        free_ids = {block.block_id for block in self.free_queue}
        assert len(free_ids) == len(self.free_queue)
        assert self.null_block.block_id not in free_ids, "null block in the free queue"
        num_used = 0
        for block in self.blocks:
            if block.is_null:
                continue
            if block.block_id in free_ids:
                assert block.ref_cnt == 0, f"{block} is free but referenced"
            else:
                assert block.ref_cnt > 0, f"{block} is neither free nor referenced (leak)"
                num_used += 1
            if block.block_hash is not None:
                assert self.get_cached_block(block.block_hash, block.group_id) is block, (
                    f"{block} not in map"
                )
            if expected_ref_cnts is not None:
                expected = expected_ref_cnts.get(block.block_id, 0)
                assert block.ref_cnt == expected, (
                    f"{block}: ref_cnt {block.ref_cnt}, held by {expected}"
                )
        assert num_used + len(free_ids) == self.num_blocks - 1, "free + used != total"
        for group_id, blocks in self._cached.items():
            for block_hash, block in blocks.items():
                assert block.block_hash == block_hash and block.group_id == group_id, (
                    f"map entry for {block} has a stale key"
                )
                assert not block.is_null


def make_pools(num_groups: int, num_blocks: int | Sequence[int], enable_caching: bool,
                hit_check: HitCheck | None, event_sink: KVEventSink | None
                ) -> tuple[BlockPool, ...]:
    """One pool every group shares (`num_blocks` an int), or one pool per group."""
    if isinstance(num_blocks, int):
        return (BlockPool(num_blocks, enable_caching, hit_check, event_sink),) * num_groups
    if len(num_blocks) != num_groups:
        raise ValueError(f"{len(num_blocks)} block counts for {num_groups} KV cache groups")
    return tuple(BlockPool(n, enable_caching, hit_check, event_sink) for n in num_blocks)
