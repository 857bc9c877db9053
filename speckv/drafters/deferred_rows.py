"""`DeferredRows`: the target rows of positions whose draft KV the lazy catch-up has not written.

Owns, per request, the span [start, end) of positions deferred by `DrafterProposer` (see its
module docstring) and copies of their target rows (hidden states and aux hidden states) in one
preallocated slot of `slot_rows` rows per request. A step appends its new rows to a request's
slot in one batched `index_copy_` per tensor for the whole batch, instead of a `torch.cat` of
the rows deferred before and a `.clone()` per request and tensor: rows deferred once are never
copied again until the catch-up reads them. The slots grow (doubling) when every one is taken;
a slot is reused once its request is caught up, dropped or freed.

Deferred positions all lie in a request's open (not yet full) block, so a slot of block_size
rows holds them; a longer span is a caller's bug and is refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


def ranges(firsts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """[sum(counts)] int64: firsts[i] + 0 .. counts[i] - 1 for each i, in order."""
    total = int(counts.sum())
    return np.repeat(firsts - (np.cumsum(counts) - counts), counts) + np.arange(total)


@dataclass(frozen=True)
class DeferredSpan:
    """Positions [start, end) of one request, their rows at slot * slot_rows + 0 .. end - start."""

    slot: int
    start: int
    end: int


class DeferredRows:
    """Deferred positions and their target rows, one slot per request (module docstring)."""

    def __init__(self, slot_rows: int) -> None:
        if slot_rows < 1:
            raise ValueError(f"slot_rows must be >= 1, got {slot_rows}")
        self.slot_rows = slot_rows
        self._spans: dict[str, DeferredSpan] = {}
        self._free: list[int] = []  # slots no span holds
        self._num_slots = 0
        # hidden states then aux hidden states, each [num_slots * slot_rows, width]
        self._stores: list[torch.Tensor] = []

    def __bool__(self) -> bool:
        return bool(self._spans)

    def get(self, request_id: str) -> DeferredSpan | None:
        return self._spans.get(request_id)

    def take(self, request_id: str) -> DeferredSpan | None:
        """Forget the request's span; its slot (and rows) stay held until `release`."""
        return self._spans.pop(request_id, None)

    def release(self, span: DeferredSpan) -> None:
        self._free.append(span.slot)

    def drop(self, request_id: str) -> None:
        span = self._spans.pop(request_id, None)
        if span is not None:
            self._free.append(span.slot)

    def rows(self, span: DeferredSpan) -> tuple[torch.Tensor, ...]:
        """Views of a span's rows (hidden, then aux), each [end - start, width]."""
        first = span.slot * self.slot_rows
        return tuple(store[first : first + span.end - span.start] for store in self._stores)

    def slot_rows_index(self, spans: Sequence[DeferredSpan]) -> np.ndarray:
        """[sum of span lengths] int64: the store rows of `spans`, in order."""
        return ranges(np.fromiter((s.slot * self.slot_rows for s in spans), np.int64, len(spans)),
                      np.fromiter((s.end - s.start for s in spans), np.int64, len(spans)))

    def gather(self, index: np.ndarray) -> tuple[torch.Tensor, ...]:
        """Store rows `index` (hidden, then aux), each [len(index), width]."""
        rows = torch.from_numpy(index).to(self._stores[0].device)
        return tuple(store.index_select(0, rows) for store in self._stores)

    def extend(self, request_ids: Sequence[str], spans: Sequence[DeferredSpan | None],
               starts: np.ndarray, ends: np.ndarray, sources: Sequence[torch.Tensor],
               source_rows: np.ndarray) -> None:
        """Defer positions [starts[i], ends[i]) of request_ids[i], after its held span
        spans[i] (taken, continuing at starts[i]) or in a new slot (None). Their rows are
        `sources` (hidden, then aux, each [rows, width]) rows `source_rows`, in order."""
        n = len(request_ids)
        if n == 0:
            return
        counts = ends - starts
        offsets = np.zeros(n, np.int64)
        span_starts = starts.copy()
        for i, span in enumerate(spans):
            if span is not None:
                if span.end != int(starts[i]):
                    raise ValueError("a span is extended only where it ends")
                offsets[i], span_starts[i] = span.end - span.start, span.start
        if bool(((offsets + counts) > self.slot_rows).any()):
            raise ValueError(f"more than {self.slot_rows} deferred positions for one request")
        while len(self._free) < sum(span is None for span in spans):
            self._grow(sources)
        slots = np.fromiter((self._free.pop() if span is None else span.slot for span in spans),
                            np.int64, n)
        dest = torch.from_numpy(ranges(slots * self.slot_rows + offsets, counts))
        src = torch.from_numpy(source_rows)
        for store, source in zip(self._stores, sources, strict=True):
            store.index_copy_(0, dest.to(store.device), source.index_select(0, src.to(
                source.device)).to(store.dtype))
        for request_id, slot, first, end in zip(request_ids, slots.tolist(), span_starts.tolist(),
                                                ends.tolist()):
            self._spans[request_id] = DeferredSpan(slot, first, end)

    def _grow(self, like: Sequence[torch.Tensor]) -> None:
        """Double the slots (8 at first); stores shaped after `like` (hidden, then aux)."""
        old = self._num_slots
        new = max(8, 2 * old)
        self._free.extend(range(new - 1, old - 1, -1))
        rows = (new - old) * self.slot_rows
        if not self._stores:
            self._stores = [t.new_empty((rows, t.shape[1])) for t in like]
        else:
            self._stores = [torch.cat([s, s.new_empty((rows, s.shape[1]))]) for s in self._stores]
        self._num_slots = new
