"""Block metadata and the LRU free queue threaded through it.

Owns `KVCacheBlock` (one physical block's bookkeeping) and `FreeBlockQueue` (a doubly linked
list through the blocks themselves, so a cache hit removes a block from the middle in O(1)).
Only `BlockPool` mutates either; everything else reads.

    head ⇄ b7 ⇄ b2 ⇄ b9 ⇄ tail        popleft() takes b7 (least recently freed / no hash)
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

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
    __slots__ = ("block_id", "cache_key", "content", "is_null", "next_free", "prev_free",
                 "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.cache_key: CacheKey | None = None
        self.content: BlockContent | None = None
        self.is_null = False
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        key = self.cache_key.hex()[:12] if self.cache_key else None
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, key={key})"


class FreeBlockQueue:
    """Doubly linked LRU list of free blocks with sentinel ends. O(1) append/pop/remove."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Add at the tail: evicted last."""
        self._link_after(self._tail.prev_free, block)

    def appendleft(self, block: KVCacheBlock) -> None:
        """Add at the head: reused first (blocks that hold nothing worth keeping)."""
        self._link_after(self._head, block)

    def _link_after(self, prev: KVCacheBlock | None, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise RuntimeError(f"{block} is already in the free queue")
        assert prev is not None and prev.next_free is not None
        nxt = prev.next_free
        prev.next_free = block
        block.prev_free = prev
        block.next_free = nxt
        nxt.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free

    def check_links(self) -> None:
        """Raise if forward and backward links disagree or the count is off (tests)."""
        count = 0
        prev = self._head
        block = self._head.next_free
        while block is not self._tail:
            if block is None or block.prev_free is not prev:
                raise AssertionError("free queue links are broken")
            count += 1
            prev, block = block, block.next_free
        if self._tail.prev_free is not prev or count != self.num_free_blocks:
            raise AssertionError(
                f"free queue holds {count} blocks but counts {self.num_free_blocks}"
            )
