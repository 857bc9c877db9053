"""The CPU offload tier: a bounded LRU pool of host blocks behind the tier connector.

Owns the CPU tier's sizing (`--kv-offload-gib`, GiB of host memory, target + draft KV of every
layer per block) and `NoLookaheadOffloadConnector`, the same tier declaring no lookahead
capability: with it the engine falls back to legacy hashes with the last-block drop, and the
tier follows the drop too (lookup and store leave out the unverified last block).
"""

from __future__ import annotations

from speckv.connectors.base import MEDIUM_CPU
from speckv.connectors.host_pool import HostBlockPool, capacity_blocks_for
from speckv.connectors.layout import DeviceKV
from speckv.connectors.rules import ConnectorMode
from speckv.connectors.store import BlockStore
from speckv.connectors.tier import DEFAULT_MAX_PENDING_BLOCKS, TierConnector

DEFAULT_OFFLOAD_GIB = 4.0


class OffloadConnector(TierConnector):
    medium = MEDIUM_CPU

    def __init__(self, size_gib: float = DEFAULT_OFFLOAD_GIB, *, name: str = "offload",
                 max_pending_blocks: int = DEFAULT_MAX_PENDING_BLOCKS) -> None:
        if not size_gib > 0:
            raise ValueError(f"--kv-offload-gib must be > 0, got {size_gib}")
        super().__init__(name, max_pending_blocks)
        self.size_gib = size_gib

    def _make_lane(self, index: int, share: float) -> TierConnector:
        return OffloadConnector(self.size_gib * share, name=f"{self.name}/g{index}",
                                max_pending_blocks=self.max_pending_blocks)

    def _open_store(self, kv: DeviceKV, mode: ConnectorMode) -> BlockStore:
        capacity = capacity_blocks_for(self.size_gib, kv.layout)
        return HostBlockPool(kv.layout, capacity, pin_memory=kv.device.type == "cuda")


class NoLookaheadOffloadConnector(OffloadConnector):
    """A CPU tier that does not declare the lookahead capability (the fallback's proof)."""

    def __init__(self, size_gib: float = DEFAULT_OFFLOAD_GIB, *,
                 name: str = "offload-nolookahead",
                 max_pending_blocks: int = DEFAULT_MAX_PENDING_BLOCKS) -> None:
        super().__init__(size_gib, name=name, max_pending_blocks=max_pending_blocks)

    @property
    def supports_lookahead_block_hashes(self) -> bool:
        return False
