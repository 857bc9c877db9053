"""The copy thread of a tier connector: the store queue, its staging slots and its counters.

Owns everything the engine thread shares with the thread that stores snapshots in the tier,
all under one condition (`cond`): the staging slots, the queue of snapshots, the blocks in
flight (queued, not yet stored), the saves outstanding per request, the tier's KV events and
its counters. The scheduler side (`tier_scheduler.py`) and the worker side (`tier_worker.py`)
read and write these only under `cond`.

A staging slot has two possible readers: the copy thread (until the block is stored) and the
step's loads (a block saved and loaded in the same step, or found in flight). It is counted
out to each and goes back to the free list only when both are done, so a later snapshot of
the same step can never overwrite a slot a load is about to read (the copy thread may settle
a block between two saves of one snapshot pass).

The copy thread is real by default; with a `CopySchedule` (`copy_schedule.py`) there is no
thread and queued stores run on the engine thread at the `CopyPoint`s the sides pass, so a
run that found a race replays from its seed.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from speckv.cache.block import CacheKey, split_cache_key
from speckv.cache.events import BlockRemoved, BlockStored, KVCacheEvent
from speckv.connectors.copy_schedule import CopyPoint, CopySchedule
from speckv.connectors.layout import BlockLayout, BlockTensors
from speckv.connectors.metadata import BlockDescriptor
from speckv.connectors.rules import ConnectorMode
from speckv.connectors.store import BlockStore, PutOutcome, PutResult
from speckv.hashing.extra_keys import untag


@dataclass(frozen=True)
class Snapshot:
    """One saved block's bytes in host memory, waiting for the copy thread (or a load)."""

    block: BlockDescriptor
    tensors: BlockTensors  # one block per segment, host memory
    request_id: str
    lora_name: str | None
    slot: int | None  # its staging slot; None: a private copy for this step's loads only
    ready: Any = None  # CUDA: an event the copy out of device memory completes at

    def wait(self) -> BlockTensors:
        if self.ready is not None:
            self.ready.synchronize()
        return self.tensors


