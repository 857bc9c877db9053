"""The scheduler side of a tier connector: lookups, planned loads and saves, the step's metadata.

Owns what the tier connector decides on the engine's scheduler calls, never touching device
memory: which blocks a request may load (`rules.py`) and pinning them in the tier until the
worker side copies them, which complete blocks to save, the `ConnectorMetadata` of each step,
and the bookkeeping per request (how far its blocks were considered for saving, whether it
exited and its saves have all settled).

Lookups see blocks that are pending (listed in a built step's saves, not yet snapshotted) and
in flight (queued on the copy thread, `tier_copier.py`), so a request that finishes and comes
straight back hits everything it stored.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from speckv.cache.block import NULL_BLOCK_ID, CacheKey, make_cache_key
from speckv.cache.retention import runs_worth_keeping
from speckv.connectors.base import ExternalHit, FinishDecision, RequestBlocks
from speckv.connectors.copy_schedule import CopyPoint
from speckv.connectors.metadata import (
    BlockDescriptor,
    ConnectorMetadata,
    LoadFailure,
    RequestLoad,
    RequestSave,
)
from speckv.connectors.rules import (
    ConnectorMode,
    ConnectorRequest,
    GroupMode,
    block_hashes,
    describe_block,
    num_lookup_candidates,
    num_servable_blocks,
    num_storable_blocks,
)
from speckv.connectors.store import BlockStore
from speckv.connectors.tier_copier import TierCopier


@dataclass
class Tracked:
    """Scheduler-side state of one request: how far its blocks were considered for saving,
    and, until its first step's metadata is built, the tokens whose KV is surely written."""

    num_considered_blocks: int = 0
    # The step that admits a request loads its external range (from this tier or a sibling
    # tier of a multi-connector) *during* the worker phase, after saves are snapshotted: in
    # that step only the local hit may be saved, whatever the engine counts as computed.
    written_cap: int | None = None


