"""A tier connector on a hybrid model: one lane per KV cache group, one hit rule over them.

Owns `GroupedTiers`, what a `TierConnector` (CPU pool, disk, store) runs when the model has
several KV cache groups (full attention, sliding window, Gated DeltaNet / Mamba state). Each
group gets a lane: a single-group tier of the same kind (its own store, namespace, staging
and copy thread) over that group's device blocks (`GroupedDeviceKV.groups[g]`), keyed by the
same block hashes as the local cache keys that group (`GroupMode`):

    full attention   every block, target + draft KV, as a one-group model
    sliding window   the window's tail before each boundary a hit can end on (the local
                     cache's retention); a load copies the tail before the hit's end only
    Mamba / GDN      the conv + recurrent state at each unit boundary (the checkpoint
                     block); a load copies the state at the hit's end only

A tier hit is the longest prefix every group can serve (`hybrid_fixed_point`, the local
cache's rule, legacy drop included: one unit, once), from the local hit on. The saves follow
each lane's own rule, including blocks the cache manager released in this step's scheduling
(`RequestBlocks.released_block_ids`), which every lane snapshots in this step's
`start_load_kv`, before any write of the step; so the finish-time save of a request carries
the state at its last boundary too.

A load that fails in any lane fails the whole load (the sliding-window and Mamba lanes hold
state at the hit's end only, so nothing between the local hit and the end is valid): the
failure names the local hit as the first failed token and every group-0 block of the load,
and the engine recomputes from the local hit (whose window tail and state the manager keeps
until the load proved good).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields, replace
from typing import TYPE_CHECKING

from speckv.cache.block import make_cache_key
from speckv.cache.events import KVCacheEvent
from speckv.cache.group_rules import hybrid_fixed_point
from speckv.connectors.base import ExternalHit, FinishDecision, GroupBlockIds, RequestBlocks
from speckv.connectors.copy_schedule import CopyPoint
from speckv.connectors.metadata import (
    ConnectorOutput,
    ConnectorStats,
    LoadFailure,
    MultiConnectorMetadata,
    StepMetadata,
)
from speckv.connectors.parts import PendingParts
from speckv.connectors.rules import (
    ConnectorMode,
    ConnectorRequest,
    block_hashes,
    num_lookup_candidates,
)

if TYPE_CHECKING:
    from speckv.connectors.tier import TierConnector


class GroupedTiers:
    """The lanes of one tier connector (engine thread; each lane keeps its own locks)."""

    def __init__(self, name: str, medium: str, mode: ConnectorMode,
                 lanes: Sequence[TierConnector]) -> None:
        if len(lanes) != len(mode.groups):
            raise ValueError(f"{len(lanes)} lanes for {len(mode.groups)} KV cache groups")
        self.name = name
        self.medium = medium
        self.mode = mode
        self.lanes = tuple(lanes)
        self.unit = mode.alignment_tokens
        # full attention first: cheap, and usually what binds
        self.order = sorted(range(len(self.lanes)), key=lambda g: not mode.groups[g].is_full)
        self._step = 0
        # request id -> (local hit tokens, end of the load, group-0 device ids of the load)
        self._loads: dict[str, tuple[int, int, tuple[int, ...]]] = {}
        self._failures: list[LoadFailure] = []
        self._failed_ids: frozenset[int] = frozenset()
        self._saving = PendingParts()  # exited requests: lanes not yet settled

    # ---- lookups -----------------------------------------------------------------------------
    def peek(self, request: ConnectorRequest, num_local_hit_tokens: int) -> ExternalHit:
        local = num_local_hit_tokens
        known: dict[tuple[int, int], bool] = {}  # (group, block index) -> in the tier

        def present(group: int, index: int, hashes: Sequence[bytes]) -> bool:
            key = (group, index)
            if key not in known:
                lane = self.lanes[group]
                known[key] = lane.scheduler.contains(
                    make_cache_key(hashes[index], lane.mode.group_id))
            return known[key]

        chains = [block_hashes(request, lane.mode) for lane in self.lanes]

        def longest(group: int, candidate: int) -> int:
            if candidate <= local:
                return candidate
            spec = self.mode.groups[group]
            size, hashes = spec.block_size, chains[group]
            first = local // size
            last = min(candidate // size,
                       num_lookup_candidates(request.num_tokens, len(hashes), size))
            if spec.is_full:
                index = first
                while index < last and present(group, index, hashes):
                    index += 1
                return index * size
            step = max(1, self.unit // size)  # a hit ends on a unit boundary
            for end in range(last // step * step, first, -step):
                low = max(first, end - spec.num_needed_blocks)
                if all(present(group, index, hashes) for index in range(low, end)):
                    return end * size
            return local

        hit = hybrid_fixed_point(request.num_tokens - 1, self.unit, self.order, longest)
        if self.mode.drops_last_block and hit > local:
            # legacy hashes cannot prove the last unit's draft KV: drop it, once
            hit = hybrid_fixed_point(hit - self.unit, self.unit, self.order, longest)
        if hit <= local:
            return ExternalHit(0)
        return ExternalHit(hit - local, self.medium)

    def count_lookup(self, hit: ExternalHit) -> None:
        self.lanes[0].scheduler.count_lookup(hit)

    # ---- scheduler side ----------------------------------------------------------------------
    def update_state_after_alloc(self, request: ConnectorRequest, group_block_ids: GroupBlockIds,
                                 num_local_hit_tokens: int, num_external_tokens: int) -> None:
        if len(group_block_ids) != len(self.lanes):
            raise ValueError(f"connector {self.name!r}: {len(group_block_ids)} block tables "
                             f"for {len(self.lanes)} KV cache groups")
        for lane, ids in zip(self.lanes, group_block_ids):
            lane.update_state_after_alloc(request, ids, num_local_hit_tokens,
                                          num_external_tokens)
        self._loads.pop(request.request_id, None)
        if num_external_tokens:
            size = self.lanes[0].mode.block_size
            end = num_local_hit_tokens + num_external_tokens
            self._loads[request.request_id] = (
                num_local_hit_tokens, end,
                tuple(group_block_ids[0][num_local_hit_tokens // size:end // size]))

    def sibling_loads(self, request: ConnectorRequest, num_local_hit_tokens: int,
                      num_external_tokens: int) -> None:
        """A sibling tier loads the range: a sliding-window or state lane must not save the
        blocks of it that the load leaves empty, so it starts after the range (what it
        loads is in the sibling tier already)."""
        end = num_local_hit_tokens + num_external_tokens
        for lane in self.lanes:
            group = lane.mode.group
            tracked = lane.scheduler.tracked.get(request.request_id)
            if group is not None and not group.is_full and tracked is not None:
                tracked.num_considered_blocks = max(tracked.num_considered_blocks,
                                                    end // group.block_size)

    def _lane_blocks(self, blocks: RequestBlocks, group: int) -> RequestBlocks:
        ids = blocks.groups[group]
        released = blocks.released(group)
        return RequestBlocks(blocks.request, ids, blocks.num_written_tokens,
                             released_block_ids=(released,) if released else ())

    def build_connector_meta(self, scheduled: Sequence[RequestBlocks]) -> MultiConnectorMetadata:
        self._step += 1
        return MultiConnectorMetadata(self._step, tuple(
            lane.build_connector_meta([self._lane_blocks(blocks, g) for blocks in scheduled])
            for g, lane in enumerate(self.lanes)))

    def request_finished(self, blocks: RequestBlocks) -> FinishDecision:
        for g, lane in enumerate(self.lanes):
            lane.request_finished(self._lane_blocks(blocks, g))
        request_id = blocks.request.request_id
        self._loads.pop(request_id, None)
        self._saving.expect(request_id, range(len(self.lanes)))
        return FinishDecision(delay_free=False)

    def request_preempted(self, blocks: RequestBlocks) -> None:
        for g, lane in enumerate(self.lanes):
            lane.request_preempted(self._lane_blocks(blocks, g))
        self._loads.pop(blocks.request.request_id, None)

    # ---- worker side -------------------------------------------------------------------------
    def _children(self, meta: StepMetadata) -> tuple[StepMetadata, ...]:
        if not isinstance(meta, MultiConnectorMetadata) or len(meta.children) != len(
                self.lanes):
            raise TypeError(f"connector {self.name!r} got {type(meta).__name__}")
        return meta.children

    def snapshot_saves(self, meta: StepMetadata) -> None:
        for lane, child in zip(self.lanes, self._children(meta)):
            lane.worker.snapshot_saves(child)

    def load_blocks(self, meta: StepMetadata) -> None:
        failed: dict[str, list[str]] = {}
        for lane, child in zip(self.lanes, self._children(meta)):
            for failure in lane.worker.load_blocks(child):
                failed.setdefault(failure.request_id, []).append(
                    f"group {lane.mode.group_id}: {failure.reason}")
        failures = []
        for request_id, reasons in failed.items():
            local, _, ids = self._loads.get(request_id, (0, 0, ()))
            failures.append(LoadFailure(request_id, local, ids, "; ".join(reasons)))
        for lane in self.lanes:
            # every lane recomputes (and so saves again) from the local hit
            lane.scheduler.loads_started(failures)
            lane.copier.copy_point(CopyPoint.AFTER_LOADS)
        for lane in self.lanes:
            lane.worker.load_failures.clear()  # reported once, here, as the whole load's
        self._failures.extend(failures)
        self._failed_ids = frozenset(i for failure in failures for i in failure.block_ids)
        for request_id in {load.request_id for child in self._children(meta)
                           for load in getattr(child, "loads", ())}:
            self._loads.pop(request_id, None)

    def get_finished(self) -> ConnectorOutput:
        loads: set[str] = set()
        done: set[str] = set()
        for index, lane in enumerate(self.lanes):
            output = lane.get_finished()
            loads |= output.finished_loads
            done.update(self._saving.report(index, output.finished_saves))
        failures, self._failures = tuple(self._failures), []
        return ConnectorOutput(frozenset(loads), frozenset(done), failures)

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        return self._failed_ids

    # ---- both --------------------------------------------------------------------------------
    def take_events(self) -> list[KVCacheEvent]:
        return [event for lane in self.lanes for event in lane.take_events()]

    def flush(self, timeout_s: float | None) -> bool:
        return all([lane.flush(timeout_s) for lane in self.lanes])

    def reset_cache(self) -> bool:
        return all([lane.reset_cache() for lane in self.lanes])

    def stats(self) -> dict[str, ConnectorStats]:
        """One entry under the connector's name: the lanes' counters summed (blocks of every
        group count alike), and `extra["groups"]` per group."""
        per_lane = [next(iter(lane.stats().values())) for lane in self.lanes]
        summed = {f.name: sum(getattr(stats, f.name) for stats in per_lane)
                  for f in fields(ConnectorStats)
                  if f.name not in ("name", "medium", "extra")}
        groups = {str(lane.mode.group_id): {
            "kind": lane.mode.group.kind if lane.mode.group is not None else "",
            "saved_blocks": stats.saved_blocks, "loaded_blocks": stats.loaded_blocks,
            "resident_blocks": stats.resident_blocks, "resident_bytes": stats.resident_bytes,
        } for lane, stats in zip(self.lanes, per_lane)}
        extra: dict[str, object] = {"groups": groups}
        for stats in per_lane:
            for key, value in stats.extra.items():
                extra.setdefault(key, value)
        base = ConnectorStats(self.name, self.medium)
        return {self.name: replace(base, **summed, extra=extra)}

    def shutdown(self) -> None:
        for lane in self.lanes:
            lane.shutdown()
