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
    GroupBlockIds,
    KVConnector,
    RequestBlocks,
)
from speckv.connectors.capability import EVERY_GROUP, SINGLE_FULL_ATTENTION, KVGroupSupport
from speckv.connectors.copy_schedule import CopyPoint, CopySchedule
from speckv.connectors.group_tiers import GroupedTiers
from speckv.connectors.layout import DeviceKV, GroupedDeviceKV
from speckv.connectors.metadata import (
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
        self._grouped: GroupedTiers | None = None  # a hybrid model: one lane per group

    @property
    def supports_lookahead_block_hashes(self) -> bool:
        # Stores and lookups cover only blocks named by the request's block hashes.
        return True

    @property
    def kv_group_support(self) -> KVGroupSupport:
        """A tier that can open one lane per KV cache group (`_make_lane`) carries every kind
        of group; one that cannot carries one full-attention group."""
        if type(self)._make_lane is TierConnector._make_lane:
            return SINGLE_FULL_ATTENTION
        return EVERY_GROUP

    def _make_lane(self, index: int, share: float) -> TierConnector:
        """A single-group tier of the same kind for group `index` of a hybrid model, with
        `share` of this tier's capacity (not initialized). Tiers that can carry several
        groups override this."""
        raise NotImplementedError(f"connector {self.name!r} carries one KV cache group")

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

    def initialize(self, kv: DeviceKV | GroupedDeviceKV, mode: ConnectorMode) -> None:
        if self._store is not None or self._grouped is not None:
            raise RuntimeError(f"connector {self.name!r} is already initialized")
        if mode.is_grouped:
            self._initialize_lanes(kv, mode)
            return
        if isinstance(kv, GroupedDeviceKV):
            kv = kv.groups[0]
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

    def _initialize_lanes(self, kv: DeviceKV | GroupedDeviceKV, mode: ConnectorMode) -> None:
        """One lane per KV cache group, each with its share of the capacity: the group's
        bytes per token over every group's (what the tier spends on a stored prefix)."""
        if len(kv.groups) != len(mode.groups):
            raise ValueError(f"connector {self.name!r}: {len(kv.groups)} device KV groups for "
                             f"{len(mode.groups)} KV cache groups")
        per_token = [group_kv.layout.nbytes / group.block_size
                     for group_kv, group in zip(kv.groups, mode.groups)]
        lanes: list[TierConnector] = []
        try:
            for index, group_kv in enumerate(kv.groups):
                lane = self._make_lane(index, per_token[index] / sum(per_token))
                if self._store_wrapper is not None:
                    lane.wrap_store(self._store_wrapper)
                if self.copier.schedule is not None:
                    lane.run_copies_on(self.copier.schedule)
                lanes.append(lane)
                lane.initialize(group_kv, mode.lane(index))
        except BaseException:
            for lane in lanes:
                lane.shutdown()
            raise
        self._kv, self._mode = kv.groups[0], mode
        self._grouped = GroupedTiers(self.name, self.medium, mode, lanes)

    @property
    def lanes(self) -> tuple[TierConnector, ...]:
        """The single-group tiers of a hybrid model, one per KV cache group (() otherwise)."""
        return self._grouped.lanes if self._grouped is not None else ()

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
        if self._grouped is not None:
            hit = self._grouped.peek(request, num_local_hit_tokens)
            self._grouped.count_lookup(hit)
            return hit
        scheduler = self.scheduler
        hit = scheduler.peek_num_matched_tokens(request, num_local_hit_tokens)
        scheduler.count_lookup(hit)
        return hit

    def peek_num_matched_tokens(self, request: ConnectorRequest,
                                num_local_hit_tokens: int) -> ExternalHit:
        if self._grouped is not None:
            return self._grouped.peek(request, num_local_hit_tokens)
        return self.scheduler.peek_num_matched_tokens(request, num_local_hit_tokens)

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[int],
                                 num_local_hit_tokens: int, num_external_tokens: int) -> None:
        if self._grouped is not None:
            raise RuntimeError(f"connector {self.name!r} carries several KV cache groups: "
                               "call update_state_after_alloc_groups")
        self.scheduler.update_state_after_alloc(request, block_ids, num_local_hit_tokens,
                                                num_external_tokens)

    def update_state_after_alloc_groups(self, request: ConnectorRequest,
                                        group_block_ids: GroupBlockIds,
                                        num_local_hit_tokens: int,
                                        num_external_tokens: int) -> None:
        if self._grouped is not None:
            self._grouped.update_state_after_alloc(request, group_block_ids,
                                                   num_local_hit_tokens, num_external_tokens)
            return
        self.scheduler.update_state_after_alloc(request, group_block_ids[0],
                                                num_local_hit_tokens, num_external_tokens)

    def sibling_loads(self, request: ConnectorRequest, num_local_hit_tokens: int,
                      num_external_tokens: int) -> None:
        if self._grouped is not None:
            self._grouped.sibling_loads(request, num_local_hit_tokens, num_external_tokens)

    def build_connector_meta(self, scheduled: Sequence[RequestBlocks]) -> StepMetadata:
        if self._grouped is not None:
            return self._grouped.build_connector_meta(scheduled)
        return self.scheduler.build_connector_meta(scheduled)

    def request_finished(self, blocks: RequestBlocks) -> FinishDecision:
        if self._grouped is not None:
            return self._grouped.request_finished(blocks)
        return self.scheduler.request_finished(blocks)

    def request_preempted(self, blocks: RequestBlocks) -> None:
        if self._grouped is not None:
            self._grouped.request_preempted(blocks)
            return
        self.scheduler.request_preempted(blocks)

    # ---- worker side -------------------------------------------------------------------------
    def snapshot_saves(self, meta: StepMetadata) -> None:
        if self._grouped is not None:
            self._grouped.snapshot_saves(meta)
            return
        self.worker.snapshot_saves(meta)

    def load_blocks(self, meta: StepMetadata) -> None:
        if self._grouped is not None:
            self._grouped.load_blocks(meta)
            return
        failures = self.worker.load_blocks(meta)
        self.scheduler.loads_started(failures)
        self.copier.copy_point(CopyPoint.AFTER_LOADS)

    def get_finished(self) -> ConnectorOutput:
        if self._grouped is not None:
            return self._grouped.get_finished()
        self.copier.copy_point(CopyPoint.FINISHED)
        loads, failures = self.worker.take_finished_loads()
        return ConnectorOutput(loads, self.scheduler.finished_saves(), failures)

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        if self._grouped is not None:
            return self._grouped.get_block_ids_with_load_errors()
        return self.worker.failed_block_ids

    # ---- both --------------------------------------------------------------------------------
    def take_events(self) -> list[KVCacheEvent]:
        if self._grouped is not None:
            return self._grouped.take_events()
        return self.copier.take_events()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Between steps: snapshot the saves of requests that exited since the last step (no
        device write can happen now), then wait until the copy thread settled everything."""
        if self._grouped is not None:
            return self._grouped.flush(timeout_s)
        self.worker.snapshot(self.scheduler.take_exit_saves(), set())
        return self.copier.wait_settled(timeout_s)

    def reset_cache(self) -> bool:
        """Drop pending saves and everything stored. False (nothing dropped) while a load is
        planned, since its blocks are pinned."""
        if self._grouped is not None:
            return self._grouped.reset_cache()
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
        if self._grouped is not None:
            return self._grouped.stats()
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
        if self._grouped is not None:
            self._grouped.shutdown()
        self.copier.stop()
