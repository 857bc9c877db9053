"""The KV cache plan: which KV cache groups the engine keeps and how many block ids they share.

Owns one pure computation done at start-up, before anything is allocated:

    layout      the model's groups for the configured block sizes (`kv_cache_layout`), or the
                caller's override; a drafter on a model without a full-attention group gets
                every layer in one full-attention group (its KV must never be freed)
    num_blocks  the configured count, or the KV budget over what one block id costs: the
                target's bytes per block (the model sizes its own: Gemma 4 layers of different
                shapes, a hybrid's KV + GDN state) plus the drafter's KV layers (same heads
                and head size as the target's)

Every group draws block ids from the one pool, so each group may hold at most
`blocks_per_group` of them for one request.
"""

from __future__ import annotations

from dataclasses import dataclass

from speckv.attention import bytes_per_block
from speckv.models.base import TargetModel
from speckv.models.common.kv_layout import KVCacheLayout


@dataclass(frozen=True)
class KVCachePlan:
    layout: KVCacheLayout
    num_blocks: int  # block ids in the pool, the null block included
    bytes_per_block: int  # what one block id costs: target KV (+ state) + drafter KV
    budget_bytes: int | None  # the KV budget `num_blocks` came from (None: set directly)

    @property
    def blocks_per_group(self) -> int:
        """Block ids one group can hold for one request (the pool split evenly, less null)."""
        return (self.num_blocks - 1) // self.layout.num_groups

    def token_capacity(self, block_size: int) -> int:
        """Tokens one request can hold in every group at once (prompt-length limit)."""
        return self.blocks_per_group * block_size


def plan_kv_cache(model: TargetModel, *, block_size: int, num_blocks: int | None,
                  budget_bytes: int, state_block_size: int | None, num_draft_layers: int,
                  layout: KVCacheLayout | None = None) -> KVCachePlan:
    """The plan for `model` (ValueError, naming the budget field, when it fits < 2 blocks)."""
    config = model.config
    per_block = model.kv_cache_bytes_per_block(block_size)
    if num_draft_layers:
        per_block += bytes_per_block(num_draft_layers, block_size, config.num_key_value_heads,
                                     config.head_dim, model.dtype)
    if num_blocks is None:
        num_blocks = budget_bytes // per_block
        if num_blocks < 2:  # named as the config field: the CLI shows it as its flag
            raise ValueError(f"kv_cache_memory_bytes ({budget_bytes:,} bytes) fits {num_blocks} "
                             f"KV blocks of {per_block:,} bytes; at least 2 are needed (block "
                             "0 is the null block)")
        used_budget: int | None = budget_bytes
    else:
        used_budget = None
    layout = layout or model.kv_cache_layout(block_size, state_block_size)
    if num_draft_layers and layout.draft_group is None:
        layout = layout.as_one_full_group()
    return KVCachePlan(layout, num_blocks, per_block, used_budget)
