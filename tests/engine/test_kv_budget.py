"""The KV budget per group: one shared pool versus a pool per group, and what each buys."""

from __future__ import annotations

import pytest

from speckv.cache.specs import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from speckv.engine.kv_budget import per_group_budget, shared_budget

MIB = 1 << 20


def test_a_gdn_state_pool_follows_checkpoints_and_running_requests():
    specs = [FullAttentionSpec(16), MambaSpec(544)]
    group_bytes = [49_152, 286_720]  # one block of the attention layers, one state
    budget = per_group_budget(specs, group_bytes, 512 * MIB, 544, max_num_seqs=8,
                              max_num_batched_tokens=2048)
    full, state = budget.groups
    # running: 8 requests x 3 states + ceil(2048 / 544) chunk crossings + the null block
    fixed = 1 + 8 * 3 + 4
    assert state.num_blocks == fixed + int(full.num_blocks * 16 / 544)
    assert budget.nbytes <= 512 * MIB < budget.nbytes + full.bytes_per_block + state.bytes_per_block
    before = shared_budget(specs, group_bytes, 512 * MIB // sum(group_bytes), 16)
    assert before.groups[1].nbytes > 0.8 * 512 * MIB  # the state took most of the budget
    assert budget.context_tokens > 8 * before.context_tokens
    assert budget.num_blocks == (full.num_blocks, state.num_blocks)
    assert before.num_blocks == before.groups[0].num_blocks


@pytest.mark.parametrize("retention,rate", [(None, 1.0), (512, 16 * 8 / 512)])
def test_a_sliding_window_pool_keeps_tails_at_kept_boundaries(retention, rate):
    specs = [FullAttentionSpec(16), SlidingWindowSpec(16, 128)]
    budget = per_group_budget(specs, [1000, 5000], 100 * MIB, 16, max_num_seqs=4,
                              max_num_batched_tokens=256, retention_interval=retention)
    full, window = budget.groups
    # ceil(127 / 16) = 8 window blocks: 4 requests x (8 + 2) + 256 / 16 chunk blocks + null
    assert window.num_blocks == 1 + 4 * 10 + 16 + int(rate * full.num_blocks)


def test_layouts_without_a_partial_group_or_a_full_group_keep_one_pool():
    assert per_group_budget([FullAttentionSpec(16)], [1], MIB, 16, 4, 64) is None
    assert per_group_budget([SlidingWindowSpec(16, 64), MambaSpec(32)], [1, 1], MIB, 32,
                            4, 64) is None
