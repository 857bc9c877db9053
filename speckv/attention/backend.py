"""The attention backend protocol and backend selection.

Owns the small interface every attention implementation satisfies: write the new tokens' KV into
the paged cache, and attend the new queries over each request's paged context. `SDPABackend`
(pure PyTorch, any device) is the reference; a fused GPU kernel (flash-attn varlen with a block
table, FlashInfer paged prefill/decode) plugs in by implementing the same two methods and being
returned from `get_attention_backend` when importable.
"""

from __future__ import annotations

import importlib.util
from typing import Protocol, runtime_checkable

import torch

from speckv.attention.kv_cache import LayerKVCache
from speckv.attention.metadata import AttentionMetadata


@runtime_checkable
class AttentionBackend(Protocol):
    """Paged attention over `AttentionMetadata` (see metadata.py for the batch layout)."""

    name: str

    def write_kv(
        self,
        cache: LayerKVCache,
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        slot_mapping: torch.Tensor,  # [num_tokens] int64 physical slots
    ) -> None: ...

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        metadata: AttentionMetadata,
        scale: float,
        sliding_window: int | None = None,
    ) -> torch.Tensor: ...  # [num_tokens, num_heads, head_dim]


def fused_kernels_available() -> dict[str, bool]:
    """Which optional fused GPU kernels are importable (none are required)."""
    return {
        "flash_attn": importlib.util.find_spec("flash_attn") is not None,
        "flashinfer": importlib.util.find_spec("flashinfer") is not None,
    }


def get_attention_backend(name: str = "auto") -> AttentionBackend:
    """The backend called `name`; "auto" picks the best available (today always SDPA).

    Seam: a FlashInfer / flash-attn backend would be chosen here for CUDA when importable.
    """
    from speckv.attention.sdpa import SDPABackend

    if name in ("auto", "sdpa"):
        return SDPABackend()
    raise ValueError(f"attention backend must be 'auto' or 'sdpa', got {name!r}")
