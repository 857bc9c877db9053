"""Per-group managers: how one KV cache group finds hits, allocates and caches blocks.

Owns each request's block list for one group. One manager type per group kind; the
coordinator picks them by spec type. Managers ask the pool for every block they take, touch,
cache or free; they never change reference counts themselves.

    block i of the group covers tokens [i * B, (i + 1) * B); block_hashes[i] names it

A hit list has one entry per block up to the hit length; groups that keep only part of the
prefix (sliding window, Mamba) fill the rest with the pool's null block.

`ReusingFullAttentionManager` adds divergent block reuse: it notes every cached run in the
pool's divergent-block index and finds, for a request whose own hash of block j misses, a
cached block holding its block j's tokens after its chain under another successor.
"""

from __future__ import annotations

from collections.abc import Sequence

from speckv.cache.block import BlockContent, KVCacheBlock
from speckv.cache.block_pool import BlockPool, GroupInfo
from speckv.cache.hit_check import CachingRequest, content_of
from speckv.cache.retention import RetentionPolicy, runs_worth_keeping
from speckv.cache.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec

# Blocks probed before the first check for a miss in a full-attention lookup.
_FIRST_PROBE_CHUNK = 32


def cdiv(numerator: int, denominator: int) -> int:
    return -(-numerator // denominator)


class SingleTypeManager:
    """Shared bookkeeping of one group; subclasses define what a hit needs."""

    # blocks kept before each reachable boundary (a partial-prefix group's; 0: every block)
    num_tail_blocks: int = 0

    def __init__(self, spec: KVCacheSpec, pool: BlockPool, group: GroupInfo) -> None:
        self.spec = spec
        self.block_size = spec.block_size
        self.pool = pool
        self.group = group
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}
        # request id -> (block index, block id) of cached blocks released behind the computed
        # tokens since the last take (None: not recorded; a KV connector turns it on)
        self.released: dict[str, list[tuple[int, int]]] | None = None

    # ---- reads -------------------------------------------------------------------------------
    def find_longest_cache_hit(
        self, request: CachingRequest, block_hashes: Sequence[bytes], max_length: int
    ) -> list[KVCacheBlock]:
        """Cached blocks of the longest prefix of at most `max_length` tokens. Pure."""
        raise NotImplementedError

    def blocks_of(self, request_id: str) -> list[KVCacheBlock]:
        return self.req_to_blocks.get(request_id, [])

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> int:
        """Free blocks that allocating `num_tokens` slots would consume, counting hit blocks
        that sit in the free queue now (touching them takes them off it). Pure."""
        num_required = cdiv(num_tokens, self.block_size)
        num_held = len(self.blocks_of(request_id)) + len(new_computed_blocks)
        num_new = max(0, num_required - num_held)
        if not new_computed_blocks:
            return num_new
        return num_new + self.pool.num_free_among(new_computed_blocks)

    # ---- mutations ---------------------------------------------------------------------------
    def save_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[KVCacheBlock]
    ) -> None:
        """Take a request's hit blocks (first scheduling only). Mutates."""
        if not new_computed_blocks:
            self.req_to_blocks.setdefault(request_id, [])
            return
        blocks = self.req_to_blocks.setdefault(request_id, [])
        if blocks:
            raise RuntimeError(f"request {request_id} already holds blocks; hits come first")
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        self.num_cached_blocks[request_id] = len(new_computed_blocks)

    def allocate_new_blocks(self, request_id: str, num_tokens: int) -> list[KVCacheBlock]:
        """Grow a request's block list to cover `num_tokens` slots. Mutates."""
        blocks = self.req_to_blocks.setdefault(request_id, [])
        num_new = cdiv(num_tokens, self.block_size) - len(blocks)
        if num_new <= 0:
            return []
        new_blocks = self.pool.get_new_blocks(num_new)
        blocks.extend(new_blocks)
        return new_blocks

    def cache_blocks(
        self, request: CachingRequest, block_hashes: Sequence[bytes], num_tokens: int
    ) -> None:
        """Cache the request's full blocks among its first `num_tokens` computed tokens, up to
        the last hashed block. Mutates."""
        request_id = request.request_id
        num_cached = self.num_cached_blocks.get(request_id, 0)
        num_full = min(num_tokens // self.block_size, len(block_hashes))
        if num_full <= num_cached:
            return
        blocks = self.req_to_blocks[request_id]
        for start, end in self._runs_worth_keeping(request, num_cached, num_full):
            self.pool.cache_full_blocks(request, blocks, block_hashes, start, end, self.group)
        self.num_cached_blocks[request_id] = num_full

    def _runs_worth_keeping(
        self, request: CachingRequest, start: int, end: int
    ) -> list[tuple[int, int]]:
        """Block-index runs in `[start, end)` that a later hit can use. Pure."""
        return [(start, end)]

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        """Free blocks no future token of the request reads. Mutates (no-op by default)."""

    def free(self, request_id: str) -> None:
        """Release a request's blocks, tail first so chain ends are evicted first. Mutates."""
        blocks = self.req_to_blocks.pop(request_id, [])
        self.num_cached_blocks.pop(request_id, None)
        first = self.pool.null_prefix_len(blocks)  # nulls hold nothing to free
        self.pool.free_blocks(reversed(blocks[first:]) if first else reversed(blocks))

    # ---- helpers -----------------------------------------------------------------------------
    def _lookup(
        self, request: CachingRequest, block_hashes: Sequence[bytes], index: int
    ) -> KVCacheBlock | None:
        block = self.pool.get_cached_block(block_hashes[index], self.group.group_id)
        if block is None:
            return None
        start = index * self.block_size

        def expected():
            parent = block_hashes[index - 1] if index > 0 else b""
            return content_of(
                request, parent, start, start + self.block_size, self.group.lookahead_tokens
            )

        return block if self.pool.hit_check.accepts(block, expected) else None


class FullAttentionManager(SingleTypeManager):
    """Every token attends to every earlier one: a hit is the longest run of cached blocks."""

    def find_longest_cache_hit(self, request, block_hashes, max_length):
        num_candidates = min(max_length // self.block_size, len(block_hashes))
        hit: list[KVCacheBlock] = []
        if self.pool.hit_check.stores_content:
            for index in range(num_candidates):
                block = self._lookup(request, block_hashes, index)
                if block is None:
                    break
                hit.append(block)
            return hit
        # Trusted hashes: C-level dict probes over growing chunks (a miss at block k costs
        # O(k) probes, a full hit one pass).
        lookup = self.pool.cached_map(self.group.group_id).get
        start, chunk = 0, _FIRST_PROBE_CHUNK
        while start < num_candidates:
            end = min(num_candidates, start + chunk)
            found = list(map(lookup, block_hashes[start:end]))
            if not all(found):  # blocks are truthy: all() is faster than `None in found`
                hit += found[: found.index(None)]
                return hit
            hit += found
            start, chunk = end, chunk * 4
        return hit


class ReusingFullAttentionManager(FullAttentionManager):
    """Full attention whose blocks can be reused at divergence points (see the module
    docstring); the pool's hash map and ref counts are untouched by the lookup."""

    def cache_blocks(self, request, block_hashes, num_tokens):
        num_cached = self.num_cached_blocks.get(request.request_id, 0)
        super().cache_blocks(request, block_hashes, num_tokens)
        num_full = self.num_cached_blocks.get(request.request_id, 0)
        if num_full > num_cached:
            self.pool.note_successors(request, block_hashes, num_cached, num_full, self.group)

    def find_divergent_block(self, request, block_hashes: Sequence[bytes], index: int,
                             computed_this_step: bool = False) -> KVCacheBlock | None:
        """A cached block holding block `index` of `request` (tokens `[i * B, (i + 1) * B)`,
        same chain before it) under another successor, or None. The pool's index names the
        latest block cached with that content; it must hold the request's tokens: its hash is
        recomputed from them with the block's own successors (and, for fast hashes, its
        content compared as for a hit). `computed_this_step`: look among the blocks cached
        this step instead (they can be copied from the next step on). Touches no block,
        reference count or hash-map entry (the pool may fold its index)."""
        group_id = self.group.group_id
        start = index * self.block_size
        end = start + self.block_size
        tokens = tuple(request.all_token_ids[start:end])
        parent = block_hashes[index - 1] if index else None
        if computed_this_step:
            entry = self.pool.pending_successor_of(parent, tokens, group_id)
        else:
            entry = self.pool.successor_of(parent, tokens, group_id)
        if entry is None:
            return None
        block_hash, successors = entry
        block = self.pool.get_cached_block(block_hash, group_id)
        if block is None:
            return None
        if not computed_this_step and self.pool.noted_this_step(block_hash, index, group_id):
            return None  # cached again this step, in a block this step computes
        if type(successors) is not tuple:
            successors = (successors,)
        lookahead = self.group.lookahead_tokens
        if request.hash_with_successors(lookahead, index, successors) != block_hash:
            return None

        def expected():
            return BlockContent(b"" if parent is None else parent, tokens, successors,
                                request.hash_inputs.extra_keys(start, end + lookahead))

        return block if self.pool.hit_check.accepts(block, expected) else None


class _PartialPrefixManager(SingleTypeManager):
    """Groups that keep state only near a hit boundary: they free what falls behind, and cache
    only what a reachable boundary needs."""

    def __init__(self, spec, pool, group, retention: RetentionPolicy, num_tail_blocks: int):
        super().__init__(spec, pool, group)
        self.retention = retention
        self.num_tail_blocks = num_tail_blocks  # blocks kept before each reachable boundary

    def _runs_worth_keeping(self, request, start, end):
        if self.retention.is_dense:
            return [(start, end)]
        return runs_worth_keeping(self.retention, self.num_tail_blocks, self.block_size,
                                  start, end, request.num_prompt_tokens)

    def first_kept_block(self, num_computed_tokens: int) -> int:
        """The first block the request still reads after `num_computed_tokens` tokens (what
        `remove_skipped_blocks` keeps); a hit at that length needs the blocks from here."""
        raise NotImplementedError

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        self._release_before(request_id, self.first_kept_block(num_computed_tokens))

    def skip_caching_before(self, request_id: str, num_blocks: int) -> None:
        """Never cache the request's blocks before `num_blocks`: a KV connector loads only
        the blocks from there on, the ones before it hold nothing. Mutates."""
        if self.num_cached_blocks.get(request_id, 0) < num_blocks:
            self.num_cached_blocks[request_id] = num_blocks

    def _release_before(self, request_id: str, num_blocks_to_drop: int) -> None:
        """Replace the request's blocks [0, num_blocks_to_drop) by the null block, freeing
        them last-first (the kept tail stays cached longest). Mutates."""
        blocks = self.req_to_blocks.get(request_id)
        if not blocks:
            return
        end = min(num_blocks_to_drop, len(blocks))
        # everything before the null prefix's end was released by an earlier call
        start = self.pool.null_prefix_len(blocks)
        if start >= end:
            return
        released = blocks[start:end]  # (nulls in it, if any, are skipped by free_blocks)
        if self.released is not None:  # a connector may still snapshot what they cache
            record = self.released.setdefault(request_id, [])
            record.extend((index, block.block_id)
                          for index, block in enumerate(released, start)
                          if block.block_hash is not None and not block.is_null)
        blocks[start:end] = [self.pool.null_block] * (end - start)
        released.reverse()
        self.pool.free_blocks(released)


class SlidingWindowManager(_PartialPrefixManager):
    """A hit at h needs the `ceil((W - 1) / B)` blocks before h; older blocks are null."""

    spec: SlidingWindowSpec

    def find_longest_cache_hit(self, request, block_hashes, max_length):
        num_needed = self.spec.num_window_blocks
        num_candidates = min(max_length // self.block_size, len(block_hashes))
        null = self.pool.null_block
        if num_needed == 0:  # W == 1: the next token reads no earlier key
            return [null] * num_candidates
        run: list[KVCacheBlock] = []  # cached blocks ending at the candidate end, reversed
        for index in range(num_candidates - 1, -1, -1):
            block = self._lookup(request, block_hashes, index)
            if block is None:
                run = []
                continue
            run.append(block)
            if len(run) >= num_needed or index == 0:
                return [null] * index + run[::-1]
        return []

    def first_kept_block(self, num_computed_tokens: int) -> int:
        # the next token, at position num_computed_tokens, reads keys > its position - W
        first_needed = max(0, num_computed_tokens - self.spec.sliding_window + 1)
        return first_needed // self.block_size


class MambaManager(_PartialPrefixManager):
    """Block i holds the recurrent state after (i + 1) * B tokens; a hit must land on one."""

    spec: MambaSpec

    def find_longest_cache_hit(self, request, block_hashes, max_length):
        num_candidates = min(max_length // self.block_size, len(block_hashes))
        for index in range(num_candidates - 1, -1, -1):
            block = self._lookup(request, block_hashes, index)
            if block is not None:
                return [self.pool.null_block] * index + [block]
        return []

    def first_kept_block(self, num_computed_tokens: int) -> int:
        # only the latest checkpoint state is read to continue
        return max(0, num_computed_tokens // self.block_size - 1)


def manager_for(
    spec: KVCacheSpec,
    pool: BlockPool,
    group: GroupInfo,
    retention: RetentionPolicy,
    num_extra_tail_blocks: int,
    reuses_divergent_blocks: bool = False,
) -> SingleTypeManager:
    """The manager type for a spec type. `num_extra_tail_blocks` widens kept sliding-window
    tails (the legacy-drop fix); `reuses_divergent_blocks` picks the reusing full-attention
    manager."""
    if isinstance(spec, FullAttentionSpec):
        if reuses_divergent_blocks:
            return ReusingFullAttentionManager(spec, pool, group)
        return FullAttentionManager(spec, pool, group)
    if isinstance(spec, SlidingWindowSpec):
        return SlidingWindowManager(spec, pool, group, retention,
                                    spec.num_window_blocks + num_extra_tail_blocks)
    if isinstance(spec, MambaSpec):
        return MambaManager(spec, pool, group, retention, 1)
    raise TypeError(f"no manager for KV cache spec {type(spec).__name__}")
