"""KV-cache event records, as the block pool produces them.

Owns the in-process records of what entered and left the cache. They are plain data; the wire
schema (msgspec / msgpack, vLLM's layout) lives in `speckv.events` and converts from these.
A `KVEventSink` collects records between engine steps; the pool only ever appends.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

MEDIUM_GPU = "GPU"


@dataclass(frozen=True)
class BlockStored:
    """Blocks cached by one caching call of one request, in chain order.

    `token_ids` is exactly `block_size * len(block_hashes)` tokens; lookahead tokens never go
    there but into `lookahead_token_ids` (one list of `L` ids per block; None when `L == 0`).
    `extra_keys` has one entry per block covering the block plus its lookahead, untagged.
    """

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None
    extra_keys: list[list[Any] | None] | None
    group_idx: int
    lookahead_token_ids: list[list[int]] | None
    kv_cache_spec_kind: str = "full_attention"
    kv_cache_spec_sliding_window: int | None = None
    medium: str = MEDIUM_GPU


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[bytes]
    group_idx: int
    medium: str = MEDIUM_GPU


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass
class KVEventSink:
    """Collects records until the engine takes them at the end of a step."""

    events: list[KVCacheEvent] = field(default_factory=list)

    def record(self, event: KVCacheEvent) -> None:
        self.events.append(event)

    def take(self) -> list[KVCacheEvent]:
        taken, self.events = self.events, []
        return taken
