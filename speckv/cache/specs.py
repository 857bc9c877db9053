"""KV cache group specs: what kind of state a group of layers keeps, and its block size.

Owns the frozen, validated description of each group. The manager for a group is chosen by the
spec's type (see `speckv.cache.single_type`), never by a flag.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FullAttentionSpec:
    block_size: int
    kind: str = "full_attention"

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")


KVCacheSpec = FullAttentionSpec
