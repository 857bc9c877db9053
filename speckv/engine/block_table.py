"""BatchBlockTable: the runner's block tables of one KV cache group as one persistent array.

Owns a host array `[num_rows, width]` int32 (0 = the null block), one row per request the
runner holds, updated in place from the scheduler's block-id deltas (a request's first
schedule or resume replaces its row; later steps append), so a forward's block table is one
fancy-indexed copy of the scheduled rows instead of a Python list per request. Rows are reused
after a request leaves; the width doubles when a request outgrows it. Entries past a row's
length are always 0, so any prefix of columns is a valid 0-padded table.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class BatchBlockTable:
    def __init__(self, num_rows: int = 64, width: int = 16) -> None:
        self.table = np.zeros((max(1, num_rows), max(1, width)), dtype=np.int32)
        self.lens = np.zeros(self.table.shape[0], dtype=np.int64)  # blocks per row
        self._free_rows: list[int] = list(range(self.table.shape[0] - 1, -1, -1))

    def add_row(self) -> int:
        """A fresh, empty row. Mutates."""
        if not self._free_rows:
            old = self.table.shape[0]
            self.table = np.concatenate([self.table, np.zeros_like(self.table)])
            self.lens = np.concatenate([self.lens, np.zeros_like(self.lens)])
            self._free_rows = list(range(2 * old - 1, old - 1, -1))
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        """Forget a row (zeroed for its next user). Mutates."""
        self.table[row, : self.lens[row]] = 0
        self.lens[row] = 0
        self._free_rows.append(row)

    def replace(self, row: int, block_ids: Sequence[int]) -> None:
        n = len(block_ids)
        self._fit(n)
        old = int(self.lens[row])
        if n:
            self.table[row, :n] = block_ids
        if old > n:
            self.table[row, n:old] = 0
        self.lens[row] = n

    def extend(self, row: int, block_ids: Sequence[int]) -> None:
        if not block_ids:
            return
        start = int(self.lens[row])
        end = start + len(block_ids)
        self._fit(end)
        self.table[row, start:end] = block_ids
        self.lens[row] = end

    def gather(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(table [len(rows), width] int32 0-padded, blocks per row [len(rows)]) of `rows`;
        width is the longest row's length (at least 1)."""
        lens = self.lens[rows]
        width = max(1, int(lens.max())) if lens.shape[0] else 1
        return self.table[rows, :width], lens

    def _fit(self, width: int) -> None:
        if width > self.table.shape[1]:
            new_width = max(width, 2 * self.table.shape[1])
            grown = np.zeros((self.table.shape[0], new_width), dtype=np.int32)
            grown[:, : self.table.shape[1]] = self.table
            self.table = grown
