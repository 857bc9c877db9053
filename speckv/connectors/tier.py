"""A content-addressed tier connector: the logic every storage tier shares.

Owns `TierConnector`, the connector of a tier (the CPU pool, the disk directory and the shared
store plug in as a `BlockStore`), composed of three parts with one job each:

    tier_scheduler.py  `TierSchedulerSide`: lookups, planned (pinned) loads, saves to list,
                       the step's `ConnectorMetadata`, per-request bookkeeping
    tier_worker.py     `TierWorkerSide`: the snapshot of the step's saves, then its loads into
                       device blocks, and the load failures
    tier_copier.py     `TierCopier`: the copy queue, its staging slots, the copy thread (or a
                       seeded `CopySchedule`), the tier's counters and KV events

The sides are built at `initialize` (they need the device caches, the mode and the store);
the copier exists from the start, so `stats()`, `run_copies_on` and `shutdown` work before.

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

The staging slots' readers and the seeded copy schedule: `tier_copier.py`.

Loads are pinned in the store from `update_state_after_alloc` until copied, so eviction never
takes a block that is being loaded. A load stops at the first block it cannot serve (evicted,
corrupt, or not what the request expects); that block and the rest of the load are reported
failed and the engine recomputes them.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import replace

from speckv.cache.events import KVCacheEvent
from speckv.connectors.base import (
    ExternalHit,
    FinishDecision,
    KVConnector,
    RequestBlocks,
)
from speckv.connectors.copy_schedule import CopyPoint, CopySchedule
from speckv.connectors.layout import DeviceKV
from speckv.connectors.metadata import (
    ConnectorMetadata,
    ConnectorOutput,
    ConnectorStats,
    StepMetadata,
)
from speckv.connectors.rules import ConnectorMode, ConnectorRequest
from speckv.connectors.store import BlockStore, StoreUsage
from speckv.connectors.tier_copier import Staging, TierCopier
from speckv.connectors.tier_scheduler import NULL_BLOCK_ID, TierSchedulerSide
from speckv.connectors.tier_worker import TierWorkerSide

DEFAULT_MAX_PENDING_BLOCKS = 256

__all__ = ("DEFAULT_MAX_PENDING_BLOCKS", "NULL_BLOCK_ID", "TierConnector")


class TierConnector(KVConnector):
    """The shared logic; subclasses say where blocks live (`_open_store`) and may swap in
    their own sides (`scheduler_side_type`, `worker_side_type`)."""

    medium: str = "CPU"
    scheduler_side_type: type[TierSchedulerSide] = TierSchedulerSide
    worker_side_type: type[TierWorkerSide] = TierWorkerSide

    def __init__(self, name: str, max_pending_blocks: int = DEFAULT_MAX_PENDING_BLOCKS) -> None:
        if max_pending_blocks < 1:
            raise ValueError(f"max_pending_blocks must be >= 1, got {max_pending_blocks}")
        self.name = name
        self.max_pending_blocks = max_pending_blocks
        self._kv: DeviceKV | None = None
        self._mode: ConnectorMode | None = None
        self._store: BlockStore | None = None
        self._store_wrapper: Callable[[BlockStore], BlockStore] | None = None
        self.copier = TierCopier(name, self.medium)
        self._scheduler: TierSchedulerSide | None = None
        self._worker: TierWorkerSide | None = None

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
        self.copier.schedule = schedule

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
        staging = Staging(kv.layout, self.max_pending_blocks, kv.device.type == "cuda")
        self._kv, self._mode = kv, mode
        self._scheduler = self.scheduler_side_type(self.name, self.medium, mode, self._store,
                                                   self.copier)
        self._worker = self.worker_side_type(self.name, kv, self._store, self.copier,
                                             self._scheduler.pending)
        self.copier.start(self._store, mode, staging)

    def _ready(self) -> tuple[DeviceKV, ConnectorMode, BlockStore]:
        if self._store is None or self._kv is None or self._mode is None:
            raise RuntimeError(f"connector {self.name!r} is used before initialize()")
        return self._kv, self._mode, self._store

    @property
    def scheduler(self) -> TierSchedulerSide:
        """The scheduler side (after `initialize`)."""
        self._ready()
        assert self._scheduler is not None
        return self._scheduler

    @property
    def worker(self) -> TierWorkerSide:
        """The worker side (after `initialize`)."""
        self._ready()
        assert self._worker is not None
        return self._worker

    @property
    def mode(self) -> ConnectorMode:
        return self._ready()[1]

    @property
    def store(self) -> BlockStore:
        """The tier's storage (for tools and tests; the connector is its only writer)."""
        return self._ready()[2]

    # ---- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_local_hit_tokens: int) -> ExternalHit:
        scheduler = self.scheduler
        hit = scheduler.peek_num_matched_tokens(request, num_local_hit_tokens)
        scheduler.count_lookup(hit)
        return hit

    def peek_num_matched_tokens(self, request: ConnectorRequest,
                                num_local_hit_tokens: int) -> ExternalHit:
        return self.scheduler.peek_num_matched_tokens(request, num_local_hit_tokens)

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[int],
                                 num_local_hit_tokens: int, num_external_tokens: int) -> None:
        self.scheduler.update_state_after_alloc(request, block_ids, num_local_hit_tokens,
                                                num_external_tokens)

    def build_connector_meta(self, scheduled: Sequence[RequestBlocks]) -> ConnectorMetadata:
        return self.scheduler.build_connector_meta(scheduled)

    def request_finished(self, blocks: RequestBlocks) -> FinishDecision:
        return self.scheduler.request_finished(blocks)

    def request_preempted(self, blocks: RequestBlocks) -> None:
        self.scheduler.request_preempted(blocks)

    # ---- worker side -------------------------------------------------------------------------
    def snapshot_saves(self, meta: StepMetadata) -> None:
        self.worker.snapshot_saves(meta)

    def load_blocks(self, meta: StepMetadata) -> None:
        failures = self.worker.load_blocks(meta)
        self.scheduler.loads_started(failures)
        self.copier.copy_point(CopyPoint.AFTER_LOADS)

    def get_finished(self) -> ConnectorOutput:
        self.copier.copy_point(CopyPoint.FINISHED)
        loads, failures = self.worker.take_finished_loads()
        return ConnectorOutput(loads, self.scheduler.finished_saves(), failures)

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        return self.worker.failed_block_ids

    # ---- both --------------------------------------------------------------------------------
    def take_events(self) -> list[KVCacheEvent]:
        return self.copier.take_events()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Between steps: snapshot the saves of requests that exited since the last step (no
        device write can happen now), then wait until the copy thread settled everything."""
        self.worker.snapshot(self.scheduler.take_exit_saves(), set())
        return self.copier.wait_settled(timeout_s)

    def reset_cache(self) -> bool:
        """Drop pending saves and everything stored. False (nothing dropped) while a load is
        planned, since its blocks are pinned."""
        scheduler, store = self.scheduler, self.store
        if scheduler.planned_loads:
            return False
        scheduler.drop_pending_saves()
        self.copier.wait_settled()
        resident = store.usage().resident_blocks
        deleted = store.clear()
        with self.copier.cond:
            self.copier.record_removed(deleted)
        return len(deleted) == resident

    def stats(self) -> dict[str, ConnectorStats]:
        usage = self._store.usage() if self._store is not None else StoreUsage(0, 0, 0)
        copier = self.copier
        with copier.cond:
            counts = dict(copier.counts)
            extra = {"last_save_error": copier.last_save_error} if copier.last_save_error else {}
        base = ConnectorStats(self.name, self.medium)
        return {self.name: replace(
            base, **counts, resident_blocks=usage.resident_blocks,
            resident_bytes=usage.resident_bytes, capacity_bytes=usage.capacity_bytes,
            extra=extra,
        )}

    def shutdown(self) -> None:
        """Stop the copy thread; stores still queued are dropped (counted)."""
        self.copier.stop()
