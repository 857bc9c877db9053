"""Reading a request's KV per KV cache group from a real engine, to compare a hit with a cold run.

Owns `GroupKV` (what one request's blocks hold: per group, the KV of that group's layers in
the blocks the group keeps, plus the drafter's KV on the draft group) and `read_group_kv`.
A sliding-window group keeps only the blocks the next token can see (the rest are the null
block in the manager's table); a hit is compared block by block over what the hit holds.

    target[g]: [len(layers of g), 2 (k, v), num_kept_blocks, block_size, kv_heads, head_dim]
    draft:     [draft_layers, 2, num_blocks, block_size, kv_heads, head_dim] (draft group)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GroupKV:
    block_indices: tuple[tuple[int, ...], ...]  # per group: logical block indices read
    target: tuple[torch.Tensor, ...]  # per group, see the module docstring
    draft: torch.Tensor | None  # the drafter's KV over the draft group's blocks (None: none)


def read_group_kv(engine, block_tables: Sequence[Sequence[int]], num_tokens: int,
                  block_indices: Sequence[Sequence[int]] | None = None) -> GroupKV:
    """The KV in the first `num_tokens // B` blocks of each group's table: every non-null
    block, or the logical `block_indices` given per group (e.g. the ones a hit holds)."""
    layout = engine.layout
    cache = engine.runner.kv_cache  # PagedKVCache or GroupedKVCache: read by layer
    indices_out, target = [], []
    for g, group in enumerate(layout.groups):
        size = group.spec.block_size
        table = list(block_tables[g])[: num_tokens // size]
        if block_indices is None:
            indices = tuple(i for i, block in enumerate(table) if block != 0)
        else:
            indices = tuple(block_indices[g])
        blocks = [table[i] for i in indices]
        index = torch.tensor(blocks, dtype=torch.long)
        target.append(torch.stack([
            torch.stack([cache.layer(i).key[index], cache.layer(i).value[index]])
            for i in group.layer_indices]))
        indices_out.append(indices)
    draft = None
    proposer_cache = engine.proposer.kv_cache if engine.proposer is not None else None
    if proposer_cache is not None and layout.draft_group is not None:
        g = layout.draft_group
        blocks = [list(block_tables[g])[i] for i in indices_out[g]]
        draft = proposer_cache.storage[:, :, blocks].clone()
    return GroupKV(tuple(indices_out), tuple(target), draft)


def max_abs_diff(a: GroupKV, b: GroupKV) -> tuple[float, float]:
    """(target, draft) max |a - b| over the blocks both read (same indices required)."""
    if a.block_indices != b.block_indices:
        raise ValueError(f"different blocks: {a.block_indices} vs {b.block_indices}")
    target = max((float((x.float() - y.float()).abs().max()) if x.numel() else 0.0)
                 for x, y in zip(a.target, b.target))
    draft = 0.0
    if a.draft is not None and b.draft is not None and a.draft.numel():
        draft = float((a.draft.float() - b.draft.float()).abs().max())
    return target, draft
