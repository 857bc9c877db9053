"""KVCacheLayout: the KV cache groups a model declares, and which layers each group holds.

Owns the typed answer to "what state does this model keep per block id": a tuple of groups,
each a `KVCacheSpec` (full attention, sliding window W, Mamba / linear-attention state) with
the indices of the layers that keep that kind of state. The engine builds its
`KVCacheManager` from `layout.specs` (one manager per group, the alignment unit from their
block sizes), the runner keeps one block table per group and builds one `AttentionMetadata`
per group; each layer reads the metadata of its group (`GroupedAttentionMetadata`).

    group g:  spec (what a hit needs, the block size)  +  layer_indices (who reads its blocks)

Every group draws block ids from the one pool; a block id held by group g addresses state of
group g's layers only. A drafter (EAGLE/EAGLE3/MTP) has full-attention layers: its KV follows
the block table of `draft_group` (the first full-attention group), so it lives as long as a
full-attention block does; a model without a full-attention group cannot host one.

A Mamba / GDN state group fits the same shape: `MambaSpec(block_size)` plus the state layers'
indices; how a model keeps its state per block id is the model's business (its cache object).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from speckv.cache.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec


@dataclass(frozen=True)
class KVCacheGroup:
    spec: KVCacheSpec
    layer_indices: tuple[int, ...]  # model layer indices whose state uses this group's blocks

    def __post_init__(self) -> None:
        if not self.layer_indices:
            raise ValueError("a KV cache group needs at least one layer")


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]

    def __post_init__(self) -> None:
        if not self.groups:
            raise ValueError("a model needs at least one KV cache group")
        seen: set[int] = set()
        for group in self.groups:
            overlap = seen & set(group.layer_indices)
            if overlap:
                raise ValueError(f"layers {sorted(overlap)} are in two KV cache groups")
            seen.update(group.layer_indices)

    @property
    def specs(self) -> list[KVCacheSpec]:
        """One spec per group, in group order (what `KVCacheManager` takes)."""
        return [group.spec for group in self.groups]

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def layer_to_group(self) -> dict[int, int]:
        """Layer index -> group index."""
        return {layer: g for g, group in enumerate(self.groups) for layer in group.layer_indices}

    @property
    def draft_group(self) -> int | None:
        """The group whose block table addresses a drafter's KV: the first full-attention
        group (None: the model has none, so no EAGLE/MTP drafter can run on it)."""
        for g, group in enumerate(self.groups):
            if isinstance(group.spec, FullAttentionSpec):
                return g
        return None

    def as_one_full_group(self) -> KVCacheLayout:
        """Every layer in one full-attention group: what a drafter needs on a model without
        full-attention layers (e.g. Mistral-style all-sliding). Sliding layers keep their
        window in the attention mask; only no block is freed behind it."""
        if any(isinstance(spec, MambaSpec) for spec in self.specs):
            raise ValueError("a model with Mamba state groups has no full-attention form")
        layers = tuple(sorted(self.layer_to_group))
        return KVCacheLayout((KVCacheGroup(FullAttentionSpec(self.specs[0].block_size),
                                           layers),))

    def describe(self) -> str:
        """e.g. `full:16 x2 layers, swa(W=32):16 x4 layers`."""
        parts = []
        for group in self.groups:
            spec = group.spec
            if isinstance(spec, SlidingWindowSpec):
                kind = f"swa(W={spec.sliding_window})"
            elif isinstance(spec, MambaSpec):
                kind = "mamba"
            else:
                kind = "full"
            parts.append(f"{kind}:{spec.block_size} x{len(group.layer_indices)} layers")
        return ", ".join(parts)


def attention_layout(layer_windows: Sequence[int | None], block_size: int) -> KVCacheLayout:
    """The layout of an attention-only model from each layer's sliding window (None: full):
    one full-attention group (if any full layer) first, then one group per window size."""
    full = tuple(i for i, w in enumerate(layer_windows) if w is None)
    groups: list[KVCacheGroup] = []
    if full:
        groups.append(KVCacheGroup(FullAttentionSpec(block_size), full))
    for window in sorted({w for w in layer_windows if w is not None}):
        layers = tuple(i for i, w in enumerate(layer_windows) if w == window)
        groups.append(KVCacheGroup(SlidingWindowSpec(block_size, window), layers))
    return KVCacheLayout(tuple(groups))


def make_layout_kv_cache(model, layout: KVCacheLayout, num_blocks: int | Sequence[int]):
    """The paged KV of `model` for `layout`: the model's own `make_kv_cache` when every group
    has one block size and one block count (one tensor for all layers), else a
    `GroupedKVCache` with one `PagedKVCache` per group (its block size, its block count, its
    layers). A model with state groups (Mamba) provides `make_layout_kv_cache(layout,
    num_blocks)` itself (the attention group's count; its states are sized apart).
    `num_blocks`: one count for a shared pool, or one per group (per-group pools)."""
    counts = ([num_blocks] * layout.num_groups if isinstance(num_blocks, int)
              else list(num_blocks))
    if hasattr(model, "make_layout_kv_cache"):
        attention = [n for n, spec in zip(counts, layout.specs)
                     if not isinstance(spec, MambaSpec)]
        return model.make_layout_kv_cache(layout, attention[0] if attention else counts[0])
    sizes = {spec.block_size for spec in layout.specs}
    if len(sizes) == 1 and len(set(counts)) == 1:
        return model.make_kv_cache(counts[0], sizes.pop())
    from speckv.attention import GroupedKVCache, PagedKVCache

    config = model.config
    caches, slots = [], {}
    for g, group in enumerate(layout.groups):
        if isinstance(group.spec, MambaSpec):
            raise ValueError("Mamba state groups need the model's make_layout_kv_cache")
        caches.append(PagedKVCache(len(group.layer_indices), counts[g], group.spec.block_size,
                                   config.num_key_value_heads, config.head_dim, model.dtype,
                                   model.device))
        slots.update({layer: (g, local) for local, layer in enumerate(group.layer_indices)})
    return GroupedKVCache(caches, slots)
