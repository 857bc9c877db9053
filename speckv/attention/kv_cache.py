"""Paged KV cache tensors: per layer one key and one value tensor of fixed-size blocks.

Owns the memory layout `[num_blocks, block_size, num_kv_heads, head_dim]` and the sizing helper
that turns a byte budget into a block count. Block ids are physical rows of these tensors; the
block manager (speckv/cache) decides which request owns which id. Block 0 is the null block by
convention of the block manager; the cache itself treats it like any other block.

A drafter keeps its own `PagedKVCache` (its own layers, head counts) with the SAME `num_blocks`
and `block_size`, so one block table and one slot mapping address both caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


def resolve_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from a dtype or one of "float32" / "bfloat16" / "float16"."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype must be fp32/bf16/fp16, got {dtype}")
        return dtype
    name = str(dtype).removeprefix("torch.")
    name = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}.get(name, name)
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of {tuple(_DTYPES)}, got {dtype!r}")
    return _DTYPES[name]


@dataclass(frozen=True)
class LayerKVCache:
    """The two cache tensors of one layer (views into the PagedKVCache storage)."""

    key: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]
    value: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim]


def bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype | str
) -> int:
    """Bytes one block id costs across all layers (keys + values)."""
    elem = torch.empty((), dtype=resolve_dtype(dtype)).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def num_blocks_for_budget(
    memory_bytes: int,
    num_layers: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype | str,
) -> int:
    """How many blocks fit in `memory_bytes` (for a drafter: add its per-block bytes first)."""
    if memory_bytes <= 0:
        raise ValueError(f"memory_bytes must be positive, got {memory_bytes}")
    per_block = bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
    n = memory_bytes // per_block
    if n < 2:
        raise ValueError(
            f"memory_bytes={memory_bytes} fits {n} blocks of {per_block} bytes; need >= 2 "
            "(block 0 is the null block)"
        )
    return int(n)


class PagedKVCache:
    """KV blocks for `num_layers` layers addressed by `layer_idx` in [0, num_layers)."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | str = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        for name, v in (
            ("num_layers", num_layers),
            ("num_blocks", num_blocks),
            ("block_size", block_size),
            ("num_kv_heads", num_kv_heads),
            ("head_dim", head_dim),
        ):
            if not isinstance(v, int) or v <= 0:
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = resolve_dtype(dtype)
        self.device = torch.device(device)
        # One allocation; per-layer key/value are views. [layers, 2, blocks, bs, kv_heads, hd]
        self.storage = torch.zeros(
            (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim),
            dtype=self.dtype,
            device=self.device,
        )
        self._layers = [
            LayerKVCache(self.storage[i, 0], self.storage[i, 1]) for i in range(num_layers)
        ]

    @classmethod
    def from_budget(
        cls,
        memory_bytes: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype | str = torch.float32,
        device: torch.device | str = "cpu",
    ) -> PagedKVCache:
        n = num_blocks_for_budget(
            memory_bytes, num_layers, block_size, num_kv_heads, head_dim, dtype
        )
        return cls(num_layers, n, block_size, num_kv_heads, head_dim, dtype, device)

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()

    def copy_blocks(self, src_block_ids: torch.Tensor, dst_block_ids: torch.Tensor) -> None:
        """Every layer's K and V of block `src[i]` into block `dst[i]` (each [n] int64 on the
        cache's device; no block both a source and a destination): one gather and one
        scatter over the whole storage."""
        self.storage.index_copy_(2, dst_block_ids, self.storage.index_select(2, src_block_ids))

    def layer(self, layer_idx: int) -> LayerKVCache:
        if not 0 <= layer_idx < self.num_layers:
            raise IndexError(f"layer_idx {layer_idx} out of range [0, {self.num_layers})")
        return self._layers[layer_idx]
