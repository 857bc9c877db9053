"""speckv's paged kernel for few-token queries (`native_decode`, inside SDPABackend): the
attention dense causal attention computes (to fp32 rounding) for decode and verification
queries, sliding windows and null blocks behind them included; a request's bits independent
of the rest of its batch; SDPA wherever it does not apply."""

from __future__ import annotations

import pytest
import torch

from speckv.attention import AttentionMetadata, PagedKVCache, SDPABackend
from speckv.attention.native_decode import native_attention_available
from tests.attention.test_paged_attention import BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, _run_case

needs_kernel = pytest.mark.skipif(not native_attention_available(),
                                  reason="speckv was built without its native kernels")


@needs_kernel
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("reqs", [
    [(1, 9), (1, 3), (1, 17), (1, 1)],  # decode batch, different contexts
    [(4, 11), (4, 6), (4, 30), (8, 8)],  # verifications, and a whole 8-token prompt
    [(40, 45), (1, 2), (2, 50), (33, 33)],  # long chunks stay with SDPA beside native ones
])
def test_the_native_kernel_equals_dense_attention(head_dim, reqs):
    out, ref = _run_case(reqs, head_dim=head_dim, seed=head_dim)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@needs_kernel
@pytest.mark.parametrize("window", [1, 3, 8, 40])
def test_the_native_kernel_keeps_the_sliding_window(window):
    out, ref = _run_case([(5, 21), (1, 17), (2, 30), (1, 200)], sliding_window=window, seed=3,
                         head_dim=32)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_native_and_sdpa_agree_and_a_request_ignores_its_batch():
    reqs = [(1, 37), (3, 20), (1, 5), (2, 64)]
    native, _ = _run_case(reqs, head_dim=64, seed=5)
    plain, _ = _run_case(reqs, head_dim=64, seed=5, backend=SDPABackend(native_max_query_len=0))
    torch.testing.assert_close(native, plain, atol=1e-5, rtol=1e-5)
    alone, _ = _run_case(reqs[:1], head_dim=64, seed=5)  # the same first request, by itself
    assert torch.equal(alone, native[:1])


@needs_kernel
def test_null_blocks_behind_the_window_are_not_read():
    window, seq_len, head_dim = 4, 20, 16
    gen = torch.Generator().manual_seed(1)
    cache = PagedKVCache(1, 8, BLOCK_SIZE, NUM_KV_HEADS, head_dim)
    layer = cache.layer(0)
    k = torch.randn(seq_len, NUM_KV_HEADS, head_dim, generator=gen)
    v = torch.randn(seq_len, NUM_KV_HEADS, head_dim, generator=gen)
    q = torch.randn(1, NUM_HEADS, head_dim, generator=gen)
    backend = SDPABackend()
    full = AttentionMetadata.build([seq_len], [seq_len], [[5, 2, 7, 3, 6]], BLOCK_SIZE)
    backend.write_kv(layer, k, v, full.slot_mapping)
    expected = SDPABackend(native_max_query_len=0).forward(
        q, layer.key, layer.value, AttentionMetadata.build([1], [seq_len], [[5, 2, 7, 3, 6]],
                                                           BLOCK_SIZE), head_dim**-0.5, window)
    layer.key[0].fill_(1e4)  # garbage in the null block must not leak into the result
    layer.value[0].fill_(1e4)
    md = AttentionMetadata.build([1], [seq_len], [[0, 0, 0, 0, 6]], BLOCK_SIZE)
    out = backend.forward(q, layer.key, layer.value, md, head_dim**-0.5, window)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_shapes_the_kernel_does_not_take_go_through_sdpa():
    reqs = [(1, 9), (2, 13)]
    for head_dim, dtype in ((8, torch.float32), (16, torch.bfloat16)):  # width, dtype
        native, _ = _run_case(reqs, head_dim=head_dim, dtype=dtype, seed=2)
        plain, _ = _run_case(reqs, head_dim=head_dim, dtype=dtype, seed=2,
                             backend=SDPABackend(native_max_query_len=0))
        assert torch.equal(native, plain)
