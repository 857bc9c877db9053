"""What one KV block holds on the device, and the two copies a tier needs: out and in.

Owns `BlockLayout` (the per-block shape of every paged cache one block id addresses: the
target model's cache and the drafter's) and `DeviceKV` (those caches, with a batched read of
whole blocks to host memory and a batched write back).

A block id addresses the same rows of the target cache and of the drafter's cache (they share
`num_blocks`, `block_size` and the block table), so a tier block holds both, and a hit from a
tier restores the draft KV along with the target KV:

    PagedKVCache.storage              [layers, 2, num_blocks, block_size, kv_heads, head_dim]
    one block of one segment          [layers, 2, block_size, kv_heads, head_dim]
    read_blocks(ids) per segment      [len(ids), layers, 2, block_size, kv_heads, head_dim]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from speckv.attention import PagedKVCache

TARGET = "target"
DRAFT = "draft"

BlockTensors = tuple[torch.Tensor, ...]  # one tensor per segment, in layout order


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class KVSegment:
    """The per-block layout of one paged cache (the target's or the drafter's)."""

    name: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name: "float32", "bfloat16", "float16"

    @classmethod
    def of(cls, name: str, cache: PagedKVCache) -> KVSegment:
        return cls(name, cache.num_layers, cache.block_size, cache.num_kv_heads,
                   cache.head_dim, dtype_name(cache.dtype))

    @property
    def block_shape(self) -> tuple[int, ...]:
        """[layers, 2 (key, value), block_size, kv_heads, head_dim]"""
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of one block of this segment."""
        numel = 1
        for size in self.block_shape:
            numel *= size
        return numel * torch.empty((), dtype=self.torch_dtype).element_size()


@dataclass(frozen=True)
class BlockLayout:
    """Every segment one block id addresses: the target's, then the drafter's (if any)."""

    segments: tuple[KVSegment, ...]

    def __post_init__(self) -> None:
        if not self.segments:
            raise ValueError("a block layout needs at least one segment")
        sizes = {segment.block_size for segment in self.segments}
        if len(sizes) != 1:
            raise ValueError(f"segments disagree on the block size: {sorted(sizes)}")
        names = [segment.name for segment in self.segments]
        if len(set(names)) != len(names):
            raise ValueError(f"segment names must be unique, got {names}")

    @classmethod
    def of(cls, target: PagedKVCache, draft: PagedKVCache | None = None) -> BlockLayout:
        segments = [KVSegment.of(TARGET, target)]
        if draft is not None:
            segments.append(KVSegment.of(DRAFT, draft))
        return cls(tuple(segments))

    @property
    def block_size(self) -> int:
        return self.segments[0].block_size

    @property
    def nbytes(self) -> int:
        """Bytes of one whole block: every segment."""
        return sum(segment.nbytes for segment in self.segments)

    def describe(self) -> list[dict[str, object]]:
        """Plain data for namespaces and logs."""
        return [
            {"name": s.name, "layers": s.num_layers, "block_size": s.block_size,
             "kv_heads": s.num_kv_heads, "head_dim": s.head_dim, "dtype": s.dtype}
            for s in self.segments
        ]

    def check_block(self, tensors: BlockTensors) -> None:
        """Raise ValueError unless `tensors` is one block in this layout (for tests, stores)."""
        if len(tensors) != len(self.segments):
            raise ValueError(f"{len(tensors)} tensors for {len(self.segments)} segments")
        for segment, tensor in zip(self.segments, tensors):
            if tuple(tensor.shape) != segment.block_shape or tensor.dtype != segment.torch_dtype:
                raise ValueError(
                    f"segment {segment.name}: got {tuple(tensor.shape)} {tensor.dtype}, want "
                    f"{segment.block_shape} {segment.torch_dtype}"
                )


class DeviceKV:
    """The paged caches one block id addresses (target, then drafter), as a tier copies them."""

    def __init__(self, target: PagedKVCache, draft: PagedKVCache | None = None) -> None:
        if draft is not None:
            if (draft.num_blocks, draft.block_size) != (target.num_blocks, target.block_size):
                raise ValueError(
                    f"the drafter's cache ({draft.num_blocks} blocks of {draft.block_size}) "
                    f"must share the target's block table ({target.num_blocks} blocks of "
                    f"{target.block_size})"
                )
            if draft.device != target.device:
                raise ValueError(f"drafter cache on {draft.device}, target on {target.device}")
        self.caches: tuple[PagedKVCache, ...] = (target,) if draft is None else (target, draft)
        self.layout = BlockLayout.of(target, draft)
        self.num_blocks = target.num_blocks
        self.device = target.device

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks:
                raise IndexError(f"device block id {block_id} outside [0, {self.num_blocks})")
        return torch.tensor(list(block_ids), dtype=torch.int64, device=self.device)

    def read_blocks(self, block_ids: Sequence[int]) -> BlockTensors:
        """Copy whole blocks to host memory: per segment [n, layers, 2, bs, heads, dim].

        The result is a snapshot: later writes to these device blocks do not change it.
        """
        index = self._index(block_ids)
        out = []
        for cache in self.caches:
            gathered = cache.storage.index_select(2, index)  # [layers, 2, n, bs, heads, dim]
            out.append(gathered.permute(2, 0, 1, 3, 4, 5).contiguous().cpu())
        return tuple(out)

    def write_blocks(self, block_ids: Sequence[int], tensors: BlockTensors) -> None:
        """Copy whole blocks in: `tensors` per segment [n, layers, 2, bs, heads, dim]."""
        if not block_ids:
            return
        index = self._index(block_ids)
        if len(tensors) != len(self.caches):
            raise ValueError(f"{len(tensors)} tensors for {len(self.caches)} caches")
        for cache, segment, data in zip(self.caches, self.layout.segments, tensors):
            expected = (len(block_ids), *segment.block_shape)
            if tuple(data.shape) != expected or data.dtype != cache.dtype:
                raise ValueError(
                    f"segment {segment.name}: got {tuple(data.shape)} {data.dtype}, want "
                    f"{expected} {cache.dtype}"
                )
            source = data.to(self.device, non_blocking=True).permute(1, 2, 0, 3, 4, 5)
            cache.storage.index_copy_(2, index, source)
