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

import numpy as np
import torch

from speckv.attention import PagedKVCache
from speckv.simulation.symbolic_kv import SymbolicKV


class PagedSymbolicKV(SymbolicKV):
    """`SymbolicKV` with its facts in `target_cache` and `draft_cache` (same block table).

    `write` and `mismatch` run for every scheduled request on every step of a soak, so they
    work on a whole request at once: one gather or scatter over the slots of its block table,
    through numpy views of the caches' memory (numpy's per-call cost on arrays this small is a
    fraction of torch's)."""

    def __init__(self, num_blocks: int, block_size: int, draft_depth: int) -> None:
        self.block_size = block_size
        self.draft_depth = draft_depth
        self.num_blocks = num_blocks
        self.target_cache = PagedKVCache(1, num_blocks, block_size, 1, 1)
        self.draft_cache = PagedKVCache(1, num_blocks, block_size, 1, 1 + draft_depth)
        # flat views over the slot axis: [2, num_blocks * block_size] and [2, .., 1 + depth];
        # the numpy arrays share the tensors' memory (what the connectors copy)
        self._target = self.target_cache.storage[0].view(2, num_blocks * block_size).numpy()
        self._draft = self.draft_cache.storage[0].view(2, num_blocks * block_size,
                                                       1 + draft_depth).numpy()
        self._block_offsets = np.arange(block_size)
        self._lookahead_offsets = np.arange(1, 1 + draft_depth)

    def _slots(self, block_ids: Sequence[int], start: int, end: int) -> np.ndarray:
        """[end - start] slot index of each position in [start, end)."""
        size = self.block_size
        first, last = start // size, -(-end // size)
        blocks = np.asarray(block_ids[first:last], dtype=np.int64)
        if len(blocks) != last - first:
            raise IndexError(f"positions up to {end} need {last} blocks, the table has "
                             f"{len(block_ids)}")
        slots = (blocks[:, None] * size + self._block_offsets).ravel()
        return slots[start - first * size : end - first * size]

    def _kv_values(self, sequence: Sequence[int], start: int, end: int) -> np.ndarray:
        """[end - start + depth] the target KV value (token + 1) of positions [start, end +
        depth) of `sequence`, 0 past its end (how a draft row pads: "no token there")."""
        values = np.zeros(end - start + self.draft_depth, dtype=np.float32)
        known = sequence[start : end + self.draft_depth]
        values[: len(known)] = known
        values[: len(known)] += 1
        return values

    def _draft_rows(self, values: np.ndarray, num_known: int, first: int,
                    stop: int) -> np.ndarray:
        """[stop - first, 1 + depth] the draft KV rows a cold run writes at offsets [first,
        stop) of `values` (`_kv_values`, whose first `num_known` entries are real tokens):
        [n + 1, the n <= depth tokens after the slot, + 1 each, 0 ...]."""
        offsets = np.arange(first, stop)
        rows = np.empty((stop - first, 1 + self.draft_depth), dtype=np.float32)
        # n = the tokens known after the slot, at most depth (np.clip costs more per call)
        rows[:, 0] = np.maximum(np.minimum(num_known - 1 - offsets, self.draft_depth), 0) + 1
        rows[:, 1:] = values[offsets[:, None] + self._lookahead_offsets]
        return rows

    def write(self, block_ids: Sequence[int], sequence: Sequence[int], start: int,
              end: int, draft_start: int) -> None:
        first = min(start, draft_start)
        if end <= first:
            return
        if end > start and end > len(sequence):
            raise IndexError(f"positions up to {end} written, the sequence has "
                             f"{len(sequence)} tokens")
        values = self._kv_values(sequence, first, end)
        num_known = min(len(sequence), end + self.draft_depth) - first
        if end > start:
            self._target[:, self._slots(block_ids, start, end)] = values[start - first :
                                                                         end - first]
        if end > draft_start:
            self._draft[:, self._slots(block_ids, draft_start, end)] = self._draft_rows(
                values, num_known, draft_start - first, end - first)

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
        num_checked = max(num_positions, num_draft_positions)
        if num_checked <= 0:
            return None
        if num_positions > len(tokens):
            raise IndexError(f"{num_positions} positions checked, the request has "
                             f"{len(tokens)} tokens")
        slots = self._slots(block_ids, 0, num_checked)
        values = self._kv_values(tokens, 0, num_checked)
        if num_positions > 0:
            bad = (self._target[:, slots[:num_positions]] != values[:num_positions]).any(0)
            if bad.any():
                position = int(bad.argmax())
                return (f"position {position}: target KV of "
                        f"{self.read(block_ids, position)[0]!r}, a cold run {tokens[position]}")
        if num_draft_positions > 0:
            depth = self.draft_depth
            num_known = min(len(tokens), num_checked + depth)
            rows = self._draft_rows(values, num_known, 0, num_draft_positions)
            bad = (self._draft[:, slots[:num_draft_positions]] != rows).any(-1).any(0)
            if bad.any():
                position = int(bad.argmax())
                return (f"position {position}: draft KV of "
                        f"{self.read(block_ids, position)[1]!r}, a cold run "
                        f"{tuple(tokens[position + 1 : position + 1 + depth])}")
        return None

    def read(self, block_ids: Sequence[int], position: int) -> tuple[object, object]:
        slot = self.slot(block_ids, position)
        return (decode_target(torch.from_numpy(self._target[:, slot])),
                decode_draft(torch.from_numpy(self._draft[:, slot])))


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
