"""The storage behind a tier connector: the protocol a CPU pool or a directory implements.

Owns `BlockStore` (content-addressed by `BlockDescriptor.key`, pins, a checked `get`) and the
typed results of a store call. The tier connector (`tier.py`) does the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Protocol

from speckv.cache.block import CacheKey
from speckv.connectors.codec import CodecMiss
from speckv.connectors.layout import BlockLayout, BlockTensors
from speckv.connectors.metadata import BlockDescriptor


class PutOutcome(Enum):
    STORED = "stored"
    PRESENT = "present"  # the tier already holds this key
    NO_ROOM = "no_room"  # full of blocks that cannot be evicted now


@dataclass(frozen=True)
class PutResult:
    outcome: PutOutcome
    nbytes: int = 0  # bytes the tier now spends on the block (0 unless stored)
    evicted: tuple[CacheKey, ...] = ()


@dataclass(frozen=True)
class StoreUsage:
    resident_blocks: int
    resident_bytes: int
    capacity_bytes: int


class BlockStore(Protocol):
    """Where a tier keeps blocks, by `BlockDescriptor.key`. Thread-safe: the engine thread
    reads, the copy thread writes."""

    medium: str
    layout: BlockLayout

    def contains(self, key: CacheKey) -> bool: ...

    def pin(self, key: CacheKey) -> None:
        """Keep `key` from eviction (counted; it need not be present yet)."""
        ...

    def unpin(self, key: CacheKey) -> None: ...

    def get(self, block: BlockDescriptor) -> BlockTensors | CodecMiss:
        """The block's tensors (one block per segment, host memory) if the tier holds exactly
        `block`, valid until the next `get` (they may view a reused read buffer, or the
        tier's own memory, which a pin keeps). A corrupt entry is deleted before the miss
        returns. Called from the engine thread only."""
        ...

    def put(self, block: BlockDescriptor, tensors: BlockTensors) -> PutResult: ...

    def clear(self) -> list[CacheKey]:
        """Delete every unpinned block; returns their keys."""
        ...

    def usage(self) -> StoreUsage: ...
