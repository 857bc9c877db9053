"""A content-addressed tier connector: the logic every storage tier shares.

Owns the connector side of a tier (the CPU pool and the disk directory plug in as a
`BlockStore`): which blocks a request may load and must store (`rules.py`), the per-step
metadata, the snapshot-then-load order of the worker phase, and the copy thread that stores
blocks off the step's critical path.

The life of a saved block (the tier itself is a `BlockStore`, `store.py`):

    build_connector_meta   listed in this step's saves      -> "pending"  (lookups see it)
    start_load_kv          device bytes copied to host memory (the snapshot), before any load
                           or forward can overwrite the block; queued for the copy thread
                                                             -> "in flight" (loads read it)
    copy thread            stored in the tier (or dropped)   -> settled

A full queue (`max_pending_blocks` snapshots in flight) drops the store and counts it, so a
slow tier never blocks a step. Lookups see pending and in-flight blocks too, and a load in the
same step reads them from the snapshot: a request that finishes and comes straight back hits
everything it stored.

A staging slot has two possible readers: the copy thread (until the block is stored) and this
step's loads (a block saved and loaded in the same step, or found in flight). It is counted
out to each and goes back to the free list only when both are done, so a later snapshot of
the same step can never overwrite a slot a load is about to read (the copy thread may settle
a block between two saves of one snapshot pass).

The copy thread is real by default; `run_copies_on(schedule)` replaces it with a seeded
schedule that runs queued stores at chosen points on the engine thread (`copy_schedule.py`),
so a run that found a race replays from its seed.

Loads are pinned in the store from `update_state_after_alloc` until copied, so eviction never
takes a block that is being loaded. A load stops at the first block it cannot serve (evicted,
corrupt, or not what the request expects); that block and the rest of the load are reported
failed and the engine recomputes them.
"""

from __future__ import annotations

import threading
from abc import abstractmethod
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from speckv.cache.block import CacheKey, make_cache_key, split_cache_key
from speckv.cache.events import BlockRemoved, BlockStored, KVCacheEvent
from speckv.connectors.base import (
    ExternalHit,
    FinishDecision,
    KVConnector,
    RequestBlocks,
)
from speckv.connectors.codec import CodecMiss, MissReason
from speckv.connectors.copy_schedule import CopyPoint, CopySchedule
from speckv.connectors.layout import BlockLayout, BlockTensors, DeviceKV
from speckv.connectors.metadata import (
    BlockDescriptor,
    ConnectorMetadata,
    ConnectorOutput,
    ConnectorStats,
    LoadFailure,
    RequestLoad,
    RequestSave,
    StepMetadata,
)
from speckv.connectors.rules import (
    ConnectorMode,
    ConnectorRequest,
    describe_block,
    num_lookup_candidates,
    num_servable_blocks,
    num_storable_blocks,
)
from speckv.connectors.store import BlockStore, PutOutcome, PutResult, StoreUsage
from speckv.hashing.extra_keys import untag

NULL_BLOCK_ID = 0  # the block manager's "no KV here" block: never saved
DEFAULT_MAX_PENDING_BLOCKS = 256


@dataclass
class _Tracked:
    """Scheduler-side state of one request: how far its blocks were considered for saving,
    and, until its first step's metadata is built, the tokens whose KV is surely written."""

    num_considered_blocks: int = 0
    # The step that admits a request loads its external range (from this tier or a sibling
    # tier of a multi-connector) *during* the worker phase, after saves are snapshotted: in
    # that step only the local hit may be saved, whatever the engine counts as computed.
    written_cap: int | None = None


@dataclass(frozen=True)
class _Snapshot:
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


class _Staging:
    """Host buffers where snapshots wait until the copy thread has stored them (pinned on a
    GPU machine). Reused, so a step never pays for fresh memory; its size is the copy queue's
    bound. Each slot counts its readers (the copy thread, this step's loads): `take` gives
    the slot to its first reader, `hold` adds one, and the slot is free again only once every
    reader has called `release`. Called under the connector's lock."""

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


