"""The prefix cache: block pool, per-group managers, the KV cache manager."""

from speckv.cache.block import NULL_BLOCK_ID
from speckv.cache.kv_cache_manager import KVCacheManager
from speckv.cache.results import Allocation, BlockCopy, CacheHit
from speckv.cache.specs import FullAttentionSpec, MambaSpec, SlidingWindowSpec

__all__ = [
    "NULL_BLOCK_ID",
    "Allocation",
    "BlockCopy",
    "CacheHit",
    "FullAttentionSpec",
    "KVCacheManager",
    "MambaSpec",
    "SlidingWindowSpec",
]
