"""The worker side of a tier connector: the snapshot of a step's saves and its loads.

Owns the tier connector's device-memory work, in the order `start_load_kv` runs it: first the
step's saved blocks are copied out of device memory into staging slots and queued for the copy
thread (`tier_copier.py`), before any load or forward of the step can overwrite them; then the
step's loads copy tier blocks (or this step's snapshots, or blocks still in flight) into the
requests' device blocks. A load stops at the first block it cannot serve (evicted, corrupt, or
not what the request expects); that block and the rest of the load are reported failed, and
the engine recomputes them. It never decides what to load or save: the scheduler side
(`tier_scheduler.py`) did, in the step's `ConnectorMetadata`.
"""

from __future__ import annotations

from collections.abc import Sequence

from speckv.cache.block import CacheKey
from speckv.connectors.codec import CodecMiss, MissReason
from speckv.connectors.copy_schedule import CopyPoint
from speckv.connectors.layout import BlockTensors, DeviceKV
from speckv.connectors.metadata import (
    BlockDescriptor,
    ConnectorMetadata,
    LoadFailure,
    RequestSave,
    StepMetadata,
)
from speckv.connectors.store import BlockStore
from speckv.connectors.tier_copier import Snapshot, TierCopier


class TierWorkerSide:
    """The tier connector's worker calls (engine thread; the copier's state under its `cond`).
    Subclasses may batch the tier's round trips (`shared_store.py`)."""

    def __init__(self, name: str, kv: DeviceKV, store: BlockStore, copier: TierCopier,
                 pending: set[CacheKey]) -> None:
        self.name = name
        self.kv = kv
        self.store = store
        self.copier = copier
        # the scheduler side's saves listed in a built step: a snapshot takes them off
        self._pending = pending
        self.step_snapshots: dict[CacheKey, Snapshot] = {}
        self.failed_block_ids: frozenset[int] = frozenset()
        self.finished_loads: set[str] = set()
        self.load_failures: list[LoadFailure] = []
        self._held_slots: list[int] = []  # staging slots this step's loads read

    def own(self, meta: StepMetadata) -> ConnectorMetadata:
        if not isinstance(meta, ConnectorMetadata):
            raise TypeError(f"connector {self.name!r} got {type(meta).__name__}")
        return meta

    # ---- snapshot ----------------------------------------------------------------------------
    def snapshot_saves(self, meta: StepMetadata) -> None:
        meta = self.own(meta)
        self.failed_block_ids = frozenset()
        needed = {block.key for load in meta.loads for block in load.blocks}
        self.step_snapshots = {}
        self.snapshot(meta.saves, needed)

    def snapshot(self, saves: Sequence[RequestSave], needed: set[CacheKey]) -> None:
        """Copy the saved blocks out of device memory into staging slots and queue them. With
        no free slot the store is dropped (counted); a block this step also loads is copied
        anyway, privately, so the load can read it."""
        kv, copier = self.kv, self.copier
        staging = copier.staging
        assert staging is not None
        for save in saves:
            picked: list[tuple[BlockDescriptor, int, int | None]] = []  # block, device id, slot
            dropped = 0
            with copier.cond:
                for block, block_id in zip(save.blocks, save.device_block_ids):
                    self._pending.discard(block.key)
                    slot = staging.take()
                    if slot is None:
                        dropped += 1
                        if block.key not in needed:
                            continue
                    picked.append((block, block_id, slot))
                copier.counts["save_dropped_queue_full"] += dropped
                copier.outstanding[save.request_id] -= dropped
            if not picked:
                continue
            destinations = [
                staging.block(slot) if slot is not None else kv.new_host_block()
                for _, _, slot in picked
            ]
            ready = kv.read_blocks_into([block_id for _, block_id, _ in picked], destinations)
            with copier.cond:
                for (block, _, slot), tensors in zip(picked, destinations):
                    snapshot = Snapshot(block, tensors, save.request_id, save.lora_name,
                                        slot, ready)
                    if block.key in needed:
                        self.step_snapshots[block.key] = snapshot
                        if slot is not None:
                            self._hold(slot)  # this step's load reads it after the copy
                    if slot is not None:
                        copier.in_flight[block.key] = snapshot
                        copier.queue.append(snapshot)
                copier.cond.notify_all()
            copier.copy_point(CopyPoint.AFTER_QUEUE)

    # ---- loads -------------------------------------------------------------------------------
    def load_blocks(self, meta: StepMetadata) -> list[LoadFailure]:
        """Copy the step's loads into device blocks; returns this call's load failures."""
        meta = self.own(meta)
        kv, store, copier = self.kv, self.store, self.copier
        failed: set[int] = set()
        failures: list[LoadFailure] = []
        for load in meta.loads:
            num_ok = 0
            miss: CodecMiss | None = None
            writer = kv.begin_write(len(load.blocks))
            for block, block_id in zip(load.blocks, load.device_block_ids):
                copier.copy_point(CopyPoint.BEFORE_FETCH)
                found = self._fetch(block)
                if isinstance(found, CodecMiss):
                    miss = found
                    break
                writer.add(block_id, found)  # at once: a store's tensors live until its next get
                num_ok += 1
            writer.finish()  # the blocks before a failure are valid: keep them
            for block in load.blocks:
                store.unpin(block.key)
            self.finished_loads.add(load.request_id)
            with copier.cond:
                copier.counts["loaded_blocks"] += num_ok
                copier.counts["loaded_bytes"] += num_ok * kv.layout.nbytes
            if miss is not None:
                bad_ids = load.device_block_ids[num_ok:]
                failed.update(bad_ids)
                failures.append(LoadFailure(
                    load.request_id, load.first_token + num_ok * load.block_size, bad_ids,
                    f"{miss.reason.value}: {miss.detail}" if miss.detail else miss.reason.value,
                ))
                with copier.cond:
                    copier.counts["load_failed_blocks"] += len(bad_ids)
                    if miss.reason.is_corruption:
                        copier.counts["corrupt_blocks"] += 1
        self.load_failures.extend(failures)
        self.failed_block_ids = frozenset(failed)
        self.step_snapshots = {}
        with copier.cond:
            for slot in self._held_slots:
                copier.release_slot(slot)
        self._held_slots = []
        return failures

    def _fetch(self, block: BlockDescriptor) -> BlockTensors | CodecMiss:
        """The block from this step's snapshots, the copy queue, or the tier, in that order
        (the copy thread puts a block in the tier before it leaves the queue)."""
        snapshot = self.step_snapshots.get(block.key)
        if snapshot is None:
            with self.copier.cond:
                snapshot = self.copier.in_flight.get(block.key)
                if snapshot is not None and snapshot.slot is not None:
                    self._hold(snapshot.slot)  # the copy thread may settle it meanwhile
        if snapshot is not None:
            if snapshot.block != block:
                return CodecMiss(MissReason.BLOCK_MISMATCH, "a different block under this key")
            return snapshot.wait()
        return self.store.get(block)

    def _hold(self, slot: int) -> None:
        """One more reader of `slot`: this step's loads (under the copier's cond)."""
        self.copier.hold(slot)
        self._held_slots.append(slot)

    # ---- reports -----------------------------------------------------------------------------
    def take_finished_loads(self) -> tuple[frozenset[str], tuple[LoadFailure, ...]]:
        """Loads done since the last call (fully or up to a failure), and their failures."""
        loads, self.finished_loads = frozenset(self.finished_loads), set()
        failures, self.load_failures = tuple(self.load_failures), []
        return loads, failures
