"""Paged attention (SDPABackend) equals dense causal attention; cache and metadata helpers."""

from __future__ import annotations

import random

import pytest
import torch

from speckv.attention import (
    AttentionBackend,
    AttentionMetadata,
    PagedKVCache,
    SDPABackend,
    bytes_per_block,
    get_attention_backend,
    num_blocks_for_budget,
)

BLOCK_SIZE = 4
NUM_HEADS = 6
NUM_KV_HEADS = 2
HEAD_DIM = 8
# the default sends requests through speckv's kernel where it is built; 0: the SDPA calls only
BOTH_PATHS = [SDPABackend(), SDPABackend(native_max_query_len=0)]
BOTH_PATH_IDS = ["default", "sdpa-only"]


def _dense_reference(
    q: torch.Tensor,  # [num_new, num_heads, head_dim]
    k: torch.Tensor,  # [seq_len, num_kv_heads, head_dim] full context incl. new tokens
    v: torch.Tensor,
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # [num_new, num_heads, head_dim]
    num_new, seq_len = q.shape[0], k.shape[0]
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    q_pos = torch.arange(seq_len - num_new, seq_len)[:, None]
    k_pos = torch.arange(seq_len)[None, :]
    allowed = k_pos <= q_pos
    if sliding_window is not None:
        allowed &= q_pos - k_pos < sliding_window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v.double()).to(q.dtype)


