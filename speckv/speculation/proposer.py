"""The speculative-decoding seam: what a drafter gets after verification, and what it returns.

Owns the `Proposer` protocol and its per-request input. The n-gram proposer
(`speckv.speculation.ngram`) and the EAGLE / EAGLE3 / MTP drafters (`DrafterProposer` in
`speckv.drafters.proposer`) implement it. The model runner calls `propose` once per step, after
verification and BEFORE the scheduler frees any finished request, so a drafter writes its draft
KV for every position made final this step (finishing requests included) before the block that
position completes can be cached: draft KV first, then the block's hash is used.

For position p of a request, the drafter reads the target's hidden state at p and the real
token at p + 1 (`token_ids[p + 1]`, i.e. the token after it; module j of a k-module MTP reads
`token_ids[p + j]`). A drafter keeps its own `PagedKVCache` with the same `num_blocks` and
`block_size` as the target's, so the same block table and slot mapping address it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, overload

import numpy as np
import torch

from speckv.cache.drafter_policy import DrafterPolicy

if TYPE_CHECKING:
    from speckv.attention import PagedKVCache


@dataclass(frozen=True)
class TargetRows:
    """One forward's target outputs on its flat token axis, shared by the step's inputs (the
    runner hands them over whole; each `ProposerInput` slices its own rows only when read)."""

    hidden_states: torch.Tensor  # [num_tokens, hidden] after the final norm
    prenorm_hidden: torch.Tensor  # [num_tokens, hidden] last decoder layer output
    aux_hidden_states: tuple[torch.Tensor, ...]  # per requested aux layer, [num_tokens, hidden]
    slot_mapping: torch.Tensor  # [num_tokens] int64 physical slots (the drafter's group)


class ProposerInput:
    """One request's positions made final this step (target KV written, token after known).

    Built from per-request tensors (positional, in the order below), or by the runner with
    `from_rows` over the step's shared `TargetRows` (`target_rows`, `first_row`): the tensor
    attributes are then sliced on first read, so a proposer that reads the whole step at once
    (`DrafterProposer`) pays one slice per step instead of several per request. Read-only."""

    request_id: str
    token_ids: Sequence[int]  # all real tokens of the request (prompt + output), after this step
    start: int  # first final position of this step
    end: int  # one past the last final position (= num_computed_tokens after verification)
    # Target hidden states at positions [start, end), each [end - start, hidden]:
    #   hidden_states      after the final norm (LM-head input)
    #   prenorm_hidden     last decoder layer output, before the final norm
    #   aux_hidden_states  per requested aux layer (see ModelOutput)
    block_table: Sequence[int]  # physical block ids (group 0), shared with the drafter's cache
    #   slot_mapping       [end - start] int64 physical slots of positions [start, end)
    wants_drafts: bool  # False: finishing (write draft KV only) or still prefilling
    max_drafts: int  # drafts allowed for this request next step (<= num_spec_tokens)
    target_rows: TargetRows | None  # the step's shared outputs (None: per-request tensors)
    first_row: int  # row of position `start` in `target_rows`
    # one block table per KV cache group of the target (drafters that read the target's
    # KV in every group: the Gemma 4 assistant); () where the runner does not pass them
    block_tables: tuple[Sequence[int], ...]

    __slots__ = (
        "_tensors",
        "block_table",
        "block_tables",
        "end",
        "first_row",
        "max_drafts",
        "request_id",
        "start",
        "target_rows",
        "token_ids",
        "wants_drafts",
    )

    def __init__(self, request_id: str, token_ids: Sequence[int], start: int, end: int,
                 hidden_states: torch.Tensor | None, prenorm_hidden: torch.Tensor | None,
                 aux_hidden_states: tuple[torch.Tensor, ...] | None,
                 block_table: Sequence[int], slot_mapping: torch.Tensor | None,
                 wants_drafts: bool, max_drafts: int,
                 target_rows: TargetRows | None = None, first_row: int = 0,
                 block_tables: tuple[Sequence[int], ...] = ()) -> None:
        if target_rows is None and (hidden_states is None or prenorm_hidden is None
                                    or aux_hidden_states is None or slot_mapping is None):
            raise ValueError("ProposerInput needs its tensors or the step's target_rows")
        set_ = object.__setattr__
        set_(self, "request_id", request_id)
        set_(self, "token_ids", token_ids)
        set_(self, "start", start)
        set_(self, "end", end)
        set_(self, "block_table", block_table)
        set_(self, "wants_drafts", wants_drafts)
        set_(self, "max_drafts", max_drafts)
        set_(self, "target_rows", target_rows)
        set_(self, "first_row", first_row)
        set_(self, "block_tables", block_tables)
        set_(self, "_tensors", None if target_rows is not None else
             (hidden_states, prenorm_hidden, tuple(aux_hidden_states or ()), slot_mapping))

    @classmethod
    def from_rows(cls, request_id: str, token_ids: Sequence[int], start: int, end: int,
                  target_rows: TargetRows, first_row: int, block_table: Sequence[int],
                  wants_drafts: bool, max_drafts: int,
                  block_tables: tuple[Sequence[int], ...] = ()) -> ProposerInput:
        return cls(request_id, token_ids, start, end, None, None, None, block_table, None,
                   wants_drafts, max_drafts, target_rows, first_row, block_tables)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"ProposerInput is read-only (cannot set {name})")

    def _sliced(self) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, ...],
                               torch.Tensor]:
        if self._tensors is None:
            rows = self.target_rows
            assert rows is not None
            span = slice(self.first_row, self.first_row + self.end - self.start)
            object.__setattr__(self, "_tensors", (
                rows.hidden_states[span], rows.prenorm_hidden[span],
                tuple(h[span] for h in rows.aux_hidden_states), rows.slot_mapping[span]))
        return self._tensors  # type: ignore[return-value]

    @property
    def hidden_states(self) -> torch.Tensor:
        return self._sliced()[0]

    @property
    def prenorm_hidden(self) -> torch.Tensor:
        return self._sliced()[1]

    @property
    def aux_hidden_states(self) -> tuple[torch.Tensor, ...]:
        return self._sliced()[2]

    @property
    def slot_mapping(self) -> torch.Tensor:
        return self._sliced()[3]

    def __repr__(self) -> str:
        return (f"ProposerInput({self.request_id!r}, start={self.start}, end={self.end}, "
                f"wants_drafts={self.wants_drafts}, max_drafts={self.max_drafts})")


class ProposerBatch(Sequence[ProposerInput]):
    """One step's `ProposerInput`s as whole-batch arrays (what the runner hands `propose`).

    A proposer that reads the step at once (`DrafterProposer`) uses the arrays and the draft
    group's padded block table; any other reads it as the sequence of `ProposerInput`s it is
    (each built on first access, then kept). Index i is the i-th scheduled request. Read-only.
    """

    request_ids: list[str]
    token_ids: list[Sequence[int]]  # per request: all real tokens, after this step
    start: np.ndarray  # [n] int64, first final position of this step
    end: np.ndarray  # [n] int64, one past the last final position
    first_row: np.ndarray  # [n] int64, row of position `start` in `target_rows`
    wants_drafts: np.ndarray  # [n] bool
    max_drafts: np.ndarray  # [n] int64
    target_rows: TargetRows
    # the draft group's block tables: [n, width] int32 0-padded, and blocks per row [n]
    block_table: np.ndarray
    block_table_lens: np.ndarray
    # per request, one block table per KV cache group (the views' `block_tables`)
    group_block_ids: list[Sequence[Sequence[int]]]
    draft_group: int

    __slots__ = ("_views", "block_table", "block_table_lens", "draft_group", "end",
                 "first_row", "group_block_ids", "max_drafts", "request_ids", "start",
                 "target_rows", "token_ids", "wants_drafts")

    def __init__(self, request_ids: list[str], token_ids: list[Sequence[int]],
                 start: np.ndarray, end: np.ndarray, first_row: np.ndarray,
                 wants_drafts: np.ndarray, max_drafts: np.ndarray, target_rows: TargetRows,
                 block_table: np.ndarray, block_table_lens: np.ndarray,
                 group_block_ids: list[Sequence[Sequence[int]]], draft_group: int) -> None:
        n = len(request_ids)
        if not (len(token_ids) == len(start) == len(end) == len(first_row) == len(wants_drafts)
                == len(max_drafts) == block_table.shape[0] == len(block_table_lens)
                == len(group_block_ids) == n):
            raise ValueError("ProposerBatch needs one entry per request in every field")
        self.request_ids = request_ids
        self.token_ids = token_ids
        self.start = start
        self.end = end
        self.first_row = first_row
        self.wants_drafts = wants_drafts
        self.max_drafts = max_drafts
        self.target_rows = target_rows
        self.block_table = block_table
        self.block_table_lens = block_table_lens
        self.group_block_ids = group_block_ids
        self.draft_group = draft_group
        self._views: list[ProposerInput] | None = None

    def __len__(self) -> int:
        return len(self.request_ids)

    @overload
    def __getitem__(self, index: int) -> ProposerInput: ...

    @overload
    def __getitem__(self, index: slice) -> list[ProposerInput]: ...

    def __getitem__(self, index: int | slice) -> ProposerInput | list[ProposerInput]:
        return self.inputs()[index]

    def __iter__(self) -> Iterator[ProposerInput]:
        return iter(self.inputs())

    def inputs(self) -> list[ProposerInput]:
        """The step as `ProposerInput`s (built once)."""
        if self._views is None:
            rows, group = self.target_rows, self.draft_group
            self._views = [
                ProposerInput.from_rows(request_id, tokens, start, end, rows, first_row,
                                        tables[group], wants, max_drafts,
                                        block_tables=tuple(tables))
                for request_id, tokens, start, end, first_row, wants, max_drafts, tables in zip(
                    self.request_ids, self.token_ids, self.start.tolist(), self.end.tolist(),
                    self.first_row.tolist(), self.wants_drafts.tolist(),
                    self.max_drafts.tolist(), self.group_block_ids)
            ]
        return self._views


@dataclass(frozen=True)
class ProposeTiming:
    """What the latest `propose` call spent (seconds), for the adaptive draft length."""

    catch_up_s: float = 0.0  # writing the draft KV of the positions made final
    draft_s: float = 0.0  # proposing the drafts


class Proposer(Protocol):
    num_spec_tokens: int
    policy: DrafterPolicy  # decides lookahead hashes vs the legacy drop
    # Target layers whose outputs the drafter reads (EAGLE3); () for none.
    aux_layers: tuple[int, ...]
    last_timing: ProposeTiming  # of the latest `propose` call
    # the drafter's own paged KV (same block ids as the target's draft group); None: it keeps
    # none (n-gram, the Gemma 4 assistant, which reads the target's)
    kv_cache: PagedKVCache | None

    def bind_target_kv(self, kv_cache: Any, layout: Any) -> None:
        """Once, before the first step: the target's paged KV and its `KVCacheLayout`, for a
        drafter that reads the target's KV (the Gemma 4 assistant); the others ignore it."""
        ...

    def propose(self, inputs: Sequence[ProposerInput]) -> dict[str, list[int]]:
        """Write draft KV for the final positions; return drafts (<= max_drafts) per request
        id for the requests with `wants_drafts`."""
        ...

    def free(self, request_id: str) -> None:
        """Forget a finished / aborted request's per-request state."""
        ...
