"""Sliding-window paged reads where the cache manager replaced out-of-window blocks by the null
block (block 0): the output equals dense windowed attention whatever block 0 holds, and equals
the read over the original (unfreed) table bit for bit."""

from __future__ import annotations

import pytest
import torch

from speckv.attention import AttentionMetadata, PagedKVCache, SDPABackend
from tests.attention.test_paged_attention import _dense_reference

B, KV_HEADS, HEADS, D = 4, 2, 4, 8


@pytest.mark.exactness
@pytest.mark.parametrize(("window", "reqs"), [
    (5, [(1, 23)]),  # decode far past the window
    (5, [(1, 23), (1, 9), (4, 30)]),  # a batch: decodes and a verification of 3 drafts
    (9, [(6, 26), (1, 40)]),  # a prefill chunk past the window
])
def test_null_blocks_behind_the_window_read_like_the_real_ones(window, reqs):
    gen = torch.Generator().manual_seed(0)
    num_blocks = 1 + sum(-(-s // B) for _, s in reqs)
    cache = PagedKVCache(1, num_blocks, B, KV_HEADS, D)
    layer = cache.layer(0)
    backend = SDPABackend()
    tables, freed_tables, qs, ks, vs = [], [], [], [], []
    next_block = 1
    for num_new, seq_len in reqs:
        n = -(-seq_len // B)
        table = list(range(next_block, next_block + n))
        next_block += n
        k = torch.randn(seq_len, KV_HEADS, D, generator=gen)
        v = torch.randn(seq_len, KV_HEADS, D, generator=gen)
        slots = torch.tensor([table[p // B] * B + p % B for p in range(seq_len)])
        backend.write_kv(layer, k, v, slots)
        # what SlidingWindowManager.remove_skipped_blocks leaves: blocks wholly before the
        # first key the first new token can see are the null block
        first_needed = max(0, seq_len - num_new - window + 1)
        num_null = first_needed // B
        tables.append(table)
        freed_tables.append([0] * num_null + table[num_null:])
        qs.append(torch.randn(num_new, HEADS, D, generator=gen))
        ks.append(k)
        vs.append(v)
    q = torch.cat(qs)
    seq_lens = [s for _, s in reqs]
    query_lens = [n for n, _ in reqs]
    full = backend.forward(q, layer.key, layer.value,
                           AttentionMetadata.build(query_lens, seq_lens, tables, B),
                           D**-0.5, window)
    layer.key[0].fill_(1e4)  # the null block holds anything: it must never count
    layer.value[0].fill_(-1e4)
    freed = backend.forward(q, layer.key, layer.value,
                            AttentionMetadata.build(query_lens, seq_lens, freed_tables, B),
                            D**-0.5, window)
    torch.testing.assert_close(freed, full, rtol=0, atol=0)
    ref = torch.cat([_dense_reference(q_, k, v, D**-0.5, window) for q_, k, v in zip(qs, ks, vs)])
    torch.testing.assert_close(freed, ref, rtol=0, atol=1e-5)
