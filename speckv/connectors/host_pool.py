"""A bounded pool of KV blocks in host memory, LRU, content-addressed by (block hash, group).

Owns preallocated host tensors (one per segment, `[capacity, *block_shape]`; pinned when asked,
for fast copies to a GPU), the key → slot map in least-recently-used order, and the pin counts
that keep blocks being loaded from eviction. Each entry keeps its `BlockDescriptor` as its
header, and `get` serves a block only to a request whose descriptor equals it.

Thread-safe: the engine thread reads (`contains`, `get`, `pin`), the copy thread writes (`put`).
A put reserves its slot under the lock, copies outside it, and publishes the entry under the
lock again, so readers never see a half-written block.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from speckv.cache.block import CacheKey
from speckv.connectors.codec import CodecMiss, MissReason
from speckv.connectors.layout import BlockLayout, BlockTensors
from speckv.connectors.lru import PinnedLru
from speckv.connectors.metadata import BlockDescriptor
from speckv.connectors.store import PutOutcome, PutResult, StoreUsage

GIB = 1 << 30


def capacity_blocks_for(size_gib: float, layout: BlockLayout, what: str = "--kv-offload-gib"
                        ) -> int:
    """Whole blocks of `layout` in `size_gib` GiB; a clear error if not even one fits."""
    if not size_gib > 0:
        raise ValueError(f"{what} must be > 0, got {size_gib}")
    blocks = int(size_gib * GIB) // layout.nbytes
    if blocks < 1:
        raise ValueError(
            f"{what} {size_gib} GiB holds no whole KV block of {layout.nbytes} bytes "
            f"(target + draft, every layer); give at least {layout.nbytes / GIB:.6f}"
        )
    return blocks


@dataclass
class _Entry:
    slot: int
    block: BlockDescriptor


class HostBlockPool:
    medium = "CPU"

    def __init__(self, layout: BlockLayout, capacity_blocks: int, pin_memory: bool = False
                 ) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.layout = layout
        self.capacity_blocks = capacity_blocks
        pin = pin_memory and torch.cuda.is_available()
        # [capacity, layers, 2, block_size, kv_heads, head_dim] per segment
        self._data = tuple(
            torch.empty((capacity_blocks, *segment.block_shape), dtype=segment.torch_dtype,
                        pin_memory=pin)
            for segment in layout.segments
        )
        self._lock = threading.Lock()
        self._entries: PinnedLru[_Entry] = PinnedLru()
        self._free_slots = list(range(capacity_blocks - 1, -1, -1))
        self._reserved: set[CacheKey] = set()  # being written by a put

    def contains(self, key: CacheKey) -> bool:
        with self._lock:
            return key in self._entries

    def pin(self, key: CacheKey) -> None:
        with self._lock:
            self._entries.pin(key)

    def unpin(self, key: CacheKey) -> None:
        with self._lock:
            self._entries.unpin(key)

    def get(self, block: BlockDescriptor) -> BlockTensors | CodecMiss:
        with self._lock:
            entry = self._entries.get(block.key)
            if entry is None:
                return CodecMiss(MissReason.NOT_FOUND)
            self._entries.touch(block.key)
            if entry.block != block:
                return CodecMiss(MissReason.BLOCK_MISMATCH, "a different block under this key")
            return tuple(data[entry.slot] for data in self._data)

    def put(self, block: BlockDescriptor, tensors: BlockTensors) -> PutResult:
        self.layout.check_block(tensors)
        key = block.key
        with self._lock:
            if key in self._entries or key in self._reserved:
                self._entries.touch(key)
                return PutResult(PutOutcome.PRESENT)
            evicted: tuple[CacheKey, ...] = ()
            if self._free_slots:
                slot = self._free_slots.pop()
            else:
                victim = next(self._entries.unpinned(), None)
                if victim is None:
                    return PutResult(PutOutcome.NO_ROOM)
                self._entries.pop(victim[0])
                slot = victim[1].slot
                evicted = (victim[0],)
            self._reserved.add(key)
        for data, tensor in zip(self._data, tensors):
            data[slot].copy_(tensor)
        with self._lock:
            self._reserved.discard(key)
            self._entries.add(key, _Entry(slot, block))
        return PutResult(PutOutcome.STORED, self.layout.nbytes, evicted)

    def clear(self) -> list[CacheKey]:
        with self._lock:
            deleted = self._entries.take_unpinned()
            self._free_slots.extend(entry.slot for _, entry in deleted)
        return [key for key, _ in deleted]

    def usage(self) -> StoreUsage:
        with self._lock:
            resident = len(self._entries)
        return StoreUsage(resident, resident * self.layout.nbytes,
                          self.capacity_blocks * self.layout.nbytes)
