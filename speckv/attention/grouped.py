"""GroupedAttentionMetadata: one `AttentionMetadata` per KV cache group for one forward.

Owns the hand-off from the runner (which keeps one block table per group) to the layers (which
each read the metadata of their own group). All groups describe the same tokens at the same
positions; they differ in block tables (a sliding-window group's table has the null block where
out-of-window blocks were freed) and therefore in slot mappings.

A plain `AttentionMetadata` still works wherever a grouped one does (one group: every layer
reads it), so single-group models and the drafters' own layers are unchanged.

Also `GroupedKVCache`: the paged KV when groups differ in block size (e.g. full attention in
blocks of 32, sliding window in blocks of 16), one `PagedKVCache` per group.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from speckv.attention.kv_cache import LayerKVCache, PagedKVCache
from speckv.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class GroupedAttentionMetadata:
    groups: tuple[AttentionMetadata, ...]  # one per KV cache group, in group order
    layer_to_group: Mapping[int, int]  # model layer index -> group index

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("GroupedAttentionMetadata needs at least one group")

    def for_layer(self, layer_idx: int) -> AttentionMetadata:
        return self.groups[self.layer_to_group[layer_idx]]

    def positions(self) -> torch.Tensor:
        """[num_tokens] int64, the same for every group."""
        return self.groups[0].positions()


AnyAttentionMetadata = AttentionMetadata | GroupedAttentionMetadata


def metadata_for_layer(metadata: AnyAttentionMetadata, layer_idx: int) -> AttentionMetadata:
    """The metadata a layer reads: its group's, or the one metadata of a single-group forward."""
    if isinstance(metadata, GroupedAttentionMetadata):
        return metadata.for_layer(layer_idx)
    return metadata


class GroupedKVCache:
    """Paged KV for models whose KV cache groups have different block sizes: one
    `PagedKVCache` per group (its own block size, only its layers), addressed by MODEL layer
    index like a `PagedKVCache`. (Groups of one block size share one `PagedKVCache`.)"""

    def __init__(self, caches: Sequence[PagedKVCache],
                 layer_to_slot: Mapping[int, tuple[int, int]]) -> None:
        self.caches = tuple(caches)  # one per group
        self._slots = dict(layer_to_slot)  # model layer -> (group, layer index in its cache)
        self.num_layers = len(self._slots)
        self.num_blocks = self.caches[0].num_blocks
        self.dtype = self.caches[0].dtype
        self.device = self.caches[0].device

    @property
    def nbytes(self) -> int:
        return sum(cache.nbytes for cache in self.caches)

    def copy_blocks(self, src_block_ids: torch.Tensor, dst_block_ids: torch.Tensor) -> None:
        """As `PagedKVCache.copy_blocks`, in every group's cache (a block id belongs to one
        group; the others hold nothing at it)."""
        for cache in self.caches:
            cache.copy_blocks(src_block_ids, dst_block_ids)

    def layer(self, layer_idx: int) -> LayerKVCache:
        group, local = self._slots[layer_idx]
        return self.caches[group].layer(local)
