"""How a KV cache group reads the request's hash chain, and the hit alignment of the groups.

Owns `StridedHashes` (a group whose block is `stride` hash units is named by every stride-th
hash of the chain: a chained hash covers all before it) and `alignment` (the hit alignment
unit U of a set of groups: the one given, checked, or the block sizes' lcm).
"""

from __future__ import annotations

import math
from collections.abc import Sequence


class StridedHashes(Sequence[bytes]):
    """The hashes of a group whose block is `stride` hash units: every stride-th chain hash.
    A view: it grows with the request's chain."""

    __slots__ = ("_chain", "_stride")

    def __init__(self, chain: Sequence[bytes], stride: int) -> None:
        self._chain = chain
        self._stride = stride

    def __len__(self) -> int:
        return len(self._chain) // self._stride

    def __getitem__(self, index):  # type: ignore[override]
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step < 0:
                return [self[i] for i in range(start, stop, step)]
            stride = self._stride
            # item i is chain[(i + 1) * stride - 1]: one C-level slice of the chain
            return self._chain[(start + 1) * stride - 1 : (stop + 1) * stride - 1 : step * stride]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(index)
        return self._chain[(index + 1) * self._stride - 1]

    def __iter__(self):
        return iter(self[:])


def alignment(block_sizes: Sequence[int], alignment_tokens: int | None) -> int:
    """The hit alignment unit U: the given one, checked, or the groups' block sizes' lcm."""
    if alignment_tokens is None:
        return math.lcm(*block_sizes)
    if alignment_tokens <= 0 or any(alignment_tokens % size for size in block_sizes):
        raise ValueError(
            f"alignment_tokens {alignment_tokens} must be a positive multiple of every "
            f"group's block size {sorted(set(block_sizes))}"
        )
    return alignment_tokens