def _run_case(
    reqs: list[tuple[int, int]],  # (num_new, seq_len) per request
    sliding_window: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    head_dim: int = HEAD_DIM,
    backend: SDPABackend | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fill a shuffled paged cache with each request's context, run the backend on the new
    tokens; return (paged output, dense reference), both [num_tokens, num_heads, head_dim]."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = [-(-s // BLOCK_SIZE) for _, s in reqs]
    num_blocks = sum(blocks_needed) + 1 + 3
    free = list(range(1, num_blocks))  # block 0 is the null block
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in blocks_needed]
    cache = PagedKVCache(1, num_blocks, BLOCK_SIZE, NUM_KV_HEADS, head_dim, dtype=dtype)
    backend = backend or SDPABackend()
    layer = cache.layer(0)
    ks, vs, qs = [], [], []
    for (num_new, seq_len), table in zip(reqs, tables):
        k = torch.randn(seq_len, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
        v = torch.randn(seq_len, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
        q = torch.randn(num_new, NUM_HEADS, head_dim, generator=gen).to(dtype)
        # The context before the new tokens was written by earlier steps.
        old = seq_len - num_new
        if old:
            md_old = AttentionMetadata.build([old], [old], [table], BLOCK_SIZE)
            backend.write_kv(layer, k[:old], v[:old], md_old.slot_mapping)
        ks.append(k)
        vs.append(v)
        qs.append(q)
    md = AttentionMetadata.build([n for n, _ in reqs], [s for _, s in reqs], tables, BLOCK_SIZE)
    k_new = torch.cat([k[s - n :] for k, (n, s) in zip(ks, reqs)])
    v_new = torch.cat([v[s - n :] for v, (n, s) in zip(vs, reqs)])
    backend.write_kv(layer, k_new, v_new, md.slot_mapping)
    scale = head_dim**-0.5
    out = backend.forward(torch.cat(qs), layer.key, layer.value, md, scale, sliding_window)
    ref = torch.cat(
        [_dense_reference(q, k, v, scale, sliding_window) for q, k, v in zip(qs, ks, vs)]
    )
    return out, ref


@pytest.mark.parametrize(
    "reqs",
    [
        [(7, 7)],  # one whole prefill (plain causal path)
        [(1, 9), (1, 3), (1, 17), (1, 1)],  # decode batch, different contexts
        [(5, 13), (3, 3), (1, 8)],  # chunk in the middle of a context, prefill, decode
        [(4, 11), (4, 6), (4, 30)],  # verification of 3 drafts + bonus, several requests
        [(40, 45), (1, 2), (2, 50), (33, 33)],  # long chunks get their own calls
    ],
)
@pytest.mark.parametrize("backend", BOTH_PATHS, ids=BOTH_PATH_IDS)
def test_paged_equals_dense(reqs: list[tuple[int, int]], backend: SDPABackend) -> None:
    out, ref = _run_case(reqs, backend=backend)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BOTH_PATHS, ids=BOTH_PATH_IDS)
@pytest.mark.parametrize("window", [1, 3, 8])
def test_sliding_window_equals_dense(window: int, backend: SDPABackend) -> None:
    out, ref = _run_case([(5, 21), (1, 17), (9, 9), (2, 30)], sliding_window=window, seed=3,
                         backend=backend)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_sliding_window_ignores_null_blocks_outside_window() -> None:
    """Blocks entirely outside the window may be freed (id 0 = null block) and are not read."""
    window, seq_len, num_new = 4, 20, 2
    gen = torch.Generator().manual_seed(1)
    cache = PagedKVCache(1, 8, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    layer = cache.layer(0)
    table = [5, 2, 7, 3, 6]
    k = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    v = torch.randn(seq_len, NUM_KV_HEADS, HEAD_DIM, generator=gen)
    q = torch.randn(num_new, NUM_HEADS, HEAD_DIM, generator=gen)
    backend = SDPABackend()
    full = AttentionMetadata.build([seq_len], [seq_len], [table], BLOCK_SIZE)
    backend.write_kv(layer, k, v, full.slot_mapping)
    # Positions 0..11 are outside every new token's window: their blocks become null.
    sparse_table = [0, 0, 0, 3, 6]
    layer.key[0].fill_(1e4)  # garbage in the null block must not leak into the result
    md = AttentionMetadata.build([num_new], [seq_len], [sparse_table], BLOCK_SIZE)
    out = backend.forward(q, layer.key, layer.value, md, HEAD_DIM**-0.5, window)
    ref = _dense_reference(q, k, v, HEAD_DIM**-0.5, window)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_bf16_close_to_dense() -> None:
    out, ref = _run_case([(3, 10), (1, 5)], dtype=torch.bfloat16, seed=7)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


def test_plans_are_cached_per_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    from speckv.attention import sdpa

    planned: list[int | None] = []
    original = sdpa._plan

    def spy(metadata, sliding_window, rep, device, *rest):  # type: ignore[no-untyped-def]
        planned.append(sliding_window)
        return original(metadata, sliding_window, rep, device, *rest)

    monkeypatch.setattr(sdpa, "_plan", spy)
    md = AttentionMetadata.build([2, 1], [5, 3], [[1, 2], [3]], BLOCK_SIZE)
    cache = PagedKVCache(1, 4, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    q = torch.randn(3, NUM_HEADS, HEAD_DIM)
    b = SDPABackend()
    first = b.forward(q, cache.layer(0).key, cache.layer(0).value, md, 1.0)
    second = b.forward(q, cache.layer(0).key, cache.layer(0).value, md, 1.0)
    assert planned == [None] and len(md.plans) == 1  # the second layer reuses the plan
    assert torch.equal(first, second)
    b.forward(q, cache.layer(0).key, cache.layer(0).value, md, 1.0, sliding_window=2)
    assert planned == [None, 2] and len(md.plans) == 2  # a window is planned separately


def test_write_kv_lands_in_slots() -> None:
    cache = PagedKVCache(2, 6, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype="bfloat16")
    k = torch.randn(3, NUM_KV_HEADS, HEAD_DIM)
    v = torch.randn(3, NUM_KV_HEADS, HEAD_DIM)
    slots = torch.tensor([5 * BLOCK_SIZE + 1, 2 * BLOCK_SIZE + 3, 7], dtype=torch.int64)
    SDPABackend().write_kv(cache.layer(1), k, v, slots)
    flat_k = cache.layer(1).key.view(-1, NUM_KV_HEADS, HEAD_DIM)
    torch.testing.assert_close(flat_k[slots].float(), k.bfloat16().float())
    assert cache.layer(0).key.abs().sum() == 0  # other layers untouched


def test_drafter_cache_shares_block_ids() -> None:
    """A drafter's own cache with the same num_blocks/block_size takes the same slot mapping."""
    target = PagedKVCache(4, 10, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    draft = PagedKVCache(1, target.num_blocks, target.block_size, 1, 16)
    md = AttentionMetadata.build([3], [3], [[9]], BLOCK_SIZE)
    SDPABackend().write_kv(
        draft.layer(0), torch.ones(3, 1, 16), torch.ones(3, 1, 16), md.slot_mapping
    )
    assert draft.layer(0).key[9, :3].eq(1).all()
    assert target.storage.abs().sum() == 0


def test_budget_helper() -> None:
    per_block = bytes_per_block(30, 16, 3, 64, torch.bfloat16)
    assert per_block == 2 * 30 * 16 * 3 * 64 * 2
    assert num_blocks_for_budget(per_block * 100 + 5, 30, 16, 3, 64, "bfloat16") == 100
    cache = PagedKVCache.from_budget(per_block * 7, 30, 16, 3, 64, "bfloat16")
    assert cache.num_blocks == 7 and cache.nbytes == per_block * 7
    with pytest.raises(ValueError, match="memory_bytes"):
        num_blocks_for_budget(per_block, 30, 16, 3, 64, "bfloat16")


def test_cache_validation() -> None:
    with pytest.raises(ValueError, match="block_size"):
        PagedKVCache(1, 4, 0, 2, 8)
    with pytest.raises(ValueError, match="dtype"):
        PagedKVCache(1, 4, 4, 2, 8, dtype="int8")
    with pytest.raises(IndexError):
        PagedKVCache(1, 4, 4, 2, 8).layer(1)


def test_metadata_validation_and_positions() -> None:
    md = AttentionMetadata.build([2, 1], [6, 3], [[4, 1], [2]], BLOCK_SIZE)
    assert md.positions().tolist() == [4, 5, 2]
    assert md.block_tables.tolist() == [[4, 1], [2, 0]]  # padded with the null block
    # built from tensors only: host lengths and positions derived from them
    again = AttentionMetadata(md.query_start_loc, md.seq_lens, md.block_tables,
                              md.slot_mapping, BLOCK_SIZE)
    assert again.query_lens_host == (2, 1) and again.seq_lens_host == (6, 3)
    assert again.positions().tolist() == [4, 5, 2]
    assert md.slot_mapping.tolist() == [1 * 4 + 0, 1 * 4 + 1, 2 * 4 + 2]
    assert md.query_start_loc.tolist() == [0, 2, 3]
    with pytest.raises(ValueError, match="query_lens"):
        AttentionMetadata.build([4], [3], [[1]], BLOCK_SIZE)
    with pytest.raises(ValueError, match="block table"):
        AttentionMetadata.build([1], [9], [[1, 2]], BLOCK_SIZE)


def test_backend_protocol() -> None:
    assert isinstance(get_attention_backend(), AttentionBackend)
    with pytest.raises(ValueError, match="backend"):
        get_attention_backend("nope")
