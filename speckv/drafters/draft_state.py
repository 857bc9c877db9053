"""What a drafter reads and carries between steps: the target's hidden states of the step
(`TargetStates`), a request's carried module outputs (`DraftCarry`), one request's catch-up
(`CatchUpRequest`; a one-module chain's whole pass as arrays: `CatchUpBatch`) and the rows
each module may write.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from speckv.attention.metadata import pad_block_tables


@dataclass(frozen=True)
class TargetStates:
    """What the target computed at the catch-up positions (flattened over requests)."""

    hidden_states: torch.Tensor  # [num_tokens, hidden] after the final norm (LM-head input)
    # One [num_tokens, hidden] per aux layer the drafter asked for (EAGLE3), else ().
    aux_hidden_states: tuple[torch.Tensor, ...] = ()

    def select(self, rows: torch.Tensor) -> TargetStates:
        """The rows `rows` ([m] int64) of every tensor (e.g. the accepted prefix per request)."""
        return TargetStates(
            self.hidden_states.index_select(0, rows),
            tuple(a.index_select(0, rows) for a in self.aux_hidden_states),
        )


@dataclass
class DraftCarry:
    """Per-request state between passes: hidden states a lagging module still has to consume.

    pending[j] holds h_j rows (j = 1..k-1, index j-1 here) at positions
    [start[j], start[j] + rows) that module j + 1 has not written yet.
    """

    start: list[int]  # [k - 1] first pending position per module 2..k
    pending: list[torch.Tensor]  # k - 1 tensors, each [num_pending, hidden]
    next_position: int = 0  # where the next pass must start for this carry to apply


@dataclass(frozen=True)
class CatchUpRequest:
    """One request's slice of a catch-up pass.

    The target rows of this request are `num_positions` consecutive rows of `TargetStates`
    (requests in order), at positions `start_position .. start_position + num_positions - 1`.
    `next_token_ids` are the REAL tokens t[start_position + 1 ...] known now; at least
    `num_positions` of them (a non-final prefill chunk may pass up to `L - 1` more so that
    MTP modules keep up; drafts never go here).
    """

    start_position: int
    num_positions: int
    next_token_ids: Sequence[int]
    block_table: Sequence[int]
    carry: DraftCarry | None = None


@dataclass(frozen=True)
class CatchUpBatch:
    """A one-module chain's catch-up pass as whole-batch arrays: request i's rows are
    `counts[i]` consecutive rows of `TargetStates` (requests in order) at positions
    `starts[i] ..`; the module reads the real token after each row's position."""

    starts: np.ndarray  # [n] int64 first position per request
    counts: np.ndarray  # [n] int64 rows per request, each >= 1
    next_token_ids: np.ndarray  # [sum(counts)] int64: t[p + 1] of every row's position p
    block_table: np.ndarray  # [n, width] int, 0-padded physical block ids (the target's)
    block_table_lens: np.ndarray  # [n] int64 blocks per row

    @classmethod
    def from_requests(cls, requests: Sequence[CatchUpRequest]) -> CatchUpBatch:
        """The arrays of list-shaped requests (their tables padded once)."""
        table, lens = pad_block_tables([r.block_table for r in requests])
        counts = np.fromiter((r.num_positions for r in requests), np.int64, len(requests))
        ids = np.fromiter((t for r in requests for t in r.next_token_ids[: r.num_positions]),
                          np.int64, int(counts.sum()))
        return cls(np.fromiter((r.start_position for r in requests), np.int64, len(requests)),
                   counts, ids, table, lens)


@dataclass
class _ModuleRows:
    """Hidden inputs available to one module for one request: rows at consecutive positions."""

    start: int
    rows: torch.Tensor  # [num_rows, hidden]


@dataclass
class DraftState:
    """Result of `write_draft_kv`: the carries to store and what `propose` starts from."""

    carries: list[DraftCarry]  # one per request: store on the request, pass back next pass
    num_real_tokens: list[int]  # per request: tokens t[0 .. n-1] known
    block_tables: list[list[int]]
    # Per request: module 1's output [hidden] at its last written position, which is
    # carries[i].next_position - 1; propose needs it at n - 2 (all known real tokens consumed).
    _last_h1: list[torch.Tensor] = field(default_factory=list, repr=False)

    def subset(self, rows: Sequence[int]) -> DraftState:
        """The state of the requests `rows` only (e.g. those that want drafts)."""
        return DraftState(
            carries=[self.carries[i] for i in rows],
            num_real_tokens=[self.num_real_tokens[i] for i in rows],
            block_tables=[self.block_tables[i] for i in rows],
            _last_h1=[self._last_h1[i] for i in rows],
        )


@dataclass(frozen=True)
class BatchDraftState:
    """`Drafter.write_draft_kv_batch`'s result (a one-module chain): what `propose` drafts
    from, as whole-batch arrays."""

    last_hidden: torch.Tensor  # [n, hidden] module 1's output at position num_real_tokens - 2
    num_real_tokens: np.ndarray  # [n] int64 tokens t[0 .. n-1] known
    block_table: np.ndarray  # [n, width] int, 0-padded
    block_table_lens: np.ndarray  # [n] int64

    def subset(self, rows: np.ndarray) -> BatchDraftState:
        """The state of the requests `rows` ([m] int64, in order) only."""
        if rows.shape[0] == self.num_real_tokens.shape[0]:
            return self
        return BatchDraftState(
            self.last_hidden.index_select(0, torch.from_numpy(rows).to(self.last_hidden.device)),
            self.num_real_tokens[rows], self.block_table[rows], self.block_table_lens[rows])
