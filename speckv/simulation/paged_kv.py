"""PagedSymbolicKV: the symbolic KV store kept in real paged KV tensors, so real connectors move it.

Owns an encoding of `SymbolicKV`'s facts (the token a slot's target KV was computed from; the
tokens after it that the draft KV was computed from) into two real `PagedKVCache`s that share
one block table, exactly as the engine's target and drafter caches do. A KV connector built on
them (`speckv.connectors`, through `DeviceKV`) copies these bytes out to its tiers and back,
and every hit the toy runner checks (local or from a tier) is then read back from the tensors:
a tier that served the wrong block, a stale successor, a half-written block or a block that
was reused before its snapshot all show up as a `HitMismatch`.

    target cache   1 layer, 1 KV head, head_dim 1:  K = V = token + 1            (0: unwritten)
    draft cache    1 layer, 1 KV head, head_dim 1 + depth:
                   K = V = [n + 1, t1 + 1, ..., tn + 1, 0 ...]  the n <= depth tokens after
                                                                 the slot     (0: unwritten)

Values are small integers held exactly in float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from speckv.attention import PagedKVCache
from speckv.simulation.toy_runner import SymbolicKV


class PagedSymbolicKV(SymbolicKV):
    """`SymbolicKV` with its facts in `target_cache` and `draft_cache` (same block table)."""

    def __init__(self, num_blocks: int, block_size: int, draft_depth: int) -> None:
        self.block_size = block_size
        self.draft_depth = draft_depth
        self.num_blocks = num_blocks
        self.target_cache = PagedKVCache(1, num_blocks, block_size, 1, 1)
        self.draft_cache = PagedKVCache(1, num_blocks, block_size, 1, 1 + draft_depth)
        # flat views over the slot axis: [num_blocks * block_size] and [.., 1 + depth]
        self._target = self.target_cache.storage[0].view(2, num_blocks * block_size)
        self._draft = self.draft_cache.storage[0].view(2, num_blocks * block_size,
                                                       1 + draft_depth)

    def _slots(self, block_ids: Sequence[int], start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end)
        blocks = torch.tensor(list(block_ids), dtype=torch.int64)[positions // self.block_size]
        return blocks * self.block_size + positions % self.block_size

    def write(self, block_ids: Sequence[int], sequence: Sequence[int], start: int,
              end: int, draft_start: int) -> None:
        if end > start:
            slots = self._slots(block_ids, start, end)
            values = torch.tensor([sequence[p] + 1 for p in range(start, end)],
                                  dtype=torch.float32)
            self._target[:, slots] = values
        if end > draft_start:
            slots = self._slots(block_ids, draft_start, end)
            rows = torch.zeros((end - draft_start, 1 + self.draft_depth))
            for row, position in enumerate(range(draft_start, end)):
                after = sequence[position + 1 : position + 1 + self.draft_depth]
                rows[row, 0] = len(after) + 1
                rows[row, 1 : 1 + len(after)] = torch.tensor(after, dtype=torch.float32) + 1
            self._draft[:, slots] = rows

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        src = torch.tensor([pair[0] for pair in copies], dtype=torch.int64)
        dst = torch.tensor([pair[1] for pair in copies], dtype=torch.int64)
        self.target_cache.copy_blocks(src, dst)
        self.draft_cache.copy_blocks(src, dst)

    def mismatch(self, block_ids: Sequence[int], tokens: Sequence[int], num_positions: int,
                 num_draft_positions: int) -> str | None:
        """Where positions [0, num_positions) do not hold the target KV of `tokens`, or
        positions [0, num_draft_positions) not the draft KV a cold run writes; None if they all
        do. Vectorized: cheap enough to run on every request after every step."""
        if num_positions > 0:
            slots = self._slots(block_ids, 0, num_positions)
            want = torch.tensor(list(tokens[:num_positions]), dtype=torch.float32) + 1
            bad = (self._target[:, slots] != want).any(0).nonzero()
            if len(bad):
                position = int(bad[0])
                return (f"position {position}: target KV of "
                        f"{self.read(block_ids, position)[0]!r}, a cold run {tokens[position]}")
        if num_draft_positions > 0:
            slots = self._slots(block_ids, 0, num_draft_positions)
            depth = self.draft_depth
            rows = torch.zeros((num_draft_positions, 1 + depth))
            for position in range(num_draft_positions):
                after = tokens[position + 1 : position + 1 + depth]
                rows[position, 0] = len(after) + 1
                rows[position, 1 : 1 + len(after)] = torch.tensor(after, dtype=torch.float32) + 1
            bad = (self._draft[:, slots] != rows).any(-1).any(0).nonzero()
            if len(bad):
                position = int(bad[0])
                return (f"position {position}: draft KV of "
                        f"{self.read(block_ids, position)[1]!r}, a cold run "
                        f"{tuple(tokens[position + 1 : position + 1 + depth])}")
        return None

    def read(self, block_ids: Sequence[int], position: int) -> tuple[object, object]:
        slot = self.slot(block_ids, position)
        return decode_target(self._target[:, slot]), decode_draft(self._draft[:, slot])


def decode_target(kv: torch.Tensor) -> int | str | None:
    """A slot's target fact from its [2] (K, V) values; "torn" if K and V disagree."""
    key, value = int(kv[0]), int(kv[1])
    if key != value:
        return "torn"
    return None if key == 0 else key - 1


def decode_draft(kv: torch.Tensor) -> tuple[int, ...] | str | None:
    """A slot's draft fact from its [2, 1 + depth] (K, V) rows; "torn" if K and V disagree."""
    if not torch.equal(kv[0], kv[1]):
        return "torn"
    row = [int(x) for x in kv[0]]
    if row[0] == 0:
        return None
    return tuple(x - 1 for x in row[1 : row[0]])
