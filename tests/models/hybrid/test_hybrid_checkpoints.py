"""State checkpoints at unit boundaries: a request continuing from a checkpoint at h computes
what a cold run computes after h: bit for bit against a cold run cut at h (the same
computation on the same shapes), within fp32 rounding against a cold run in one forward."""

from __future__ import annotations

import pytest
import torch

from speckv.models.hybrid.loader import tiny_hybrid
from tests.models.hybrid.hybrid_test_utils import OneRequest

# fp32 rounding of one forward over a different number of rows: CPU GEMM kernels block a
# 5-row and a 37-row matmul differently (seen: 3e-6 on logits of magnitude ~4)
ROUNDING = {"atol": 2e-5, "rtol": 1e-5}


def _hit_from(source: OneRequest, h: int, unit: int) -> OneRequest:
    """A second request sharing `source`'s first h tokens of KV and its checkpoint block."""
    hit = OneRequest(source.model, block_size=4, unit=unit)
    hit.kv, hit.states = source.kv, source.states
    hit.kv_table = source.kv_table[: h // 4] + list(range(200, 210))
    hit.state_table = source.state_table[: h // unit] + [250, 251]
    hit.num_computed = h
    return hit


@pytest.mark.exactness
def test_checkpoint_at_h_equals_a_cold_run_cut_at_h_and_a_hit_continues_exactly():
    model = tiny_hybrid()
    ids = torch.randint(0, 128, (37,), generator=torch.Generator().manual_seed(4)).tolist()
    unit, h = 8, 32
    # the cold run cut at h: 32 tokens, then 5; the hit reads the bytes its first forward wrote
    cut = OneRequest(model, block_size=4, unit=unit)
    cut.forward(ids[:h])
    at_h = cut.states.snapshot(cut.state_block(h))
    assert at_h[1].abs().max() > 0  # the checkpoint holds a real state
    hit = _hit_from(cut, h, unit)
    hit_logits = hit.forward(ids[h:])  # 5 rows, like the cut run's second forward below
    for a, b in zip(at_h, cut.states.snapshot(cut.state_block(h))):
        assert torch.equal(a, b)  # the hit did not write into the checkpoint it read
    cut_logits = cut.forward(ids[h:])
    assert torch.equal(hit_logits, cut_logits)  # same computation, same shapes: bit for bit
    for a, b in zip(cut.states.snapshot(cut.state_block(37)),
                    hit.states.snapshot(hit.state_block(37))):
        assert torch.equal(a, b)
    # a cold run in one forward of 37 rows: the same values up to fp32 rounding, both for the
    # checkpoint it writes at h and for the continuation a hit on it computes
    cold = OneRequest(model, block_size=4, unit=unit)
    cold_logits = cold.forward(ids)
    for a, b in zip(cold.states.snapshot(cold.state_block(h)), at_h):
        torch.testing.assert_close(a, b, **ROUNDING)
    torch.testing.assert_close(_hit_from(cold, h, unit).forward(ids[h:]), cold_logits[h:],
                               **ROUNDING)
    torch.testing.assert_close(cut_logits, cold_logits[h:], **ROUNDING)


@pytest.mark.exactness
def test_batched_single_token_decodes_equal_one_by_one():
    """Several requests decoding one token each run as one batch in the GDN layers; each gets
    what it gets decoding alone (outputs and the state written to its block)."""
    from speckv.attention import AttentionMetadata
    from speckv.models.hybrid.model import plan_for

    model = tiny_hybrid()
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 128, (n,), generator=gen).tolist() for n in (5, 8, 13)]
    runs = [OneRequest(model, block_size=4, unit=8) for _ in prompts]
    for run, prompt in zip(runs, prompts):
        run.forward(prompt)
    alone = [run.forward([7]) for run in runs]  # one by one: the per-request path
    states_alone = [run.states.snapshot(run.state_block(run.num_computed)) for run in runs]
    # the same decodes, batched, from copies of the caches before that decode
    batch = [OneRequest(model, block_size=4, unit=8) for _ in prompts]
    for run, prompt in zip(batch, prompts):
        run.forward(prompt)
    kv, states = batch[0].kv, batch[0].states  # move all three onto one cache
    for i, run in enumerate(batch[1:], 1):
        offset = 40 * i
        kv.storage[:, :, offset + 1: offset + 5] = run.kv.storage[:, :, 1:5]
        for t in range(2):
            states.conv[:, 200 + 10 * i + t] = run.states.conv[:, run.state_table[t]]
            states.recurrent[:, 200 + 10 * i + t] = run.states.recurrent[:, run.state_table[t]]
        run.kv_table = list(range(offset + 1, offset + 6))
        run.state_table = [200 + 10 * i, 200 + 10 * i + 1]
    seq = [len(p) + 1 for p in prompts]
    tables = [run.kv_table for run in batch]
    md = AttentionMetadata.build([1, 1, 1], seq, tables, 4)
    plan = plan_for(states, [1, 1, 1], seq, [run.state_table for run in batch], 8)
    with torch.inference_mode():
        out = model(torch.tensor([7, 7, 7]), md.positions(), kv, md, state=plan)
    logits = model.compute_logits(out.hidden_states)
    for i, run in enumerate(batch):
        torch.testing.assert_close(logits[i], alone[i][0], atol=1e-5, rtol=0)
        block = run.state_table[(seq[i] - 1) // 8]
        for a, b in zip(states.snapshot(block), states_alone[i]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
