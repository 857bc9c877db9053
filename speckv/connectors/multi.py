"""MultiConnector: several connectors as one (`--kv-connector offload,disk`).

Owns the composition rules:
- capability: lookahead hashes only if there is at least one child and every child supports
  them (one hash chain per request: a single child without the capability puts the whole
  engine on legacy hashes with the drop, and every child then follows the drop);
- lookup: every child is asked; the longest hit wins, ties go to the earlier (faster) child,
  and only that child loads; the others still see the request so they store its blocks;
- saves: every child stores every complete block (write-through), so the disk tier holds
  what the CPU tier evicted;
- worker phase: every child snapshots its saves before any child loads, so no load can
  overwrite a freed block another child is about to save.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from speckv.cache.events import KVCacheEvent
from speckv.connectors.base import (
    ExternalHit,
    FinishDecision,
    GroupBlockIds,
    KVConnector,
    RequestBlocks,
)
from speckv.connectors.capability import KVGroupSupport
from speckv.connectors.layout import DeviceKV
from speckv.connectors.metadata import (
    ConnectorOutput,
    ConnectorStats,
    MultiConnectorMetadata,
    StepMetadata,
)
from speckv.connectors.parts import PendingParts
from speckv.connectors.rules import ConnectorMode, ConnectorRequest


def combine(connectors: Sequence[KVConnector | None]) -> KVConnector | None:
    """One connector of several, in order (a MultiConnector's children flattened into the
    list; None entries skipped); None when there is none, the one when there is one."""
    children = [child for connector in connectors if connector is not None
                for child in (connector.children if isinstance(connector, MultiConnector)
                              else (connector,))]
    if len(children) <= 1:
        return children[0] if children else None
    return MultiConnector(children, name=",".join(child.name for child in children))


class MultiConnector(KVConnector):
    def __init__(self, children: Sequence[KVConnector], name: str = "multi") -> None:
        names = [child.name for child in children]
        if len(set(names)) != len(names):
            raise ValueError(f"connector names must be unique, got {names}")
        self.children = tuple(children)
        self.name = name
        self._step = 0
        self._sending = PendingParts()  # finished requests: children still sending
        self._saving = PendingParts()  # exited requests: children not yet settled

    @property
    def supports_lookahead_block_hashes(self) -> bool:
        return bool(self.children) and all(
            child.supports_lookahead_block_hashes for child in self.children
        )

    @property
    def kv_group_support(self) -> KVGroupSupport:
        """What every child carries (the engine checks each child and names the one at
        fault; this is the multi-connector's own answer)."""
        supports = [child.kv_group_support for child in self.children]
        if not supports:
            return KVGroupSupport(frozenset(), False)
        kinds = frozenset.intersection(*(support.kinds for support in supports))
        return KVGroupSupport(kinds, all(support.multiple_groups for support in supports))

    def initialize(self, kv: DeviceKV, mode: ConnectorMode) -> None:
        for child in self.children:
            child.initialize(kv, mode)

    # ---- scheduler side ----------------------------------------------------------------------
    def _best(self, request: ConnectorRequest, num_local_hit_tokens: int, count: bool = True
              ) -> tuple[int | None, ExternalHit]:
        best_index, best = None, ExternalHit(0)
        for index, child in enumerate(self.children):
            hit = (child.get_num_new_matched_tokens(request, num_local_hit_tokens) if count
                   else child.peek_num_matched_tokens(request, num_local_hit_tokens))
            if hit.num_tokens > best.num_tokens:
                best_index, best = index, hit
        return best_index, best

    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_local_hit_tokens: int) -> ExternalHit:
        return self._best(request, num_local_hit_tokens)[1]

    def peek_num_matched_tokens(self, request: ConnectorRequest,
                                num_local_hit_tokens: int) -> ExternalHit:
        return self._best(request, num_local_hit_tokens, count=False)[1]

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[int],
                                 num_local_hit_tokens: int, num_external_tokens: int) -> None:
        self.update_state_after_alloc_groups(request, (block_ids,), num_local_hit_tokens,
                                             num_external_tokens)

    def update_state_after_alloc_groups(self, request: ConnectorRequest,
                                        group_block_ids: GroupBlockIds,
                                        num_local_hit_tokens: int,
                                        num_external_tokens: int) -> None:
        chosen = None
        if num_external_tokens:
            # ask again rather than remember: lookups stay free of side effects; the first
            # child that still holds the whole range loads it
            for index, child in enumerate(self.children):
                hit = child.peek_num_matched_tokens(request, num_local_hit_tokens)
                if hit.num_tokens >= num_external_tokens:
                    chosen = index
                    break
            if chosen is None:
                # evicted since the lookup: the best child loads what it still has and
                # reports the rest failed (the engine recomputes it)
                best = self._best(request, num_local_hit_tokens, count=False)[0]
                chosen = 0 if best is None else best
        for index, child in enumerate(self.children):
            child.update_state_after_alloc_groups(
                request, group_block_ids, num_local_hit_tokens,
                num_external_tokens if index == chosen else 0,
            )
            if num_external_tokens and index != chosen:
                child.sibling_loads(request, num_local_hit_tokens, num_external_tokens)

    def build_connector_meta(self, scheduled: Sequence[RequestBlocks]) -> StepMetadata:
        self._step += 1
        return MultiConnectorMetadata(
            self._step, tuple(child.build_connector_meta(scheduled) for child in self.children)
        )

    def request_finished(self, blocks: RequestBlocks) -> FinishDecision:
        decisions = [child.request_finished(blocks) for child in self.children]
        request_id = blocks.request.request_id
        self._saving.expect(request_id, range(len(self.children)))
        delaying = [index for index, decision in enumerate(decisions) if decision.delay_free]
        self._sending.expect(request_id, delaying)
        params: dict[str, Any] = {}
        for decision in reversed(decisions):  # the first child's value wins a shared key
            params.update(decision.kv_transfer_params or {})
        return FinishDecision(delay_free=bool(delaying),
                              kv_transfer_params=params if params else None)

    def request_preempted(self, blocks: RequestBlocks) -> None:
        for child in self.children:
            child.request_preempted(blocks)

    def take_events(self) -> list[KVCacheEvent]:
        return [event for child in self.children for event in child.take_events()]

    def reset_cache(self) -> bool:
        results = [child.reset_cache() for child in self.children]
        return all(results)

    # ---- worker side -------------------------------------------------------------------------
    def check_transfer_params(self, params: Mapping[str, Any] | None) -> None:
        for child in self.children:
            child.check_transfer_params(params)

    def transfer_abandoned(self, params: Mapping[str, Any] | None) -> None:
        for child in self.children:
            child.transfer_abandoned(params)

    def startup_lines(self) -> tuple[str, ...]:
        return tuple(line for child in self.children for line in child.startup_lines())

    def _children_meta(self, meta: StepMetadata) -> tuple[StepMetadata, ...]:
        if not isinstance(meta, MultiConnectorMetadata) or len(meta.children) != len(
            self.children
        ):
            raise TypeError(f"multi-connector {self.name!r} got {type(meta).__name__}")
        return meta.children

    def start_load_kv(self, meta: StepMetadata) -> None:
        self.snapshot_saves(meta)
        self.load_blocks(meta)

    def snapshot_saves(self, meta: StepMetadata) -> None:
        for child, child_meta in zip(self.children, self._children_meta(meta)):
            child.snapshot_saves(child_meta)

    def load_blocks(self, meta: StepMetadata) -> None:
        for child, child_meta in zip(self.children, self._children_meta(meta)):
            child.load_blocks(child_meta)

    def wait_for_save(self) -> None:
        for child in self.children:
            child.wait_for_save()

    def get_finished(self) -> ConnectorOutput:
        loads: set[str] = set()
        failures = []
        done: set[str] = set()
        recving: set[str] = set()
        sent: set[str] = set()
        for index, child in enumerate(self.children):
            output = child.get_finished()
            loads |= output.finished_loads
            recving |= output.finished_recving
            failures.extend(output.load_failures)
            sent.update(self._sending.report(index, output.finished_sending))
            done.update(self._saving.report(index, output.finished_saves))
        return ConnectorOutput(frozenset(loads), frozenset(done), tuple(failures),
                               frozenset(recving), frozenset(sent))

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        failed: set[int] = set()
        for child in self.children:
            failed |= child.get_block_ids_with_load_errors()
        return frozenset(failed)

    # ---- both --------------------------------------------------------------------------------
    def stats(self) -> dict[str, ConnectorStats]:
        merged: dict[str, ConnectorStats] = {}
        for child in self.children:
            merged.update(child.stats())
        return merged

    def flush(self, timeout_s: float | None = None) -> bool:
        results = [child.flush(timeout_s) for child in self.children]
        return all(results)

    def shutdown(self) -> None:
        for child in self.children:
            child.shutdown()

