"""`DrafterProposer`: the engine's `Proposer` protocol on top of a drafter (EAGLE/EAGLE3/MTP).

Owns the translation from the engine's per-step `ProposerInput`s (positions made final this
step, their target hidden states, the request's real tokens and block table) to one batched
`Drafter.write_draft_kv` catch-up and one batched `Drafter.propose`, the drafter's own
`PagedKVCache` (same num_blocks / block_size as the target's), and the per-request
`DraftCarry` (dropped when a request's next pass does not continue where the last ended: a
prefix hit or a resumed preemption starts fresh, which is correct because every position below
the new start already has all modules' draft KV).

Lazy catch-up: a request that gets no drafts next step does not need its draft KV yet, except
where a block hash can name it. A block's hash exists only once the block is full of real
tokens (and, with lookahead hashes, its successors are known too), so while every position
some module has not written yet lies in the request's last, not yet full block, those
positions are kept (their target hidden states, copied) and written in one batched pass when
the request drafts again or its block fills, whichever comes first.
Every position of a full block is written in the step that fills it, before the scheduler
appends the token that creates its hash: a hit never reads draft KV that is not written. On a
step without drafts this skips the drafter entirely for most requests. The deferred rows live
in `DeferredRows`' preallocated per-request slots: a step appends its rows once, batched.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from speckv.cache.drafter_policy import DrafterPolicy
from speckv.drafters.deferred_rows import DeferredRows, DeferredSpan, ranges
from speckv.drafters.draft_state import CatchUpBatch, CatchUpRequest, DraftCarry, TargetStates
from speckv.speculation.proposer import ProposerBatch, ProposerInput, ProposeTiming

if TYPE_CHECKING:  # the drafter builds this proposer (`Drafter.make_proposer`)
    from speckv.drafters.base import Drafter


def _target_states(items: Sequence[ProposerInput], num_aux: int) -> TargetStates:
    """The items' target rows, in order, as one TargetStates: one gather from the step's
    shared rows when the runner built the items, else the items' own tensors concatenated."""
    shared = items[0].target_rows
    if shared is not None and all(x.target_rows is shared for x in items):
        counts = np.fromiter((x.end - x.start for x in items), np.int64, len(items))
        firsts = np.fromiter((x.first_row for x in items), np.int64, len(items))
        return _gather_rows(shared, firsts, counts, num_aux)
    return TargetStates(
        torch.cat([x.hidden_states for x in items]),
        tuple(torch.cat([x.aux_hidden_states[i] for x in items]) for i in range(num_aux)),
    )


@dataclass(frozen=True)
class _Deferred:
    """Positions [start, end) of one request: the rows deferred before a pass joined with the
    pass's own (the per-request path's catch-up input, each [end - start, hidden])."""

    start: int
    end: int
    hidden_states: torch.Tensor
    aux_hidden_states: tuple[torch.Tensor, ...]


