"""RequestRows: the runner's per-request scalars as persistent arrays, one entry per row.

Owns, per row of the runner's block tables (`BatchBlockTable`: the same row numbers), what the
step's array ops read instead of walking the requests: real tokens so far, the real-token
count at which a length stop falls, whether the request samples with a seed; and the union of
the stop token ids of every request held (a sampled token outside it stops nobody). Set when a
request arrives, `num_tokens` advanced by the runner as it appends sampled tokens; grows with
the row count.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from speckv.engine.messages import StopLimits


class RequestRows:
    def __init__(self, num_rows: int = 64) -> None:
        num_rows = max(1, num_rows)
        self.num_tokens = np.zeros(num_rows, dtype=np.int64)  # real tokens (prompt + sampled)
        # real tokens at which the request ends by length: min(prompt + max_tokens,
        # max_model_len) (`first_stop`'s two limits as one count)
        self.stop_len = np.zeros(num_rows, dtype=np.int64)
        self.seeded = np.zeros(num_rows, dtype=bool)  # samples with a seed (else greedy)
        self._stop_counts: dict[int, int] = {}  # stop token id -> requests held that stop on it
        self.stop_token_ids = np.zeros(0, dtype=np.int64)  # [m] the union, sorted

    def add(self, row: int, num_tokens: int, num_prompt_tokens: int, limits: StopLimits,
            seeded: bool) -> None:
        """A request arrives in `row`. Mutates."""
        if row >= self.num_tokens.shape[0]:
            self._grow(row + 1)
        self.num_tokens[row] = num_tokens
        self.stop_len[row] = min(num_prompt_tokens + limits.max_tokens, limits.max_model_len)
        self.seeded[row] = seeded
        self._count(limits.stop_token_ids, 1)

    def free(self, limits: StopLimits) -> None:
        """A request leaves (its row's entries are set again by the next `add`). Mutates."""
        self._count(limits.stop_token_ids, -1)

    def _count(self, token_ids: Iterable[int], delta: int) -> None:
        counts = self._stop_counts
        changed = False
        for token_id in token_ids:
            count = counts.get(token_id, 0) + delta
            changed |= count == 0 or count == delta
            if count:
                counts[token_id] = count
            else:
                del counts[token_id]
        if changed:
            self.stop_token_ids = np.array(sorted(counts), dtype=np.int64)

    def _grow(self, num_rows: int) -> None:
        size = max(num_rows, 2 * self.num_tokens.shape[0])
        for name in ("num_tokens", "stop_len", "seeded"):
            old = getattr(self, name)
            grown = np.zeros(size, dtype=old.dtype)
            grown[: old.shape[0]] = old
            setattr(self, name, grown)
