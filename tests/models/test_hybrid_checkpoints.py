"""State checkpoints at unit boundaries: a request continuing from a checkpoint at h computes
exactly what a cold run computes after h (fp32, bit for bit)."""

from __future__ import annotations

import torch

from speckv.models.hybrid_loader import tiny_hybrid
from tests.models.hybrid_test_utils import OneRequest


def test_checkpoint_at_h_equals_a_cold_run_cut_at_h_and_a_hit_continues_exactly():
    model = tiny_hybrid()
    ids = torch.randint(0, 128, (37,), generator=torch.Generator().manual_seed(4)).tolist()
    unit, h = 8, 32
    cold = OneRequest(model, block_size=4, unit=unit)
    cold_logits = cold.forward(ids)
    at_h = cold.states.snapshot(cold.state_block(h))
    # a run of exactly h tokens ends with the same state, bit for bit
    short = OneRequest(model, block_size=4, unit=unit)
    short.forward(ids[:h])
    for a, b in zip(at_h, short.states.snapshot(short.state_block(h))):
        assert torch.equal(a, b)
    assert at_h[1].abs().max() > 0  # the checkpoint holds a real state
    # the hit: a second request sharing cold's first h tokens of KV and the checkpoint block
    hit = OneRequest(model, block_size=4, unit=unit)
    hit.kv, hit.states = cold.kv, cold.states
    hit.kv_table = cold.kv_table[: h // 4] + list(range(200, 210))
    hit.state_table = cold.state_table[: h // unit] + [250, 251]
    hit.num_computed = h
    hit_logits = hit.forward(ids[h:])
    assert torch.equal(hit_logits, cold_logits[h:])
    for a, b in zip(cold.states.snapshot(cold.state_block(37)),
                    hit.states.snapshot(hit.state_block(37))):
        assert torch.equal(a, b)