class DrafterProposer:
    """Runner adapter: call `propose(inputs)` once per step (see speckv/speculation/proposer.py)."""

    def __init__(
        self,
        drafter: Drafter,
        num_spec_tokens: int,
        num_blocks: int,
        block_size: int,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        if num_spec_tokens < 1:
            raise ValueError(f"num_spec_tokens must be >= 1, got {num_spec_tokens}")
        self.drafter = drafter
        self.policy: DrafterPolicy = drafter.policy  # decides lookahead hashes vs the drop
        self.num_spec_tokens = num_spec_tokens
        self.aux_layers: tuple[int, ...] = drafter.target_aux_layers
        self.kv_cache = drafter.make_kv_cache(num_blocks, block_size)
        self._carries: dict[str, DraftCarry] = {}
        # lazy catch-up (module docstring): deferred positions and their target rows
        self._deferred = DeferredRows(block_size)
        self.clock = clock  # times the catch-up and the drafts (the adaptive policy's clock)
        self.last_timing = ProposeTiming()

    def bind_target_kv(self, kv_cache, layout) -> None:
        """Reads the target's hidden states, not its KV."""

    def free(self, request_id: str) -> None:
        """Forget a finished request's carry (the engine should call this when it frees one)."""
        self._carries.pop(request_id, None)
        self._deferred.drop(request_id)

    def num_deferred_positions(self, request_id: str) -> int:
        """Final positions of a request whose draft KV is not written yet (lazy catch-up)."""
        span = self._deferred.get(request_id)
        return span.end - span.start if span is not None else 0

    def _with_deferred(self, x: ProposerInput) -> _Deferred | None:
        """x's rows after the positions deferred before them (dropped when x does not continue
        them: after a prefix hit or a preemption those positions are computed again); None
        when nothing deferred joins them (x's own rows, not sliced out here)."""
        span = self._deferred.take(x.request_id) if self._deferred else None
        if span is None:
            return None
        try:
            if span.end != x.start:
                return None
            hidden, *aux = self._deferred.rows(span)
            return _Deferred(span.start, x.end, torch.cat([hidden, x.hidden_states]),
                             tuple(torch.cat([a, b]) for a, b in zip(aux, x.aux_hidden_states)))
        finally:
            self._deferred.release(span)  # its rows are copied (or not needed) by now

    def _first_unwritten(self, request_id: str, start: int) -> int:
        """The first position some module has not written the draft KV of: `start` (where
        this pass's rows begin), or earlier where a lagging module (k-module MTP) still holds
        carried rows."""
        carry = self._carries.get(request_id)
        if carry is None or carry.next_position != start:
            return start
        return min([start, *carry.start])

    def propose(self, inputs: Sequence[ProposerInput]) -> dict[str, list[int]]:
        if (isinstance(inputs, ProposerBatch) and inputs and len(self.drafter.modules_chain) == 1
                and self.drafter.draft_kv_lookahead_tokens == 1):
            return self._propose_batch(inputs)
        began = self.clock()
        self.last_timing = ProposeTiming()
        L = self.drafter.draft_kv_lookahead_tokens
        block_size = self.kv_cache.block_size
        items: list[tuple[ProposerInput, _Deferred | None]] = []
        want: list[int] = []
        for x in inputs:
            if x.end <= x.start:
                continue
            rows = self._with_deferred(x)
            first = x.start if rows is None else rows.start
            # Draft only for requests whose catch-up reaches their last real token.
            drafts = x.wants_drafts and x.max_drafts > 0 and x.end == len(x.token_ids) - 1
            first_open_block = len(x.token_ids) // block_size * block_size
            if not drafts and self._first_unwritten(x.request_id, first) >= first_open_block:
                # no hash can name these positions yet: write them later, in one pass
                kept = x if rows is None else rows
                self._deferred.extend(
                    [x.request_id], [None], np.array([first]), np.array([kept.end]),
                    (kept.hidden_states, *kept.aux_hidden_states[:len(self.aux_layers)]),
                    np.arange(kept.end - first))
                continue
            if drafts:
                want.append(len(items))
            items.append((x, rows))
        if not items:
            self.last_timing = ProposeTiming(self.clock() - began, 0.0)
            return {}
        reqs = []
        carries = self._carries
        for x, rows in items:
            first, end = (x.start, x.end) if rows is None else (rows.start, rows.end)
            carry = carries.get(x.request_id)
            if carry is not None and carry.next_position != first:
                carry = None  # prefix hit / preemption: positions below first are complete
            # Real tokens after each final position, plus up to L - 1 more known ones (prefill).
            nxt = list(x.token_ids[first + 1 : end + L])
            reqs.append(CatchUpRequest(first, end - first, nxt, x.block_table, carry))
        if all(rows is None for _, rows in items):
            # nothing deferred joined these rows: one gather from the step's shared rows
            states = _target_states([x for x, _ in items], len(self.aux_layers))
        else:
            joined = [(x.hidden_states, x.aux_hidden_states) if rows is None
                      else (rows.hidden_states, rows.aux_hidden_states) for x, rows in items]
            states = TargetStates(
                torch.cat([hidden for hidden, _ in joined]),
                tuple(
                    torch.cat([aux[i] for _, aux in joined])
                    for i in range(len(self.aux_layers))
                ),
            )
        state = self.drafter.write_draft_kv(states, reqs, self.kv_cache, will_propose=bool(want))
        for (x, _), c in zip(items, state.carries):
            self._carries[x.request_id] = c
        caught_up = self.clock()
        self.last_timing = ProposeTiming(caught_up - began, 0.0)
        if not want:
            return {}
        asked = [items[i][0] for i in want]
        # Greedy drafts are a prefix of longer runs: draft no more than any request may take.
        num = min(self.num_spec_tokens, max(x.max_drafts for x in asked))
        drafts = self.drafter.propose(state.subset(want), num, self.kv_cache).tolist()
        self.last_timing = ProposeTiming(caught_up - began, self.clock() - caught_up)
        return {x.request_id: d[: x.max_drafts] for x, d in zip(asked, drafts)}

    def _propose_batch(self, batch: ProposerBatch) -> dict[str, list[int]]:
        """`propose` of a one-module chain over the runner's whole-batch arrays: the same
        catch-up rows, deferrals and drafts as the per-request path above (a one-module chain
        carries nothing between passes), decided with array ops."""
        begin = self.clock()
        self.last_timing = ProposeTiming()
        n = len(batch)
        starts, ends = batch.start, batch.end
        num_tokens = np.fromiter(map(len, batch.token_ids), np.int64, n)
        live = ends > starts
        rows = batch.target_rows
        num_aux = len(self.aux_layers)
        sources = (rows.hidden_states, *rows.aux_hidden_states[:num_aux])
        store = self._deferred
        joined, first = self._join_deferred(batch, live)
        # Draft only for requests whose catch-up reaches their last real token.
        drafts = live & batch.wants_drafts & (batch.max_drafts > 0) & (ends == num_tokens - 1)
        block_size = self.kv_cache.block_size
        # no hash can name these positions yet: write them later, in one pass
        defer = live & ~drafts & (first >= num_tokens // block_size * block_size)
        keep = np.flatnonzero(live & ~defer)
        caught_up_spans = [joined[i] for i in keep.tolist() if i in joined]
        states = None
        if keep.shape[0]:
            first_k, ends_k = first[keep], ends[keep]
            if bool((ends_k >= num_tokens[keep]).any()):
                raise ValueError("each request needs >= 1 position and a known next token for "
                                 "each")
            counts = ends_k - first_k
            if caught_up_spans:
                states = self._joined_states(batch, keep, first_k, counts, joined, sources)
            else:
                states = _gather_rows(rows, batch.first_row[keep], counts, num_aux)
        deferred = np.flatnonzero(defer)
        if deferred.shape[0]:
            store.extend([batch.request_ids[i] for i in deferred.tolist()],
                         [joined.get(i) for i in deferred.tolist()], starts[deferred],
                         ends[deferred], sources,
                         ranges(batch.first_row[deferred], ends[deferred] - starts[deferred]))
        for span in caught_up_spans:  # after the gather above read their rows
            store.release(span)
        if states is None:
            self.last_timing = ProposeTiming(self.clock() - begin, 0.0)
            return {}
        whole = keep.shape[0] == n
        tokens = batch.token_ids
        next_ids = np.fromiter(
            itertools.chain.from_iterable(
                tokens[i][a + 1 : b + 1]
                for i, a, b in zip(keep.tolist(), first_k.tolist(), ends_k.tolist())),
            np.int64, int(counts.sum()))
        table = batch.block_table if whole else batch.block_table[keep]
        lens = batch.block_table_lens if whole else batch.block_table_lens[keep]
        want = np.flatnonzero(drafts[keep])
        last = self.drafter.write_draft_kv_batch(
            states, CatchUpBatch(first_k, counts, next_ids, table, lens), self.kv_cache,
            will_propose=want.shape[0] > 0)
        caught_up = self.clock()
        self.last_timing = ProposeTiming(caught_up - begin, 0.0)
        if last is None or want.shape[0] == 0:
            return {}
        asked = keep[want]
        max_drafts = batch.max_drafts[asked]
        # Greedy drafts are a prefix of longer runs: draft no more than any request may take.
        num = min(self.num_spec_tokens, int(max_drafts.max()))
        out = self.drafter.propose(last.subset(want), num, self.kv_cache).tolist()
        self.last_timing = ProposeTiming(caught_up - begin, self.clock() - caught_up)
        request_ids = batch.request_ids
        return {request_ids[i]: d[:m]
                for i, d, m in zip(asked.tolist(), out, max_drafts.tolist())}

    def _join_deferred(self, batch: ProposerBatch, live: np.ndarray
                       ) -> tuple[dict[int, DeferredSpan], np.ndarray]:
        """The rows that continue positions deferred before them (taken either way, as in
        the per-request path; the spans that do not continue are dropped): the joined spans
        by batch index, and each request's first catch-up position."""
        store = self._deferred
        starts = batch.start
        joined: dict[int, DeferredSpan] = {}
        if store:
            for i in np.flatnonzero(live).tolist():
                span = store.take(batch.request_ids[i])
                if span is None:
                    continue
                if span.end == int(starts[i]):
                    joined[i] = span
                else:
                    store.release(span)
        first = starts
        if joined:
            first = starts.copy()
            for i, span in joined.items():
                first[i] = span.start
        return joined, first

    def _joined_states(self, batch: ProposerBatch, keep: np.ndarray, first: np.ndarray,
                       counts: np.ndarray, joined: dict[int, DeferredSpan],
                       sources: Sequence[torch.Tensor]) -> TargetStates:
        """The rows of requests `keep` (positions first .. first + counts - 1 each, in order),
        the deferred ones (`joined`) from the store, the step's from `sources`: two gathers per
        tensor, whatever the batch."""
        spans = [joined.get(i) for i in keep.tolist()]
        num_old = np.fromiter((0 if s is None else s.end - s.start for s in spans), np.int64,
                              len(spans))
        offsets = np.cumsum(counts) - counts  # each request's first row in the output
        has_old = np.flatnonzero(num_old)
        old_dest = torch.from_numpy(ranges(offsets[has_old], num_old[has_old]))
        old_rows = self._deferred.gather(
            self._deferred.slot_rows_index([spans[j] for j in has_old.tolist()]))
        num_new = counts - num_old
        new_dest = torch.from_numpy(ranges(offsets + num_old, num_new))
        new_src = torch.from_numpy(ranges(batch.first_row[keep], num_new))
        total = int(counts.sum())
        out = []
        for source, old in zip(sources, old_rows, strict=True):
            t = source.new_empty((total, source.shape[1]))
            t.index_copy_(0, old_dest.to(t.device), old.to(t.dtype))
            t.index_copy_(0, new_dest.to(t.device), source.index_select(0, new_src.to(
                source.device)))
            out.append(t)
        return TargetStates(out[0], tuple(out[1:]))


def _gather_rows(shared, firsts: np.ndarray, counts: np.ndarray, num_aux: int) -> TargetStates:
    """Rows firsts[i] .. firsts[i] + counts[i] - 1 of the step's shared target rows, in order:
    the rows themselves when that is all of them, else one gather."""
    total = int(counts.sum())
    index = ranges(firsts, counts)  # [total] row of every position
    if total == shared.hidden_states.shape[0] and bool((index == np.arange(total)).all()):
        return TargetStates(shared.hidden_states, tuple(shared.aux_hidden_states[:num_aux]))
    rows = torch.from_numpy(index).to(shared.hidden_states.device)
    return TargetStates(shared.hidden_states.index_select(0, rows),
                        tuple(h.index_select(0, rows) for h in shared.aux_hidden_states[:num_aux]))
