"""Block metadata and the LRU free queue of blocks.

Owns `KVCacheBlock` (one physical block's bookkeeping) and `FreeBlockQueue` (the free blocks in
eviction order). Only `BlockPool` mutates either; everything else reads.

    head  b7  b2  b9  tail        popleft() takes b7 (least recently freed / no hash)

The queue is an `OrderedDict` (a C hash table threaded by a C linked list), so taking a block
from the middle on a cache hit is O(1) like the hand-written linked list it replaces, and the
pool's batch operations (`popleft_n`, `remove_n`, `append_n`) run their loops in C: a 128K-token
prompt frees, evicts or touches 8K blocks at a time.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

# The physical block that stands for "no KV here" (outside a sliding window, before a Mamba
# checkpoint, the padding of a block table). The pool takes it first and never frees it; every
# table, tensor and connector that needs to recognise it imports this name.
NULL_BLOCK_ID = 0

CacheKey = bytes  # block hash + 4-byte group id: the same hash in two groups is two entries


def make_cache_key(block_hash: bytes, group_id: int) -> CacheKey:
    return block_hash + group_id.to_bytes(4, "little")


def split_cache_key(key: CacheKey) -> tuple[bytes, int]:
    return key[:-4], int.from_bytes(key[-4:], "little")


@dataclass(frozen=True)
class BlockContent:
    """What a cached block's hash covers; kept only when hits must be verified (fast,
    non-cryptographic hash functions)."""

    parent_hash: bytes
    token_ids: tuple[int, ...]
    lookahead_token_ids: tuple[int, ...]
    extra_keys: Any


class KVCacheBlock:
    """One physical block. `block_hash` / `group_id` name it in the pool's hash map while it
    is cached (`block_hash` is None otherwise)."""

    __slots__ = ("block_hash", "block_id", "content", "group_id", "is_null", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: bytes | None = None
        self.group_id = 0
        self.content: BlockContent | None = None
        self.is_null = False

    @property
    def cache_key(self) -> CacheKey | None:
        """The pool's key of this block (hash + group), or None when it is not cached."""
        if self.block_hash is None:
            return None
        return make_cache_key(self.block_hash, self.group_id)

    def __repr__(self) -> str:
        key = self.block_hash.hex()[:12] if self.block_hash is not None else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, key={key})"


class FreeBlockQueue:
    """LRU queue of free blocks: O(1) append/pop/remove, and C-speed batch versions."""

    __slots__ = ("_blocks",)

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._blocks: OrderedDict[KVCacheBlock, None] = OrderedDict()
        self.append_n(list(blocks))

    @property
    def ordered(self) -> OrderedDict[KVCacheBlock, None]:
        """The queue itself, head first, for the pool's hot loops (`queue[block] = None`
        appends, `del queue[block]` removes); nothing else may use it."""
        return self._blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._blocks)

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block in self._blocks

    def count_in(self, blocks: Iterable[KVCacheBlock]) -> int:
        """How many of `blocks` are queued (a C loop)."""
        return sum(map(self._blocks.__contains__, blocks))

    def popleft(self) -> KVCacheBlock:
        try:
            return self._blocks.popitem(last=False)[0]
        except KeyError:
            raise ValueError("no free blocks left") from None

    def popleft_n(self, num_blocks: int) -> list[KVCacheBlock]:
        """The `num_blocks` blocks at the head, in order, taken off the queue."""
        blocks = self._blocks
        if num_blocks > len(blocks):
            raise ValueError(f"cannot take {num_blocks} blocks: only {len(blocks)} free")
        if num_blocks == len(blocks):
            taken = list(blocks)
            blocks.clear()
            return taken
        taken = list(islice(blocks, num_blocks))
        deque(map(blocks.__delitem__, taken), maxlen=0)  # a C loop
        return taken

    def remove(self, block: KVCacheBlock) -> None:
        try:
            del self._blocks[block]
        except KeyError:
            raise RuntimeError(f"{block} is not in the free queue") from None

    def remove_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take each of `blocks` off the queue (all must be in it)."""
        try:
            deque(map(self._blocks.__delitem__, blocks), maxlen=0)
        except KeyError as exc:
            raise RuntimeError(f"{exc.args[0]} is not in the free queue") from None

    def append(self, block: KVCacheBlock) -> None:
        """Add at the tail: evicted last."""
        if block in self._blocks:
            raise RuntimeError(f"{block} is already in the free queue")
        self._blocks[block] = None

    def append_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Add `blocks` at the tail in order (the first is evicted first)."""
        queue = self._blocks
        expected = len(queue) + len(blocks)
        for block in blocks:  # setitem in a loop measured fastest (update() is slower)
            queue[block] = None
        if len(queue) != expected:
            raise RuntimeError("a block was already in the free queue")

    def appendleft(self, block: KVCacheBlock) -> None:
        """Add at the head: reused first (blocks that hold nothing worth keeping)."""
        self.append(block)
        self._blocks.move_to_end(block, last=False)

    def appendleft_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Add `blocks` at the head so that `blocks[0]` is the new head."""
        self.append_n(blocks)
        move = self._blocks.move_to_end
        for block in reversed(blocks):
            move(block, False)

    def __iter__(self) -> Iterator[KVCacheBlock]:
        return iter(list(self._blocks))

    def check_links(self) -> None:
        """Raise if a queued block is not a free, non-null block (tests)."""
        for block in self._blocks:
            if block.is_null or block.ref_cnt != 0:
                raise AssertionError(f"{block} is in the free queue but not free")
