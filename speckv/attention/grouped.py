"""GroupedAttentionMetadata: one `AttentionMetadata` per KV cache group for one forward.

Owns the hand-off from the runner (which keeps one block table per group) to the layers (which
each read the metadata of their own group). All groups describe the same tokens at the same
positions; they differ in block tables (a sliding-window group's table has the null block where
out-of-window blocks were freed) and therefore in slot mappings.

A plain `AttentionMetadata` still works wherever a grouped one does (one group: every layer
reads it), so single-group models and the drafters' own layers are unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

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
