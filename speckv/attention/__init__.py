"""Paged KV cache and attention over it (backends behind a small protocol)."""

from speckv.attention.backend import (
    AttentionBackend,
    fused_kernels_available,
    get_attention_backend,
)
from speckv.attention.grouped import (
    AnyAttentionMetadata,
    GroupedAttentionMetadata,
    GroupedKVCache,
    metadata_for_layer,
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
    "AnyAttentionMetadata",
    "AttentionBackend",
    "AttentionMetadata",
    "GroupedAttentionMetadata",
    "GroupedKVCache",
    "LayerKVCache",
    "PagedKVCache",
    "SDPABackend",
    "bytes_per_block",
    "fused_kernels_available",
    "get_attention_backend",
    "metadata_for_layer",
    "num_blocks_for_budget",
    "resolve_dtype",
]
