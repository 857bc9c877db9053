"""The gated delta rule kernels: chunked == recurrent, states chain, conv state carries."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from speckv.attention.gated_delta import (
    causal_conv1d,
    chunk_gated_delta_rule,
    recurrent_gated_delta_rule,
)


def _inputs(t: int, hk: int = 2, hv: int = 4, dk: int = 8, dv: int = 6, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(1, t, hk, dk, generator=gen)
    k = torch.randn(1, t, hk, dk, generator=gen)
    v = torch.randn(1, t, hv, dv, generator=gen)
    g = -F.softplus(torch.randn(1, t, hv, generator=gen))
    beta = torch.rand(1, t, hv, generator=gen)
    return q, k, v, g, beta


def test_chunked_equals_recurrent_with_and_without_initial_state():
    q, k, v, g, beta = _inputs(150)
    out_c, state_c = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64)
    out_r, state_r = recurrent_gated_delta_rule(q, k, v, g, beta)
    torch.testing.assert_close(out_c, out_r, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(state_c, state_r, atol=1e-5, rtol=1e-4)
    # continuing from the state after 70 tokens gives the same tail
    _, mid = chunk_gated_delta_rule(*(x[:, :70] for x in (q, k, v, g, beta)))
    tail, end = chunk_gated_delta_rule(*(x[:, 70:] for x in (q, k, v, g, beta)), mid)
    torch.testing.assert_close(tail, out_r[:, 70:], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(end, state_r, atol=1e-5, rtol=1e-4)


def test_recurrent_keeps_the_state_after_every_token():
    q, k, v, g, beta = _inputs(5, seed=1)
    _, states = recurrent_gated_delta_rule(q, k, v, g, beta, keep_all_states=True)
    assert states.shape == (1, 5, 4, 8, 6)
    for t in range(1, 6):
        _, s = recurrent_gated_delta_rule(*(x[:, :t] for x in (q, k, v, g, beta)))
        assert torch.equal(states[:, t - 1], s)


def test_conv_state_carries_across_calls():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(20, 6, generator=gen)
    w = torch.randn(6, 4, generator=gen)
    whole, _ = causal_conv1d(x, None, w)
    ref = F.silu(F.conv1d(x.T[None], w[:, None], padding=3, groups=6)[0, :, :20]).T
    torch.testing.assert_close(whole, ref)
    first, padded = causal_conv1d(x[:7], None, w)
    second, _ = causal_conv1d(x[7:], padded[:, -3:], w)
    torch.testing.assert_close(torch.cat([first, second]), whole)
    # the state after i tokens is padded[:, i : i + 3]
    assert torch.equal(padded[:, 5:8], x[2:5].T)
