"""Which requests of a forward the SDPA backend attends with speckv's own paged kernel.

Owns that choice and the call (`_decode_attn.c`, built at install like the hash chain;
absent, every request goes through the gathered, masked SDPA calls). A request whose new
tokens are few (decode: 1, verification of k drafts: k + 1; up to `NATIVE_MAX_QUERY_LEN`)
is attended in place over its paged K/V: no gathered copy of its context per layer and one
call for all such requests instead of a dozen per padded group. On SmolLM2-135M with 8
requests of ~300 tokens of context, 1 thread, the gathers and SDPA calls took ~20 ms of an
~85 ms decode forward (torch profiler, 30 layers).

The choice depends only on each request's own query length and the model's shapes, and the
kernel's result for a request only on its own inputs, so a cold run and a hit compute the same
positions the same way whenever their shapes match (as the GEMM forms: see
`speckv.models.common.native_linear`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from speckv.attention.metadata import AttentionMetadata

try:
    from speckv.attention import _decode_attn
except ImportError:  # built without a C compiler: SDPA for every request
    _decode_attn = None

NATIVE_MAX_QUERY_LEN = 8  # decode and verification of up to 7 drafts
_MAX_ROWS = 128  # the kernel's query rows per request: query_len * num_heads
_MAX_HEAD_DIM = 256


def native_attention_available() -> bool:
    return _decode_attn is not None


@dataclass(frozen=True)
class NativeRequests:
    """One forward's requests for the native kernel (the rest have query length 0 here)."""

    native: frozenset[int]  # request indices attended natively
    tables: torch.Tensor  # [num_reqs, width] int32, contiguous
    starts: torch.Tensor  # [num_reqs] int64 first token of each request on the token axis
    query_lens: torch.Tensor  # [num_reqs] int64, 0 for requests left to SDPA
    seq_lens: torch.Tensor  # [num_reqs] int64


def native_requests(metadata: AttentionMetadata, num_heads: int, max_query_len: int
                    ) -> NativeRequests | None:
    """The requests of `metadata` with 1..`max_query_len` new tokens (None: none, or no
    kernel)."""
    if _decode_attn is None or max_query_len <= 0:
        return None
    assert metadata.query_lens_host is not None and metadata.seq_lens_host is not None
    limit = min(max_query_len, _MAX_ROWS // max(num_heads, 1))
    qlens = metadata.query_lens_host
    native = frozenset(r for r, q in enumerate(qlens) if 0 < q <= limit)
    if not native:
        return None
    starts, total = [], 0
    for q in qlens:
        starts.append(total)
        total += q
    return NativeRequests(
        native=native,
        tables=metadata.block_tables.to(device="cpu", dtype=torch.int32).contiguous(),
        starts=torch.tensor(starts, dtype=torch.int64),
        query_lens=torch.tensor([q if r in native else 0 for r, q in enumerate(qlens)],
                                dtype=torch.int64),
        seq_lens=torch.tensor(metadata.seq_lens_host, dtype=torch.int64))


def shapes_fit(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors (fp32 CPU, contiguous, head_dim a multiple
    of 16 up to 256)."""
    head_dim = q.shape[-1]
    return (q.dtype == k_cache.dtype == v_cache.dtype == torch.float32
            and q.device.type == k_cache.device.type == "cpu"
            and head_dim % 16 == 0 and head_dim <= _MAX_HEAD_DIM
            and q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous())


def attend(requests: NativeRequests, q: torch.Tensor, k_cache: torch.Tensor,
           v_cache: torch.Tensor, out: torch.Tensor, scale: float,
           sliding_window: int | None) -> None:
    """Write the attention of `requests.native`'s tokens into `out` (q, out: [num_tokens,
    num_heads, head_dim]; k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
    head_dim])."""
    assert _decode_attn is not None and out.is_contiguous()
    _, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    tables = requests.tables
    _decode_attn.decode_attention(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), tables.data_ptr(),
        requests.starts.data_ptr(), requests.query_lens.data_ptr(),
        requests.seq_lens.data_ptr(), out.data_ptr(), tables.shape[0], tables.shape[1],
        num_heads, num_kv_heads, head_dim, block_size, float(scale), sliding_window or 0)
