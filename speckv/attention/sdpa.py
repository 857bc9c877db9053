"""SDPABackend: paged attention with `torch.nn.functional.scaled_dot_product_attention`.

Owns the reference paged-attention implementation (CPU and GPU). Requests are grouped into a few
padded batches (same new-token count, similar context length), each run as ONE SDPA call with a
boolean mask: key j of request r is visible to its new token i iff
`j <= pos_i`, `j < seq_len_r` and, with a sliding window W, `pos_i - j < W`.
The grouping, gather indices and masks depend only on the metadata, so they are planned once
per forward and shared by every layer (cached in `metadata.plans`).
GQA without copying K/V: the query heads sharing one kv head are folded into the query axis.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from speckv.attention.kv_cache import LayerKVCache
from speckv.attention.metadata import AttentionMetadata
from speckv.attention.native_decode import (
    NATIVE_MAX_QUERY_LEN,
    NativeRequests,
    attend,
    native_requests,
    shapes_fit,
)

# Requests with more new tokens than this get their own SDPA call (a prefill chunk dominates
# its own cost; padding decodes up to its length would waste more).
_SHARED_CALL_MAX_QUERY_LEN = 32


@dataclass(frozen=True)
class _GroupPlan:
    """One padded SDPA call over `num_group_reqs` requests."""

    token_index: torch.Tensor  # [num_group_reqs, max_query_len] int64 into the flat token axis
    valid: torch.Tensor  # [num_group_reqs, max_query_len] bool, False for padding rows
    out_index: torch.Tensor  # [num_valid_tokens] int64 flat token ids, in valid-row order
    block_ids: torch.Tensor  # [num_group_reqs, num_gather_blocks] int64 physical blocks to read
    # [num_group_reqs, 1, rep * max_query_len, kv_len] bool, already folded for GQA (rows are
    # (head-in-group, query) pairs); None => plain causal prefill.
    mask: torch.Tensor | None
    all_valid: bool


def _split_groups(query_lens: tuple[int, ...], seq_lens: tuple[int, ...],
                  skip: frozenset[int] = frozenset()) -> list[list[int]]:
    order = sorted(range(len(query_lens)), key=lambda r: (query_lens[r], seq_lens[r]))
    groups: list[list[int]] = []
    for r in order:
        q, s = query_lens[r], seq_lens[r]
        if q == 0 or r in skip:
            continue
        if groups:
            head = groups[-1][0]
            same_q = query_lens[head] == q and q <= _SHARED_CALL_MAX_QUERY_LEN
            # Bound the kv padding waste: context at most ~2x the group's shortest.
            if same_q and s <= 2 * seq_lens[head] + 256:
                groups[-1].append(r)
                continue
        groups.append([r])
    return groups


def _plan(
    metadata: AttentionMetadata, sliding_window: int | None, rep: int, device: torch.device,
    skip: frozenset[int] = frozenset(),
) -> list[_GroupPlan]:
    assert metadata.query_lens_host is not None and metadata.seq_lens_host is not None
    qlens, slens = metadata.query_lens_host, metadata.seq_lens_host
    bs = metadata.block_size
    starts = [0]
    for q in qlens:
        starts.append(starts[-1] + q)
    plans: list[_GroupPlan] = []
    for reqs in _split_groups(qlens, slens, skip):
        max_q = max(qlens[r] for r in reqs)
        max_s = max(slens[r] for r in reqs)
        # With a window, skip the blocks that no query of the group can see.
        first_visible = 0
        if sliding_window is not None:
            first_visible = min(max(0, slens[r] - qlens[r] - sliding_window + 1) for r in reqs)
        first_block = first_visible // bs
        end_block = -(-max_s // bs)
        kv_start = first_block * bs
        kv_len = (end_block - first_block) * bs
        g = len(reqs)
        req_t = torch.tensor(reqs, dtype=torch.int64)
        q_t = torch.tensor([qlens[r] for r in reqs], dtype=torch.int64)  # [g]
        s_t = torch.tensor([slens[r] for r in reqs], dtype=torch.int64)  # [g]
        st_t = torch.tensor([starts[r] for r in reqs], dtype=torch.int64)  # [g]
        i = torch.arange(max_q, dtype=torch.int64)[None, :]  # [1, max_q]
        valid = i < q_t[:, None]  # [g, max_q]
        # Padding rows act as the request's last token (finite softmax), output dropped.
        i_eff = torch.minimum(i, q_t[:, None] - 1)
        token_index = st_t[:, None] + i_eff  # [g, max_q]
        q_pos = s_t[:, None] - q_t[:, None] + i_eff  # [g, max_q] absolute positions
        block_ids = metadata.block_tables[req_t.to(metadata.block_tables.device)][
            :, first_block:end_block
        ].to(device=device, dtype=torch.int64)  # [g, num_gather_blocks]
        single_full_prefill = g == 1 and qlens[reqs[0]] == slens[reqs[0]] == kv_len
        mask: torch.Tensor | None = None
        if not (single_full_prefill and sliding_window is None):
            k_pos = kv_start + torch.arange(kv_len, dtype=torch.int64)  # [kv_len]
            m = k_pos[None, None, :] <= q_pos[:, :, None]  # [g, max_q, kv_len]
            m &= k_pos[None, None, :] < s_t[:, None, None]
            if sliding_window is not None:
                m &= (q_pos[:, :, None] - k_pos[None, None, :]) < sliding_window
            m = m[:, None, None].expand(g, 1, rep, max_q, kv_len)  # [g, 1, rep, max_q, kv]
            mask = m.reshape(g, 1, rep * max_q, kv_len).to(device)
        plans.append(
            _GroupPlan(
                token_index=token_index.to(device),
                valid=valid.to(device),
                out_index=token_index[valid].to(device),
                block_ids=block_ids,
                mask=mask,
                all_valid=bool(valid.all()),
            )
        )
    return plans


class SDPABackend:
    """Reference backend: gather paged K/V per group, one masked SDPA call per group; requests
    of up to `native_max_query_len` new tokens, and prefills of up to
    `native_decode.NATIVE_MAX_PREFILL_SEQ_LEN` tokens of context, through speckv's own paged
    kernel where it is built and takes the shapes (`native_decode`; 0 turns it off)."""

    name = "sdpa"

    def __init__(self, native_max_query_len: int = NATIVE_MAX_QUERY_LEN) -> None:
        self.native_max_query_len = native_max_query_len

    def write_kv(
        self,
        cache: LayerKVCache,
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64
    ) -> None:
        _, _, num_kv_heads, head_dim = cache.key.shape
        cache.key.view(-1, num_kv_heads, head_dim).index_copy_(
            0, slot_mapping, k.to(cache.key.dtype)
        )
        cache.value.view(-1, num_kv_heads, head_dim).index_copy_(
            0, slot_mapping, v.to(cache.value.dtype)
        )

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[2]
        rep = num_heads // num_kv_heads
        native = (None if not shapes_fit(q, k_cache, v_cache)
                  else self._native_requests(metadata, num_heads))
        key = ("sdpa", sliding_window, rep, q.device, native is not None)
        plans = metadata.plans.get(key)
        if plans is None:
            plans = _plan(metadata, sliding_window, rep, q.device,
                          native.native if native is not None else frozenset())
            metadata.plans[key] = plans
        out = q.new_empty((num_tokens, num_heads, head_dim))
        if native is not None:
            attend(native, q, k_cache, v_cache, out, scale, sliding_window)
        for p in plans:
            g, max_q = p.token_index.shape
            kv_len = p.block_ids.shape[1] * k_cache.shape[1]
            # index_select, not advanced indexing: ~10x faster gathers on CPU.
            qg = q.index_select(0, p.token_index.flatten()).view(g, max_q, num_heads, head_dim)
            kg = k_cache.index_select(0, p.block_ids.flatten()).view(
                g, kv_len, num_kv_heads, head_dim
            )
            vg = v_cache.index_select(0, p.block_ids.flatten()).view(
                g, kv_len, num_kv_heads, head_dim
            )
            kg = kg.transpose(1, 2).to(q.dtype)  # [g, num_kv_heads, kv_len, head_dim]
            vg = vg.transpose(1, 2).to(q.dtype)
            if p.mask is None:
                # Whole-prompt prefill of one request: plain causal, lets SDPA pick flash.
                qh = qg.transpose(1, 2)  # [1, num_heads, max_q, head_dim]
                o = F.scaled_dot_product_attention(
                    qh, kg, vg, is_causal=True, scale=scale, enable_gqa=rep > 1
                )  # [1, num_heads, max_q, head_dim]
                o = o.transpose(1, 2)  # [1, max_q, num_heads, head_dim]
            else:
                # Fold the `rep` query heads of each kv head into the query axis (no K/V copy).
                qh = qg.view(g, max_q, num_kv_heads, rep, head_dim).permute(0, 2, 3, 1, 4)
                qh = qh.reshape(g, num_kv_heads, rep * max_q, head_dim)
                o = F.scaled_dot_product_attention(qh, kg, vg, attn_mask=p.mask, scale=scale)
                # [g, num_kv_heads, rep * max_q, head_dim] -> [g, max_q, num_heads, head_dim]
                o = o.view(g, num_kv_heads, rep, max_q, head_dim).permute(0, 3, 1, 2, 4)
                o = o.reshape(g, max_q, num_heads, head_dim)
            # all rows valid: o[p.valid] is o.flatten(0, 1) without the boolean-mask gather
            out.index_copy_(0, p.out_index, o.flatten(0, 1) if p.all_valid else o[p.valid])
        return out

    def _native_requests(self, metadata: AttentionMetadata, num_heads: int
                         ) -> NativeRequests | None:
        key = ("native", num_heads, self.native_max_query_len)
        if key not in metadata.plans:  # once per forward, shared by every layer
            metadata.plans[key] = native_requests(metadata, num_heads,
                                                  self.native_max_query_len)
        return metadata.plans[key]
