"""Which requests of a forward the SDPA backend attends with speckv's own paged kernel.

Owns that choice and the call (`_decode_attn.c`, built at install like the hash chain;
absent, every request goes through the gathered, masked SDPA calls). A request whose new
tokens are few (decode: 1, verification of k drafts: k + 1; up to `NATIVE_MAX_QUERY_LEN`)
is attended in place over its paged K/V: no gathered copy of its context per layer and one
call for all such requests instead of a dozen per padded group. On SmolLM2-135M with 8
requests of ~300 tokens of context, 1 thread, the gathers and SDPA calls took ~20 ms of an
~85 ms decode forward (torch profiler, 30 layers).

A prefill (chunk) whose context is at most `NATIVE_MAX_PREFILL_SEQ_LEN` tokens goes through the
same kernel, cut into pieces of at most `_MAX_ROWS // num_heads` tokens, each a request of its
own that ends at its last token (so a piece reads only the keys its tokens may see: the causal
half, where SDPA's CPU kernel computes the whole square at these lengths):

    prompt tokens   0 ............................. 255
    piece 0         [0, 14)   keys [0, 14)
    piece 1         [14, 28)  keys [0, 28)
    ...
    piece 18        [252, 256) keys [0, 256)

A row's result does not depend on the pieces: its scores, softmax and value sum cover its own
visible keys in position order, and the keys of the piece it cannot see add exact zeros. So a
token's attention has the same bits in a prefill, a chunk of one and a decode step. 8 prompts
of 256 tokens, 30 layers, 1 thread (AMD EPYC, AVX-512): 0.55 s in SDPA (with its gathers) ->
0.44 s. Beyond ~1,024 tokens of context SDPA's blocked kernel is faster again (2,048: 0.65 against
0.72 s per 8 prompts and layer), so longer ones keep it.

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
NATIVE_MAX_PREFILL_SEQ_LEN = 1024  # longer prefills: SDPA (see above)
_MAX_ROWS = 128  # the kernel's query rows per request: query_len * num_heads
_MAX_HEAD_DIM = 256


def native_attention_available() -> bool:
    return _decode_attn is not None


@dataclass(frozen=True)
class NativeRequests:
    """One forward's requests for the native kernel, as the kernel sees them: pieces."""

    native: frozenset[int]  # request indices attended natively
    # the kernel's requests: pieces of the native ones (a decode is one piece)
    tables: torch.Tensor  # [num_pieces, width] int32, contiguous: each piece's request's row
    starts: torch.Tensor  # [num_pieces] int64 first token of each piece on the token axis
    query_lens: torch.Tensor  # [num_pieces] int64
    seq_lens: torch.Tensor  # [num_pieces] int64 context through the piece's last token


def native_requests(metadata: AttentionMetadata, num_heads: int, max_query_len: int,
                    max_prefill_seq_len: int = NATIVE_MAX_PREFILL_SEQ_LEN
                    ) -> NativeRequests | None:
    """The requests of `metadata` with 1..`max_query_len` new tokens, and those with more
    whose context is at most `max_prefill_seq_len` tokens, cut into pieces (None: none, or no
    kernel; `max_query_len` 0 turns the kernel off)."""
    if _decode_attn is None or max_query_len <= 0 or not 0 < num_heads <= _MAX_ROWS:
        return None
    assert metadata.query_lens_host is not None and metadata.seq_lens_host is not None
    piece = _MAX_ROWS // num_heads  # tokens per kernel request
    qlens, slens = metadata.query_lens_host, metadata.seq_lens_host
    native = frozenset(r for r, (q, s) in enumerate(zip(qlens, slens))
                       if q > 0 and (q <= min(max_query_len, piece) or s <= max_prefill_seq_len))
    if not native:
        return None
    owners: list[int] = []
    starts: list[int] = []
    pieces: list[int] = []
    ends: list[int] = []
    start = 0
    for r, (q, s) in enumerate(zip(qlens, slens)):
        if r in native:
            for i in range(0, q, piece):
                n = min(piece, q - i)
                owners.append(r)
                starts.append(start + i)
                pieces.append(n)
                ends.append(s - q + i + n)
        start += q
    tables = metadata.block_tables.to(device="cpu", dtype=torch.int32)
    if owners != list(range(tables.shape[0])):  # not one piece per request, in order
        tables = tables.index_select(0, torch.tensor(owners, dtype=torch.int64))
    return NativeRequests(
        native=native,
        tables=tables.contiguous(),
        starts=torch.tensor(starts, dtype=torch.int64),
        query_lens=torch.tensor(pieces, dtype=torch.int64),
        seq_lens=torch.tensor(ends, dtype=torch.int64))


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
