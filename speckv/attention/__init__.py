"""Paged KV cache and attention over it (backends behind a small protocol)."""

from speckv.attention.backend import (
    AttentionBackend,
    fused_kernels_available,
    get_attention_backend,
)
from speckv.attention.kv_cache import (
    LayerKVCache,
    PagedKVCache,
    bytes_per_block,
    num_blocks_for_budget,
    resolve_dtype,
)
from speckv.attention.metadata import AttentionMetadata
from speckv.attention.sdpa import SDPABackend

__all__ = [
    "AttentionBackend",
    "AttentionMetadata",
    "LayerKVCache",
    "PagedKVCache",
    "SDPABackend",
    "bytes_per_block",
    "fused_kernels_available",
    "get_attention_backend",
    "num_blocks_for_budget",
    "resolve_dtype",
]