class TierSchedulerSide:
    """The tier connector's scheduler calls (engine thread only; the copier's state under its
    `cond`). Subclasses may batch the tier's round trips (`shared_store.py`)."""

    def __init__(self, name: str, medium: str, mode: ConnectorMode, store: BlockStore,
                 copier: TierCopier) -> None:
        self.name = name
        self.medium = medium
        self.mode = mode
        self.store = store
        self.copier = copier
        self.step = 0
        self.unstarted_step: int | None = None  # built, not yet through the worker's loads
        self.tracked: dict[str, Tracked] = {}
        self.planned_loads: dict[str, RequestLoad] = {}
        self.exit_saves: list[RequestSave] = []
        self.pending: set[CacheKey] = set()
        self.exited: set[str] = set()

    # ---- lookups -----------------------------------------------------------------------------
    def contains(self, key: CacheKey) -> bool:
        self.copier.copy_point(CopyPoint.LOOKUP)
        if key in self.pending:
            return True
        with self.copier.cond:
            if key in self.copier.in_flight:
                return True
        return self.store.contains(key)

    def count_lookup(self, hit: ExternalHit) -> None:
        with self.copier.cond:
            self.copier.counts["lookups"] += 1
            self.copier.counts["hit_blocks"] += hit.num_tokens // self.mode.block_size

    def peek_num_matched_tokens(self, request: ConnectorRequest,
                                num_local_hit_tokens: int) -> ExternalHit:
        mode = self.mode
        start = first_block(num_local_hit_tokens, mode)
        hashes = block_hashes(request, mode)
        end = num_lookup_candidates(request.num_tokens, len(hashes), mode.block_size)
        run = 0
        for index in range(start, end):
            if not self.contains(make_cache_key(hashes[index], mode.group_id)):
                break
            run += 1
        servable = num_servable_blocks(run, mode)
        if servable == 0:
            return ExternalHit(0)
        return ExternalHit(servable * mode.block_size, self.medium)

    # ---- loads -------------------------------------------------------------------------------
    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[int],
                                 num_local_hit_tokens: int, num_external_tokens: int) -> None:
        mode, store = self.mode, self.store
        start = first_block(num_local_hit_tokens, mode)
        if num_external_tokens < 0 or num_external_tokens % mode.block_size:
            raise ValueError(
                f"num_external_tokens must be a whole number of {mode.block_size}-token blocks, "
                f"got {num_external_tokens}"
            )
        end = start + num_external_tokens // mode.block_size
        request_id = request.request_id
        self.drop_planned_load(request_id)
        # a request loading from the tier starts saving after what it loads
        self.tracked[request_id] = Tracked(num_considered_blocks=end if end > start else 0,
                                           written_cap=num_local_hit_tokens)
        if end == start:
            return
        if len(block_ids) < end:
            raise ValueError(
                f"request {request_id}: {len(block_ids)} device blocks cannot hold a load "
                f"up to block {end}"
            )
        start = first_block_to_load(start, end, mode)
        if start == end:
            return  # (a window of one token: a hit reads no earlier key)
        hashes = block_hashes(request, mode)
        blocks = tuple(describe_block(request, hashes, i, mode) for i in range(start, end))
        self.copier.copy_point(CopyPoint.BEFORE_PIN)  # a store may have evicted one since
        for block in blocks:
            store.pin(block.key)
        self.planned_loads[request_id] = RequestLoad(
            request_id, start * mode.block_size, mode.block_size, blocks,
            tuple(block_ids[start:end]),
        )

    def drop_planned_load(self, request_id: str) -> None:
        load = self.planned_loads.pop(request_id, None)
        if load is not None:
            for block in load.blocks:
                self.store.unpin(block.key)

    def loads_started(self, failures: Sequence[LoadFailure]) -> None:
        """The worker side ran the built step's loads; `failures` are the ones that stopped
        early. The engine recomputes their failed blocks: consider them for saving again."""
        for failure in failures:
            tracked = self.tracked.get(failure.request_id)
            if tracked is not None:
                first_failed_block = failure.first_failed_token // self.mode.block_size
                tracked.num_considered_blocks = min(tracked.num_considered_blocks,
                                                    first_failed_block)
        self.unstarted_step = None

    # ---- the step's metadata -----------------------------------------------------------------
    def build_connector_meta(self, scheduled: Sequence[RequestBlocks]) -> ConnectorMetadata:
        if self.unstarted_step is not None:
            # its saves would never be snapshotted and its loads never run (pins leak)
            raise RuntimeError(
                f"connector {self.name!r}: the metadata of step {self.unstarted_step} was "
                "never passed to start_load_kv"
            )
        self.copier.copy_point(CopyPoint.BUILD_META)
        self.step += 1
        self.unstarted_step = self.step
        saves = self.exit_saves
        self.exit_saves = []
        for blocks in scheduled:
            save = self.collect_saves(blocks)
            tracked = self.tracked.get(blocks.request.request_id)
            if tracked is not None:
                tracked.written_cap = None  # its loads happen in this step's worker phase
            if save is not None:
                saves.append(save)
        loads = tuple(self.planned_loads.values())
        self.planned_loads = {}
        return ConnectorMetadata(self.step, loads, tuple(saves))

    # ---- saves -------------------------------------------------------------------------------
    def request_finished(self, blocks: RequestBlocks) -> FinishDecision:
        self.release(blocks)
        self.exited.add(blocks.request.request_id)
        return FinishDecision(delay_free=False)

    def request_preempted(self, blocks: RequestBlocks) -> None:
        self.release(blocks)

    def release(self, blocks: RequestBlocks) -> None:
        """The request's blocks are about to be freed: list its last complete blocks for the
        next step's snapshot (their bytes stay intact until then) and forget the request."""
        request_id = blocks.request.request_id
        self.drop_planned_load(request_id)
        save = self.collect_saves(blocks)
        if save is not None:
            self.exit_saves.append(save)
        self.tracked.pop(request_id, None)

    def collect_saves(self, blocks: RequestBlocks) -> RequestSave | None:
        mode = self.mode
        request = blocks.request
        tracked = self.tracked.setdefault(request.request_id, Tracked())
        hashes = block_hashes(request, mode)
        num_written = blocks.num_written_tokens
        if tracked.written_cap is not None:
            num_written = min(num_written, tracked.written_cap)
        end = min(num_storable_blocks(len(hashes), num_written, request.num_tokens, mode),
                  len(blocks.block_ids))
        chosen: list[BlockDescriptor] = []
        device_ids: list[int] = []
        skipped = 0
        block_ids = blocks.block_ids
        indices: Iterable[int] = range(tracked.num_considered_blocks, end)
        group = mode.group
        if group is not None and not group.is_full:
            # a sliding-window or Mamba group of a hybrid model: only what a hit at a kept
            # boundary reads, and the blocks the manager released this step are still intact
            indices = kept_indices(group, request, tracked.num_considered_blocks, end)
            released = blocks.released(0)
            if released:
                block_ids = list(block_ids)
                for index, block_id in released:
                    if index < len(block_ids):
                        block_ids[index] = block_id
        for index in indices:
            block_id = block_ids[index]
            if block_id == NULL_BLOCK_ID:
                continue
            block = describe_block(request, hashes, index, mode)
            if self.contains(block.key):
                skipped += 1
                continue
            self.pending.add(block.key)
            chosen.append(block)
            device_ids.append(block_id)
        tracked.num_considered_blocks = max(tracked.num_considered_blocks, end)
        with self.copier.cond:
            self.copier.counts["save_skipped_blocks"] += skipped
            self.copier.outstanding[request.request_id] += len(chosen)
        if not chosen:
            return None
        return RequestSave(request.request_id, tuple(chosen), tuple(device_ids),
                           request.lora_name)

    def take_exit_saves(self) -> list[RequestSave]:
        """The saves of requests that exited since the last step (for a flush)."""
        saves, self.exit_saves = self.exit_saves, []
        return saves

    def drop_pending_saves(self) -> None:
        """Forget every listed save not yet snapshotted (a cache reset)."""
        for save in self.exit_saves:
            with self.copier.cond:
                self.copier.outstanding[save.request_id] -= len(save.blocks)
        self.exit_saves = []
        self.pending.clear()

    def finished_saves(self) -> frozenset[str]:
        """Exited requests whose saves have all settled since the last call (each once)."""
        waiting = {save.request_id for save in self.exit_saves}
        done: set[str] = set()
        with self.copier.cond:
            for request_id in self.exited:
                if request_id not in waiting and self.copier.outstanding[request_id] <= 0:
                    done.add(request_id)
                    del self.copier.outstanding[request_id]
        self.exited -= done
        return frozenset(done)