class Staging:
    """Host buffers where snapshots wait until the copy thread has stored them (pinned on a
    GPU machine). Reused, so a step never pays for fresh memory; its size is the copy queue's
    bound. Each slot counts its readers (the copy thread, this step's loads): `take` gives
    the slot to its first reader, `hold` adds one, and the slot is free again only once every
    reader has called `release`. Called under the copier's `cond`."""

    def __init__(self, layout: BlockLayout, capacity: int, pin: bool) -> None:
        # zeros, not empty: the memory is committed now, not by page faults in a step
        self._data = tuple(
            torch.zeros((capacity, *segment.block_shape), dtype=segment.torch_dtype,
                        pin_memory=pin)
            for segment in layout.segments
        )
        self._free = list(range(capacity - 1, -1, -1))
        self._readers: Counter[int] = Counter()

    def take(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._readers[slot] = 1
        return slot

    def hold(self, slot: int) -> None:
        if self._readers[slot] < 1:
            raise RuntimeError(f"staging slot {slot} is free: nothing to hold")
        self._readers[slot] += 1

    def release(self, slot: int) -> None:
        if self._readers[slot] < 1:
            raise RuntimeError(f"staging slot {slot} released more often than taken")
        self._readers[slot] -= 1
        if self._readers[slot] == 0:
            del self._readers[slot]
            self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def block(self, slot: int) -> BlockTensors:
        return tuple(data[slot] for data in self._data)


class TierCopier:
    """The copy queue and the thread (or seeded schedule) that drains it into the tier.

    Exists from the connector's construction (its counters answer `stats()` before
    `initialize`); `start` binds the tier and starts the thread."""

    def __init__(self, name: str, medium: str) -> None:
        self.name = name
        self.medium = medium
        self.cond = threading.Condition()
        # shared with the copy thread, under cond
        self.staging: Staging | None = None
        self.queue: deque[Snapshot] = deque()
        self.in_flight: dict[CacheKey, Snapshot] = {}
        self.outstanding: Counter[str] = Counter()  # saves listed but not settled, by request
        self.events: list[KVCacheEvent] = []
        self.counts: Counter[str] = Counter()
        self.last_save_error = ""
        self._stopping = False
        self._thread: threading.Thread | None = None
        self.schedule: CopySchedule | None = None  # None: a real copy thread
        self._store: BlockStore | None = None
        self._mode: ConnectorMode | None = None

    def start(self, store: BlockStore, mode: ConnectorMode, staging: Staging) -> None:
        """Bind the tier; start the copy thread unless a schedule runs the stores."""
        self._store, self._mode, self.staging = store, mode, staging
        if self.schedule is None:
            self._thread = threading.Thread(target=self._copy_loop,
                                            name=f"speckv-{self.name}-copy", daemon=True)
            self._thread.start()

    def hold(self, slot: int) -> None:
        """One more reader of `slot` (under cond)."""
        assert self.staging is not None
        self.staging.hold(slot)

    def release_slot(self, slot: int) -> None:
        """A reader of `slot` is done (under cond)."""
        assert self.staging is not None
        self.staging.release(slot)

    def _copy_loop(self) -> None:
        while True:
            with self.cond:
                while not self.queue and not self._stopping:
                    self.cond.wait()
                if self._stopping:
                    return
            self.copy_one()

    def copy_one(self) -> bool:
        """Store the oldest queued snapshot (on the copy thread, or where a schedule runs it).
        False if nothing was queued."""
        store = self._store
        assert store is not None
        with self.cond:
            if not self.queue:
                return False
            snapshot = self.queue.popleft()
        try:
            result: PutResult | None = store.put(snapshot.block, snapshot.wait())
            error = ""
        except Exception as exc:  # a store that breaks must not stop the thread
            result, error = None, f"{type(exc).__name__}: {exc}"
        with self.cond:
            # only now: a load that misses the queue must find the block in the tier
            self.in_flight.pop(snapshot.block.key, None)
            if snapshot.slot is not None and self.staging is not None:
                self.release_slot(snapshot.slot)
            self.outstanding[snapshot.request_id] -= 1
            if result is None:
                self.counts["save_errors"] += 1
                self.last_save_error = error
            else:
                self._settle(snapshot, result)
            self.cond.notify_all()
        return True

    def copy_point(self, point: CopyPoint) -> None:
        """A place where the copy thread could have run: under a schedule, run what it says."""
        if self.schedule is None or self._store is None:
            return
        with self.cond:
            queued = len(self.queue)
        for _ in range(self.schedule.copies_at(point, queued)):
            if not self.copy_one():
                break

    def drain(self) -> None:
        """Under a schedule, nobody else runs the queue: a wait for it runs it to the end."""
        if self.schedule is not None:
            while self.copy_one():
                pass

    def wait_settled(self, timeout_s: float | None = None) -> bool:
        """Run (or wait for) the queue until nothing is in flight. True if it settled."""
        self.drain()
        with self.cond:
            return self.cond.wait_for(lambda: not self.in_flight, timeout_s)

    def _settle(self, snapshot: Snapshot, result: PutResult) -> None:
        """Count and record events for one store (under cond)."""
        mode = self._mode
        assert mode is not None
        if result.outcome is PutOutcome.STORED:
            self.counts["saved_blocks"] += 1
            self.counts["saved_bytes"] += result.nbytes
            block = snapshot.block
            self.events.append(BlockStored(
                block_hashes=[block.block_hash],
                parent_block_hash=block.parent_hash or None,
                token_ids=list(block.token_ids),
                block_size=mode.block_size,
                lora_name=snapshot.lora_name,
                extra_keys=None if block.extra_keys is None else [untag(block.extra_keys)],
                group_idx=block.group_id,
                lookahead_token_ids=[list(block.lookahead_token_ids)]
                if mode.lookahead_tokens else None,
                medium=self.medium,
            ))
        elif result.outcome is PutOutcome.PRESENT:
            self.counts["save_skipped_blocks"] += 1
        else:
            self.counts["save_dropped_no_room"] += 1
        self.record_removed(result.evicted)

    def record_removed(self, keys: Sequence[CacheKey]) -> None:
        """Count evictions and record their events (under cond)."""
        if not keys:
            return
        self.counts["evicted_blocks"] += len(keys)
        by_group: dict[int, list[bytes]] = {}
        for key in keys:
            block_hash, group_id = split_cache_key(key)
            by_group.setdefault(group_id, []).append(block_hash)
        for group_id, hashes in by_group.items():
            self.events.append(BlockRemoved(hashes, group_id, medium=self.medium))

    def take_events(self) -> list[KVCacheEvent]:
        with self.cond:
            events, self.events = self.events, []
        return events

    def stop(self) -> None:
        """Stop the copy thread; stores still queued are dropped (counted)."""
        with self.cond:
            self._stopping = True
            self.cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self.cond:
            for snapshot in self.queue:
                self.in_flight.pop(snapshot.block.key, None)
                self.outstanding[snapshot.request_id] -= 1
            self.counts["save_dropped_queue_full"] += len(self.queue)
            self.queue.clear()
