"""speckv's paged kernel (`native_decode`, inside SDPABackend): the attention dense causal
attention computes (to fp32 rounding) for decode and verification queries and for prefills
cut into pieces, sliding windows and null blocks behind them included; a request's bits
independent of the rest of its batch and a token's independent of how its prompt was cut;
SDPA wherever it does not apply."""

from __future__ import annotations

import pytest
import torch

from speckv.attention import AttentionMetadata, PagedKVCache, SDPABackend, native_decode
from speckv.attention.native_decode import native_attention_available
from tests.attention.test_paged_attention import BLOCK_SIZE, NUM_HEADS, NUM_KV_HEADS, _run_case

needs_kernel = pytest.mark.skipif(not native_attention_available(),
                                  reason="speckv was built without its native kernels")


@needs_kernel
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("reqs", [
    [(1, 9), (1, 3), (1, 17), (1, 1)],  # decode batch, different contexts
    [(4, 11), (4, 6), (4, 30), (8, 8)],  # verifications, and a whole 8-token prompt
    [(40, 45), (1, 2), (2, 50), (33, 33)],  # prefill chunks cut into pieces beside decodes
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


@needs_kernel
@pytest.mark.parametrize("window", [None, 5])
def test_a_prefill_in_pieces_equals_dense_attention(window):
    # 60 new tokens of 6 heads: pieces of 21 tokens; a chunk after a hit and a whole prompt
    out, ref = _run_case([(60, 75), (61, 61), (1, 30)], sliding_window=window, seed=11,
                         head_dim=32)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@needs_kernel
def test_a_token_has_the_same_bits_however_its_prompt_was_cut():
    """Same kernel, same per-row arithmetic (its own visible keys, in order; the keys of its
    piece it cannot see add exact zeros): a prefill in one call, in chunks, and the last token
    as a decode step give each position the same bits."""
    seq_len, head_dim = 50, 64
    gen = torch.Generator().manual_seed(9)
    cache = PagedKVCache(1, 16, BLOCK_SIZE, NUM_KV_HEADS, head_dim)
    layer = cache.layer(0)
    table = [[3, 9, 1, 14, 6, 2, 11, 5, 8, 12, 7, 4, 13]]
    k = torch.randn(seq_len, NUM_KV_HEADS, head_dim, generator=gen)
    v = torch.randn(seq_len, NUM_KV_HEADS, head_dim, generator=gen)
    q = torch.randn(seq_len, NUM_HEADS, head_dim, generator=gen)
    backend = SDPABackend()
    backend.write_kv(layer, k, v, AttentionMetadata.build([seq_len], [seq_len], table,
                                                          BLOCK_SIZE).slot_mapping)

    def attend(num_new: int, end: int) -> torch.Tensor:
        md = AttentionMetadata.build([num_new], [end], table, BLOCK_SIZE)
        return backend.forward(q[end - num_new:end].contiguous(), layer.key, layer.value, md,
                               head_dim**-0.5)

    one_call = attend(seq_len, seq_len)
    in_chunks = torch.cat([attend(13, 13), attend(13, 26), attend(24, 50)])
    as_decodes = torch.cat([attend(1, end) for end in range(1, seq_len + 1)])
    assert torch.equal(one_call, in_chunks)
    assert torch.equal(one_call, as_decodes)


@needs_kernel
def test_prefills_with_long_contexts_keep_sdpa(monkeypatch):
    calls = []
    original = native_decode.native_requests

    def spy(metadata, num_heads, max_query_len, max_prefill_seq_len=16):
        result = original(metadata, num_heads, max_query_len, max_prefill_seq_len)
        calls.append(result)
        return result

    monkeypatch.setattr("speckv.attention.sdpa.native_requests", spy)
    # 16-token limit: the 20-token prefill goes to SDPA, the decode and the short prefill not
    out, ref = _run_case([(20, 20), (1, 30), (12, 12)], head_dim=32, seed=6)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert calls and calls[0] is not None and calls[0].native == frozenset({1, 2})


def test_more_heads_than_the_kernel_takes_go_through_sdpa():
    md = AttentionMetadata.build([3, 1], [3, 9], [[1], [2, 3, 4]], BLOCK_SIZE)
    assert native_decode.native_requests(md, num_heads=129, max_query_len=8) is None