def first_block_to_load(start: int, end: int, mode: ConnectorMode) -> int:
    """Of blocks [start, end) after a local hit, the first a load copies: every one for full
    attention, the blocks a hit at the end reads for a sliding-window or Mamba group."""
    group = mode.group
    if group is None or group.is_full:
        return start
    return max(start, end - group.num_needed_blocks)


def kept_indices(group: GroupMode, request: ConnectorRequest, start: int, end: int
                 ) -> list[int]:
    """Blocks [start, end) of a sliding-window or Mamba group worth storing: the tails the
    local cache keeps before each reachable boundary (`runs_worth_keeping`)."""
    retention = group.retention
    if retention is None or retention.is_dense:
        return list(range(start, end))
    num_prompt_tokens = getattr(request, "num_prompt_tokens", request.num_tokens)
    return [index for low, high in runs_worth_keeping(retention, group.num_tail_blocks,
                                                     group.block_size, start, end,
                                                     num_prompt_tokens)
            for index in range(low, high)]


def first_block(num_local_hit_tokens: int, mode: ConnectorMode) -> int:
    """The first block after a local hit of `num_local_hit_tokens` (whole blocks)."""
    if num_local_hit_tokens < 0 or num_local_hit_tokens % mode.block_size:
        raise ValueError(
            f"the local hit must be a whole number of {mode.block_size}-token blocks, "
            f"got {num_local_hit_tokens}"
        )
    return num_local_hit_tokens // mode.block_size