class TierConnector(KVConnector):
    """The shared logic; subclasses say where blocks live (`_open_store`)."""

    medium: str = "CPU"

    def __init__(self, name: str, max_pending_blocks: int = DEFAULT_MAX_PENDING_BLOCKS) -> None:
        if max_pending_blocks < 1:
            raise ValueError(f"max_pending_blocks must be >= 1, got {max_pending_blocks}")
        self.name = name
        self.max_pending_blocks = max_pending_blocks
        self._kv: DeviceKV | None = None
        self._mode: ConnectorMode | None = None
        self._store: BlockStore | None = None
        # engine thread only
        self._step = 0
        self._unstarted_step: int | None = None  # built, not yet through load_blocks
        self._tracked: dict[str, _Tracked] = {}
        self._planned_loads: dict[str, RequestLoad] = {}
        self._exit_saves: list[RequestSave] = []
        self._pending: set[CacheKey] = set()
        self._step_snapshots: dict[CacheKey, _Snapshot] = {}
        self._failed_block_ids: frozenset[int] = frozenset()
        self._finished_loads: set[str] = set()
        self._load_failures: list[LoadFailure] = []
        self._exited: set[str] = set()
        # shared with the copy thread, under _cond
        self._cond = threading.Condition()
        self._staging: _Staging | None = None
        self._queue: deque[_Snapshot] = deque()
        self._in_flight: dict[CacheKey, _Snapshot] = {}
        self._outstanding: Counter[str] = Counter()  # saves listed but not settled, by request
        self._events: list[KVCacheEvent] = []
        self._counts: Counter[str] = Counter()
        self._last_save_error = ""
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._store_wrapper: Callable[[BlockStore], BlockStore] | None = None
        self._schedule: CopySchedule | None = None  # None: a real copy thread
        self._held_slots: list[int] = []  # staging slots this step's loads read (engine thread)

    @property
    def supports_lookahead_block_hashes(self) -> bool:
        # Stores and lookups cover only blocks named by the request's block hashes.
        return True

    # ---- set-up ------------------------------------------------------------------------------
    @abstractmethod
    def _open_store(self, kv: DeviceKV, mode: ConnectorMode) -> BlockStore:
        """Create or open the tier for this layout and mode."""

    def wrap_store(self, wrapper: Callable[[BlockStore], BlockStore]) -> None:
        """Put `wrapper(store)` in front of the tier's storage when it opens (before
        `initialize`): the seam for fault injection and content checks in tests."""
        if self._store is not None:
            raise RuntimeError(f"connector {self.name!r}: wrap_store after initialize")
        self._store_wrapper = wrapper

    def run_copies_on(self, schedule: CopySchedule) -> None:
        """Run queued stores where `schedule` says, on the engine thread, instead of on a copy
        thread (before `initialize`): the seam that makes tier runs replayable from a seed."""
        if self._store is not None:
            raise RuntimeError(f"connector {self.name!r}: run_copies_on after initialize")
        self._schedule = schedule

    def initialize(self, kv: DeviceKV, mode: ConnectorMode) -> None:
        if self._store is not None:
            raise RuntimeError(f"connector {self.name!r} is already initialized")
        if kv.layout.block_size != mode.block_size:
            raise ValueError(
                f"connector {self.name!r}: the caches' block size {kv.layout.block_size} is not "
                f"the hash unit {mode.block_size}"
            )
        store = self._open_store(kv, mode)
        self._store = self._store_wrapper(store) if self._store_wrapper is not None else store
        self._staging = _Staging(kv.layout, self.max_pending_blocks, kv.device.type == "cuda")
        self._kv, self._mode = kv, mode
        if self._schedule is None:
            self._thread = threading.Thread(target=self._copy_loop,
                                            name=f"speckv-{self.name}-copy", daemon=True)
            self._thread.start()

    def _ready(self) -> tuple[DeviceKV, ConnectorMode, BlockStore]:
        if self._store is None or self._kv is None or self._mode is None:
            raise RuntimeError(f"connector {self.name!r} is used before initialize()")
        return self._kv, self._mode, self._store

    @property
    def mode(self) -> ConnectorMode:
        return self._ready()[1]

    @property
    def store(self) -> BlockStore:
        """The tier's storage (for tools and tests; the connector is its only writer)."""
        return self._ready()[2]

    # ---- scheduler side ----------------------------------------------------------------------
    def _contains(self, key: CacheKey) -> bool:
        self._copy_point(CopyPoint.LOOKUP)
        if key in self._pending:
            return True
        with self._cond:
            if key in self._in_flight:
                return True
        return self._ready()[2].contains(key)

    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_local_hit_tokens: int) -> ExternalHit:
        hit = self.peek_num_matched_tokens(request, num_local_hit_tokens)
        with self._cond:
            self._counts["lookups"] += 1
            self._counts["hit_blocks"] += hit.num_tokens // self.mode.block_size
        return hit

    def peek_num_matched_tokens(self, request: ConnectorRequest,
                                num_local_hit_tokens: int) -> ExternalHit:
        _, mode, _ = self._ready()
        start = self._first_block(num_local_hit_tokens, mode)
        hashes = request.get_block_hashes(mode.lookahead_tokens)
        end = num_lookup_candidates(request.num_tokens, len(hashes), mode.block_size)
        run = 0
        for index in range(start, end):
            if not self._contains(make_cache_key(hashes[index], mode.group_id)):
                break
            run += 1
        servable = num_servable_blocks(run, mode)
        if servable == 0:
            return ExternalHit(0)
        return ExternalHit(servable * mode.block_size, self.medium)

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[int],
                                 num_local_hit_tokens: int, num_external_tokens: int) -> None:
        _, mode, store = self._ready()
        start = self._first_block(num_local_hit_tokens, mode)
        if num_external_tokens < 0 or num_external_tokens % mode.block_size:
            raise ValueError(
                f"num_external_tokens must be a whole number of {mode.block_size}-token blocks, "
                f"got {num_external_tokens}"
            )
        end = start + num_external_tokens // mode.block_size
        request_id = request.request_id
        self._drop_planned_load(request_id)
        # a request loading from the tier starts saving after what it loads
        self._tracked[request_id] = _Tracked(num_considered_blocks=end if end > start else 0,
                                             written_cap=num_local_hit_tokens)
        if end == start:
            return
        if len(block_ids) < end:
            raise ValueError(
                f"request {request_id}: {len(block_ids)} device blocks cannot hold a load "
                f"up to block {end}"
            )
        hashes = request.get_block_hashes(mode.lookahead_tokens)
        blocks = tuple(describe_block(request, hashes, i, mode) for i in range(start, end))
        self._copy_point(CopyPoint.BEFORE_PIN)  # a store may have evicted one since the lookup
        for block in blocks:
            store.pin(block.key)
        self._planned_loads[request_id] = RequestLoad(
            request_id, start * mode.block_size, mode.block_size, blocks,
            tuple(block_ids[start:end]),
        )

    def build_connector_meta(self, scheduled: Sequence[RequestBlocks]) -> ConnectorMetadata:
        self._ready()
        if self._unstarted_step is not None:
            # its saves would never be snapshotted and its loads never run (pins leak)
            raise RuntimeError(
                f"connector {self.name!r}: the metadata of step {self._unstarted_step} was "
                "never passed to start_load_kv"
            )
        self._copy_point(CopyPoint.BUILD_META)
        self._step += 1
        self._unstarted_step = self._step
        saves = self._exit_saves
        self._exit_saves = []
        for blocks in scheduled:
            save = self._collect_saves(blocks)
            tracked = self._tracked.get(blocks.request.request_id)
            if tracked is not None:
                tracked.written_cap = None  # its loads happen in this step's worker phase
            if save is not None:
                saves.append(save)
        loads = tuple(self._planned_loads.values())
        self._planned_loads = {}
        return ConnectorMetadata(self._step, loads, tuple(saves))

    def request_finished(self, blocks: RequestBlocks) -> FinishDecision:
        self._release(blocks)
        self._exited.add(blocks.request.request_id)
        return FinishDecision(delay_free=False)

    def request_preempted(self, blocks: RequestBlocks) -> None:
        self._release(blocks)

    def _release(self, blocks: RequestBlocks) -> None:
        """The request's blocks are about to be freed: list its last complete blocks for the
        next step's snapshot (their bytes stay intact until then) and forget the request."""
        self._ready()
        request_id = blocks.request.request_id
        self._drop_planned_load(request_id)
        save = self._collect_saves(blocks)
        if save is not None:
            self._exit_saves.append(save)
        self._tracked.pop(request_id, None)

    def _drop_planned_load(self, request_id: str) -> None:
        load = self._planned_loads.pop(request_id, None)
        if load is not None:
            store = self._ready()[2]
            for block in load.blocks:
                store.unpin(block.key)

    def _collect_saves(self, blocks: RequestBlocks) -> RequestSave | None:
        _, mode, _ = self._ready()
        request = blocks.request
        tracked = self._tracked.setdefault(request.request_id, _Tracked())
        hashes = request.get_block_hashes(mode.lookahead_tokens)
        num_written = blocks.num_written_tokens
        if tracked.written_cap is not None:
            num_written = min(num_written, tracked.written_cap)
        end = min(num_storable_blocks(len(hashes), num_written, request.num_tokens, mode),
                  len(blocks.block_ids))
        chosen: list[BlockDescriptor] = []
        device_ids: list[int] = []
        skipped = 0
        for index in range(tracked.num_considered_blocks, end):
            block_id = blocks.block_ids[index]
            if block_id == NULL_BLOCK_ID:
                continue
            block = describe_block(request, hashes, index, mode)
            if self._contains(block.key):
                skipped += 1
                continue
            self._pending.add(block.key)
            chosen.append(block)
            device_ids.append(block_id)
        tracked.num_considered_blocks = max(tracked.num_considered_blocks, end)
        with self._cond:
            self._counts["save_skipped_blocks"] += skipped
            self._outstanding[request.request_id] += len(chosen)
        if not chosen:
            return None
        return RequestSave(request.request_id, tuple(chosen), tuple(device_ids),
                           request.lora_name)

    @staticmethod
    def _first_block(num_local_hit_tokens: int, mode: ConnectorMode) -> int:
        if num_local_hit_tokens < 0 or num_local_hit_tokens % mode.block_size:
            raise ValueError(
                f"the local hit must be a whole number of {mode.block_size}-token blocks, "
                f"got {num_local_hit_tokens}"
            )
        return num_local_hit_tokens // mode.block_size

    # ---- worker side -------------------------------------------------------------------------
    def _own(self, meta: StepMetadata) -> ConnectorMetadata:
        if not isinstance(meta, ConnectorMetadata):
            raise TypeError(f"connector {self.name!r} got {type(meta).__name__}")
        return meta

    def snapshot_saves(self, meta: StepMetadata) -> None:
        meta = self._own(meta)
        self._failed_block_ids = frozenset()
        needed = {block.key for load in meta.loads for block in load.blocks}
        self._step_snapshots = {}
        self._snapshot(meta.saves, needed)

    def _snapshot(self, saves: Sequence[RequestSave], needed: set[CacheKey]) -> None:
        """Copy the saved blocks out of device memory into staging slots and queue them. With
        no free slot the store is dropped (counted); a block this step also loads is copied
        anyway, privately, so the load can read it."""
        kv, _, _ = self._ready()
        assert self._staging is not None
        for save in saves:
            picked: list[tuple[BlockDescriptor, int, int | None]] = []  # block, device id, slot
            dropped = 0
            with self._cond:
                for block, block_id in zip(save.blocks, save.device_block_ids):
                    self._pending.discard(block.key)
                    slot = self._staging.take()
                    if slot is None:
                        dropped += 1
                        if block.key not in needed:
                            continue
                    picked.append((block, block_id, slot))
                self._counts["save_dropped_queue_full"] += dropped
                self._outstanding[save.request_id] -= dropped
            if not picked:
                continue
            destinations = [
                self._staging.block(slot) if slot is not None else kv.new_host_block()
                for _, _, slot in picked
            ]
            ready = kv.read_blocks_into([block_id for _, block_id, _ in picked], destinations)
            with self._cond:
                for (block, _, slot), tensors in zip(picked, destinations):
                    snapshot = _Snapshot(block, tensors, save.request_id, save.lora_name,
                                         slot, ready)
                    if block.key in needed:
                        self._step_snapshots[block.key] = snapshot
                        if slot is not None:
                            self._hold(slot)  # this step's load reads it after the copy
                    if slot is not None:
                        self._in_flight[block.key] = snapshot
                        self._queue.append(snapshot)
                self._cond.notify_all()
            self._copy_point(CopyPoint.AFTER_QUEUE)

    def load_blocks(self, meta: StepMetadata) -> None:
        meta = self._own(meta)
        kv, _, store = self._ready()
        failed: set[int] = set()
        for load in meta.loads:
            num_ok = 0
            miss: CodecMiss | None = None
            writer = kv.begin_write(len(load.blocks))
            for block, block_id in zip(load.blocks, load.device_block_ids):
                self._copy_point(CopyPoint.BEFORE_FETCH)
                found = self._fetch(block, store)
                if isinstance(found, CodecMiss):
                    miss = found
                    break
                writer.add(block_id, found)  # at once: a store's tensors live until its next get
                num_ok += 1
            writer.finish()  # the blocks before a failure are valid: keep them
            for block in load.blocks:
                store.unpin(block.key)
            self._finished_loads.add(load.request_id)
            with self._cond:
                self._counts["loaded_blocks"] += num_ok
                self._counts["loaded_bytes"] += num_ok * kv.layout.nbytes
            if miss is not None:
                bad_ids = load.device_block_ids[num_ok:]
                failed.update(bad_ids)
                tracked = self._tracked.get(load.request_id)
                if tracked is not None:
                    # the engine recomputes the failed blocks: consider them for saving again
                    first_failed_block = load.first_token // load.block_size + num_ok
                    tracked.num_considered_blocks = min(tracked.num_considered_blocks,
                                                        first_failed_block)
                self._load_failures.append(LoadFailure(
                    load.request_id, load.first_token + num_ok * load.block_size, bad_ids,
                    f"{miss.reason.value}: {miss.detail}" if miss.detail else miss.reason.value,
                ))
                with self._cond:
                    self._counts["load_failed_blocks"] += len(bad_ids)
                    if miss.reason.is_corruption:
                        self._counts["corrupt_blocks"] += 1
        self._failed_block_ids = frozenset(failed)
        self._step_snapshots = {}
        with self._cond:
            for slot in self._held_slots:
                self._release_slot(slot)
        self._held_slots = []
        self._unstarted_step = None
        self._copy_point(CopyPoint.AFTER_LOADS)

    def _fetch(self, block: BlockDescriptor, store: BlockStore) -> BlockTensors | CodecMiss:
        """The block from this step's snapshots, the copy queue, or the tier, in that order
        (the copy thread puts a block in the tier before it leaves the queue)."""
        snapshot = self._step_snapshots.get(block.key)
        if snapshot is None:
            with self._cond:
                snapshot = self._in_flight.get(block.key)
                if snapshot is not None and snapshot.slot is not None:
                    self._hold(snapshot.slot)  # the copy thread may settle it meanwhile
        if snapshot is not None:
            if snapshot.block != block:
                return CodecMiss(MissReason.BLOCK_MISMATCH, "a different block under this key")
            return snapshot.wait()
        return store.get(block)

    def get_finished(self) -> ConnectorOutput:
        self._copy_point(CopyPoint.FINISHED)
        loads, self._finished_loads = frozenset(self._finished_loads), set()
        failures, self._load_failures = tuple(self._load_failures), []
        waiting = {save.request_id for save in self._exit_saves}
        done: set[str] = set()
        with self._cond:
            for request_id in self._exited:
                if request_id not in waiting and self._outstanding[request_id] <= 0:
                    done.add(request_id)
                    del self._outstanding[request_id]
        self._exited -= done
        return ConnectorOutput(loads, frozenset(done), failures)

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        return self._failed_block_ids

    # ---- copy thread -------------------------------------------------------------------------
    def _hold(self, slot: int) -> None:
        """One more reader of `slot`: this step's loads (under _cond)."""
        assert self._staging is not None
        self._staging.hold(slot)
        self._held_slots.append(slot)

    def _release_slot(self, slot: int) -> None:
        assert self._staging is not None
        self._staging.release(slot)

    def _copy_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if self._stopping:
                    return
            self._copy_one()

    def _copy_one(self) -> bool:
        """Store the oldest queued snapshot (on the copy thread, or where a schedule runs it).
        False if nothing was queued."""
        store = self._ready()[2]
        with self._cond:
            if not self._queue:
                return False
            snapshot = self._queue.popleft()
        try:
            result: PutResult | None = store.put(snapshot.block, snapshot.wait())
            error = ""
        except Exception as exc:  # a store that breaks must not stop the thread
            result, error = None, f"{type(exc).__name__}: {exc}"
        with self._cond:
            # only now: a load that misses the queue must find the block in the tier
            self._in_flight.pop(snapshot.block.key, None)
            if snapshot.slot is not None and self._staging is not None:
                self._release_slot(snapshot.slot)
            self._outstanding[snapshot.request_id] -= 1
            if result is None:
                self._counts["save_errors"] += 1
                self._last_save_error = error
            else:
                self._settle(snapshot, result)
            self._cond.notify_all()
        return True

    def _copy_point(self, point: CopyPoint) -> None:
        """A place where the copy thread could have run: under a schedule, run what it says."""
        if self._schedule is None or self._store is None:
            return
        with self._cond:
            queued = len(self._queue)
        for _ in range(self._schedule.copies_at(point, queued)):
            if not self._copy_one():
                break

    def _drain(self) -> None:
        """Under a schedule, nobody else runs the queue: a wait for it runs it to the end."""
        if self._schedule is not None:
            while self._copy_one():
                pass

    def _settle(self, snapshot: _Snapshot, result: PutResult) -> None:
        """Count and record events for one store (under _cond)."""
        mode = self.mode
        if result.outcome is PutOutcome.STORED:
            self._counts["saved_blocks"] += 1
            self._counts["saved_bytes"] += result.nbytes
            block = snapshot.block
            self._events.append(BlockStored(
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
            self._counts["save_skipped_blocks"] += 1
        else:
            self._counts["save_dropped_no_room"] += 1
        self._record_removed(result.evicted)

    def _record_removed(self, keys: Sequence[CacheKey]) -> None:
        if not keys:
            return
        self._counts["evicted_blocks"] += len(keys)
        by_group: dict[int, list[bytes]] = {}
        for key in keys:
            block_hash, group_id = split_cache_key(key)
            by_group.setdefault(group_id, []).append(block_hash)
        for group_id, hashes in by_group.items():
            self._events.append(BlockRemoved(hashes, group_id, medium=self.medium))

    # ---- both --------------------------------------------------------------------------------
    def take_events(self) -> list[KVCacheEvent]:
        with self._cond:
            events, self._events = self._events, []
        return events

    def flush(self, timeout_s: float | None = None) -> bool:
        """Between steps: snapshot the saves of requests that exited since the last step (no
        device write can happen now), then wait until the copy thread settled everything."""
        self._ready()
        saves, self._exit_saves = self._exit_saves, []
        self._snapshot(saves, set())
        self._drain()
        with self._cond:
            return self._cond.wait_for(lambda: not self._in_flight, timeout_s)

    def reset_cache(self) -> bool:
        """Drop pending saves and everything stored. False (nothing dropped) while a load is
        planned, since its blocks are pinned."""
        _, _, store = self._ready()
        if self._planned_loads:
            return False
        for save in self._exit_saves:
            with self._cond:
                self._outstanding[save.request_id] -= len(save.blocks)
        self._exit_saves = []
        self._pending.clear()
        self._drain()
        with self._cond:
            self._cond.wait_for(lambda: not self._in_flight)
        resident = store.usage().resident_blocks
        deleted = store.clear()
        with self._cond:
            self._record_removed(deleted)
        return len(deleted) == resident

    def stats(self) -> dict[str, ConnectorStats]:
        usage = self._store.usage() if self._store is not None else StoreUsage(0, 0, 0)
        with self._cond:
            counts = dict(self._counts)
            extra = {"last_save_error": self._last_save_error} if self._last_save_error else {}
        base = ConnectorStats(self.name, self.medium)
        return {self.name: replace(
            base, **counts, resident_blocks=usage.resident_blocks,
            resident_bytes=usage.resident_bytes, capacity_bytes=usage.capacity_bytes,
            extra=extra,
        )}

    def shutdown(self) -> None:
        """Stop the copy thread; stores still queued are dropped (counted)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._cond:
            for snapshot in self._queue:
                self._in_flight.pop(snapshot.block.key, None)
                self._outstanding[snapshot.request_id] -= 1
            self._counts["save_dropped_queue_full"] += len(self._queue)
            self._queue.clear()
