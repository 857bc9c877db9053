"""The KV cache budget per group: how many blocks each KV cache group gets, and what they buy.

Owns turning a memory budget into block counts, for one pool shared by every group or one pool
per group (`KVCacheManager(specs, [n_0, n_1, ...])`), and the figures the engine reports at
start (the `serve` banner, `/metrics`): bytes per group and the longest context one request
can hold.

    shared pool     n = budget // sum_g b_g; every block id has a row in every group's
                    tensors (group g costs n * b_g) and a request's blocks of every group come
                    out of the same n
    per-group pool  the full-attention group holds the context: n_full blocks; every other
                    group g holds what a hit or a running request reads of it:

        sliding window W, block B   running: S * (ceil((W - 1) / B) + 2) + ceil(T / B)
                                    cached: a tail of t_g blocks per kept boundary, at most
                                    every block of the context
        Mamba / GDN, unit U         running: S * 3 + ceil(T / U)    (latest checkpoint, running
                                    state, the next checkpoint; a chunk of T tokens crosses
                                    ceil(T / U) more)
                                    cached: one state per kept boundary of the context

    with S = max_num_seqs, T = max_num_batched_tokens, boundaries every U (dense retention) or
    every retention interval R; so n_g = a_g + r_g * n_full, and n_full solves
    budget = n_full * b_full + sum_g (a_g + r_g * n_full) * b_g.

b_g is the bytes one block of group g costs in every layer of that group (the drafter's KV
rides on the draft group). A group that runs out evicts its own cached blocks, or the
scheduler preempts, as with one pool; the hit stays the minimum over the groups.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from speckv.attention import bytes_per_block
from speckv.cache.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec

if TYPE_CHECKING:
    from speckv.cache.retention import TailWidening
    from speckv.engine.config import CacheConfig, SchedulerConfig
    from speckv.models.base import TargetModel
    from speckv.models.common.kv_layout import KVCacheLayout

MIB = 1 << 20


@dataclass(frozen=True)
class GroupBudget:
    kind: str
    block_size: int
    bytes_per_block: int  # one block id of this group, every layer of the group
    num_blocks: int  # rows of this group's tensors (null block included)

    @property
    def nbytes(self) -> int:
        return self.bytes_per_block * self.num_blocks


@dataclass(frozen=True)
class KVBudget:
    groups: tuple[GroupBudget, ...]
    per_group_pools: bool
    context_tokens: int  # the longest prompt + output one request can hold

    @property
    def nbytes(self) -> int:
        return sum(group.nbytes for group in self.groups)

    @property
    def num_blocks(self) -> int | tuple[int, ...]:
        """What `KVCacheManager` takes: one count (shared) or one per group."""
        if self.per_group_pools:
            return tuple(group.num_blocks for group in self.groups)
        return self.groups[0].num_blocks

    def describe(self) -> str:
        """e.g. `per-group KV pools: full_attention 2,305 x 16 tok (36.0 MiB), mamba 77 x 544
        tok (420.0 MiB); 456.0 MiB in all, 36,864 tokens of context` (bytes left out when the
        model does not split them per group)."""
        known = all(g.bytes_per_block for g in self.groups)
        parts = [f"{g.kind} {g.num_blocks:,} x {g.block_size} tok"
                 + (f" ({g.nbytes / MIB:,.1f} MiB)" if known else "") for g in self.groups]
        pools = "per-group KV pools" if self.per_group_pools else "one shared KV pool"
        total = f"{self.nbytes / MIB:,.1f} MiB in all, " if known else ""
        return f"{pools}: {', '.join(parts)}; {total}{self.context_tokens:,} tokens of context"


def _full_group(specs: Sequence[KVCacheSpec]) -> int | None:
    return next((g for g, spec in enumerate(specs) if isinstance(spec, FullAttentionSpec)),
                None)


def shared_budget(specs: Sequence[KVCacheSpec], group_bytes: Sequence[int],
                  num_blocks: int, block_size: int | None = None) -> KVBudget:
    """One pool of `num_blocks` every group draws from: every group has a row per block id.
    The context is what the engine admits: the pool split evenly over the groups, in blocks
    of `block_size` tokens (default: the smallest group block)."""
    groups = tuple(GroupBudget(spec.kind, spec.block_size, b, num_blocks)
                   for spec, b in zip(specs, group_bytes))
    size = block_size or min(spec.block_size for spec in specs)
    context = (num_blocks - 1) // len(specs) * size
    return KVBudget(groups, False, context)


def per_group_budget(specs: Sequence[KVCacheSpec], group_bytes: Sequence[int],
                     memory_bytes: int, alignment_tokens: int, max_num_seqs: int,
                     max_num_batched_tokens: int, retention_interval: int | None = None,
                     extra_tail_blocks: int = 0) -> KVBudget | None:
    """Each group's own pool out of `memory_bytes` (the module docstring); None when the
    layout has no full-attention group (nothing holds the context) or no group that keeps only
    part of the prefix (nothing to save)."""
    full = _full_group(specs)
    if full is None or all(isinstance(spec, FullAttentionSpec) for spec in specs):
        return None
    seqs, chunk = max_num_seqs, max_num_batched_tokens
    full_block = specs[full].block_size
    # boundaries a cached context of C tokens keeps a tail / state at: every U or every R
    interval = retention_interval if retention_interval else alignment_tokens
    fixed, rate = [], []  # n_g = fixed + rate * n_full, per group
    for g, spec in enumerate(specs):
        if isinstance(spec, SlidingWindowSpec):
            window = spec.num_window_blocks
            tail = window + extra_tail_blocks
            fixed.append(1 + seqs * (window + 2) + -(-chunk // spec.block_size))
            rate.append(min(full_block / spec.block_size, full_block * tail / interval))
        elif isinstance(spec, MambaSpec):
            fixed.append(1 + seqs * 3 + -(-chunk // spec.block_size))
            rate.append(full_block / interval)
        elif g == full:
            fixed.append(0)
            rate.append(1.0)
        else:  # another full-attention group holds the context too
            fixed.append(0)
            rate.append(full_block / spec.block_size)
    fixed_bytes = sum(a * b for a, b in zip(fixed, group_bytes))
    per_full_block = sum(r * b for r, b in zip(rate, group_bytes))
    num_full = int((memory_bytes - fixed_bytes) // per_full_block)
    if num_full < 2:
        return None
    counts = [max(2, int(a + r * num_full)) for a, r in zip(fixed, rate)]
    # the fixed parts fit by construction; the rounding above may not: trim the full group
    while sum(n * b for n, b in zip(counts, group_bytes)) > memory_bytes and counts[full] > 2:
        counts[full] -= 1
    groups = tuple(GroupBudget(spec.kind, spec.block_size, b, n)
                   for spec, b, n in zip(specs, group_bytes, counts))
    return KVBudget(groups, True, (counts[full] - 1) * full_block)


def plan_kv_budget(model: TargetModel, layout: KVCacheLayout, num_blocks: int,
                   cache: CacheConfig, scheduler: SchedulerConfig, *, num_draft_layers: int,
                   retention_interval: int | None, tail_widening: TailWidening,
                   speculates: bool) -> KVBudget:
    """Blocks per group. A configured `num_blocks`, a model that does not split its block bytes
    per group (Gemma 4) or a layout of full attention only: one shared pool of `num_blocks`
    (the KV cache plan's). A budget over a hybrid layout (sliding window, GDN state): a pool
    per group (the module docstring)."""
    config = model.config
    group_bytes = model.kv_cache_group_bytes(layout)
    if group_bytes is not None and layout.draft_group is not None and num_draft_layers:
        group_bytes = list(group_bytes)
        group_bytes[layout.draft_group] += bytes_per_block(
            num_draft_layers, cache.block_size, config.num_key_value_heads, config.head_dim,
            model.dtype)
    specs = layout.specs
    if cache.num_blocks is None and group_bytes is not None:
        unit = math.lcm(*(spec.block_size for spec in specs))
        extra = max((tail_widening.extra_blocks(unit, spec.block_size) for spec in specs
                     if isinstance(spec, SlidingWindowSpec)), default=0)
        budget = per_group_budget(specs, group_bytes, cache.kv_cache_memory_bytes, unit,
                                  scheduler.max_num_seqs, scheduler.max_num_batched_tokens,
                                  retention_interval, extra if speculates else 0)
        if budget is not None:
            return budget
    return shared_budget(specs, group_bytes or [0] * len(specs), num_blocks, cache.block_size)
