"""ToyRunner: a model-free runner for the real scheduler, with a symbolic KV store.

Owns a toy "target model" (`next_token`: a fixed function of the last tokens, so drafts can be
accepted or rejected on purpose), the `SymbolicKV` stand-in for the paged KV tensors, and a
runner that speaks the engine's typed messages exactly like `ModelRunner`: it keeps its own
per-request token ids and block tables from the scheduler's deltas, writes KV for the
scheduled positions, verifies drafts, cuts at the first stop and proposes the next drafts.

Every prefix-cache hit it is handed is checked: each hit slot must hold the target KV and draft
KV that a cold run of the hitting request would write (`HitMismatch` otherwise). The check runs
after this step's writes by other requests (a hit may take blocks another request computes in
the same step, as on the real engine, where every layer writes its KV before it attends) and
before the hitting request rewrites anything itself.

With a KV connector (`toy_core(..., connector=...)` over a `PagedSymbolicKV`, whose facts live
in real paged tensors), the runner does what `ModelRunner` does: it starts the step's connector
metadata before writing any KV (saves snapshotted, tier blocks loaded into the tensors), cuts
the requests whose load failed, and returns the connector's report. The hit check then covers
the external tokens too: a tier hit must read back exactly what a cold run writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from speckv.cache.kv_cache_manager import KVCacheManager
from speckv.cache.specs import FullAttentionSpec, MambaSpec
from speckv.connectors import ConnectorMode, KVConnector
from speckv.engine.core import EngineCore
from speckv.engine.kv_connector import (
    RunnerConnector,
    SchedulerConnector,
    group_modes,
    initialize_connector,
)
from speckv.engine.messages import (
    EMPTY_RUNNER_OUTPUT,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from speckv.engine.request import Request
from speckv.engine.scheduler import Scheduler
from speckv.engine.stopping import first_stop
from speckv.simulation.paged_kv import PagedSymbolicKV
from speckv.simulation.symbolic_groups import SymbolicGroups, SymbolicState
from speckv.simulation.symbolic_kv import HitMismatch, SymbolicKV
from speckv.simulation.tier_groups import tensor_groups


def next_token(context: Sequence[int], vocab_size: int) -> int:
    """The toy target model: a fixed function of the last three tokens and the length."""
    a, b, c = (list(context[-3:]) + [0, 0, 0])[:3]
    return (a * 1_000_003 + b * 10_007 + c * 101 + len(context) * 7) % vocab_size


@dataclass
class _ToyRequest:
    data: NewRequestData
    token_ids: list[int]  # real tokens: prompt + sampled
    tables: list[list[int]]  # one block table per KV cache group

    @property
    def block_ids(self) -> list[int]:
        """Group 0's block table."""
        return self.tables[0]


class ToyRunner:
    def __init__(self, num_spec_tokens: int, vocab_size: int = 32000,
                 kv: SymbolicKV | None = None, check_draft_kv: bool = True,
                 connector: RunnerConnector | None = None,
                 check_computed_kv: bool = False,
                 groups: SymbolicGroups | None = None) -> None:
        """`groups`: every KV cache group's symbolic state (hybrid layouts); without it a
        `kv` alone stands for one full-attention group."""
        self.num_spec_tokens = num_spec_tokens
        if groups is None and kv is not None:
            groups = SymbolicGroups([FullAttentionSpec(kv.block_size)], [kv], kv.draft_depth)
        self.groups = groups
        self.num_groups = len(groups.specs) if groups is not None else 1
        self.connector = connector
        # every step, every scheduled request's positions before its start must hold what a
        # cold run writes (needs a PagedSymbolicKV): catches a rolled-back load, a resumed
        # request or a tier block that is wrong even where no hit check looks
        self.check_computed_kv = check_computed_kv
        self.num_positions_checked = 0
        self.num_cut = 0  # requests cut from a step because their load failed
        self.vocab_size = vocab_size
        self.kv = kv
        # Legacy hashes + drop promise only the target KV (a chain stitched from two requests'
        # blocks keeps the first copy's draft KV): such tests turn the draft check off.
        self.check_draft_kv = check_draft_kv
        self.num_accept = num_spec_tokens  # drafts accepted per request per step, at most
        self.num_hits_checked = 0  # hit slots checked against a cold run
        self.num_block_copies = 0  # divergent block reuse carried out
        self.requests: dict[str, _ToyRequest] = {}

    def block_table(self, request_id: str, group: int = 0) -> list[int]:
        return self.requests[request_id].tables[group]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        for request_id in scheduler_output.finished_request_ids:
            self.requests.pop(request_id, None)
        for data in scheduler_output.new_requests:
            self.requests[data.request_id] = _ToyRequest(
                data, list(data.prompt_token_ids), [[] for _ in range(self.num_groups)])
        for item in scheduler_output.scheduled:
            state = self.requests[item.request_id]
            for table, new_ids in zip(state.tables, item.new_block_ids):
                if item.replaces_block_table:
                    table[:] = new_ids
                else:
                    table.extend(new_ids)
        if scheduler_output.block_copies:
            self.num_block_copies += len(scheduler_output.block_copies)
            if self.groups is not None:
                self.groups.copy_blocks([(copy.group_id, copy.src_block_id, copy.dst_block_id)
                                         for copy in scheduler_output.block_copies])
        scheduled = scheduler_output.scheduled
        if self.connector is not None:
            cut = self.connector.start_step(
                scheduler_output.kv_connector_metadata, scheduled,
                {item.request_id: self.requests[item.request_id].block_ids for item in scheduled})
            scheduled = [item for item in scheduled if item.request_id not in cut]
            self.num_cut += len(cut)
        elif scheduler_output.is_empty:
            return EMPTY_RUNNER_OUTPUT
        items = [(item, self.requests[item.request_id]) for item in scheduled]
        groups = self.groups
        if groups is not None:
            # target pass over real tokens + drafts; the drafter's pass writes draft KV from
            # whatever follows (drafts included: garbage where they get rejected)
            for item, state in items:
                sequence = [*state.token_ids, *item.draft_token_ids]
                groups.forward(state.tables, sequence, item.start, item.end, item.num_drafts > 0)
            for item, state in items:
                if item.replaces_block_table and item.start:
                    # the local hit and what the connector loaded after it
                    self._check_hit(state, item.start)
            if self.check_computed_kv:
                for item, state in items:
                    self._check_computed(state, item.start)
        sampled_by_id: dict[str, list[int]] = {}
        drafts_by_id: dict[str, list[int]] = {}
        reasons: dict[str, FinishReason] = {}
        accepted: dict[str, int] = {}
        for item, state in items:
            if not item.samples:
                continue
            sampled = self._verify(state.token_ids, item.draft_token_ids)
            if item.draft_token_ids:
                accepted[item.request_id] = len(sampled) - 1
            limits = state.data.stop_limits
            num_kept, reason = first_stop(sampled, len(state.token_ids),
                                          len(state.data.prompt_token_ids), limits)
            sampled = sampled[:num_kept]
            if reason is not None:
                reasons[item.request_id] = reason
            state.token_ids.extend(sampled)
            sampled_by_id[item.request_id] = sampled
            num_computed = item.end - (item.num_drafts - (len(sampled) - 1))
            if groups is not None:
                groups.commit(state.tables, state.token_ids, item.start, num_computed,
                              item.num_drafts > 0)
            if reason is None:
                num_output = len(state.token_ids) - len(state.data.prompt_token_ids)
                room = min(self.num_spec_tokens, limits.max_tokens - num_output - 1,
                           limits.max_model_len - len(state.token_ids) - 1)
                drafts_by_id[item.request_id] = self._propose(state.token_ids)[: max(0, room)]
        connector_output = self.connector.finish_step() if self.connector is not None else None
        return ModelRunnerOutput(sampled_by_id, drafts_by_id, connector_output, reasons,
                                 accepted)

    def _verify(self, tokens: list[int], drafts: Sequence[int]) -> list[int]:
        """Drafts matching the toy model, up to `num_accept`, then one bonus token."""
        context = list(tokens)
        sampled: list[int] = []
        for draft in drafts:
            if len(sampled) >= self.num_accept or draft != next_token(context, self.vocab_size):
                break
            sampled.append(draft)
            context.append(draft)
        sampled.append(next_token(context, self.vocab_size))
        return sampled

    def _propose(self, tokens: list[int]) -> list[int]:
        """Drafts: the toy model's true continuation, with the last one wrong, so that tests
        see both accepted and rejected drafts."""
        context = list(tokens)
        drafts = []
        for index in range(self.num_spec_tokens):
            token = next_token(context, self.vocab_size)
            if index == self.num_spec_tokens - 1 and index > 0:
                token = (token + 1) % self.vocab_size
            drafts.append(token)
            context.append(token)
        return drafts

    def _check_computed(self, state: _ToyRequest, num_computed: int) -> None:
        assert self.groups is not None
        depth = self.groups.draft_depth
        num_draft = max(0, num_computed - depth) if self.check_draft_kv else 0
        # (after the forward, which may have moved a Mamba group's running state past
        # `num_computed`: its state is checked at the latest checkpoint instead)
        problem = self.groups.mismatch(state.tables, state.token_ids, num_computed, num_draft,
                                       state_at_checkpoint=True)
        if problem is not None:
            raise HitMismatch(f"request {state.data.request_id}, computed KV: {problem}")
        self.num_positions_checked += num_computed

    def _check_hit(self, state: _ToyRequest, num_hit_tokens: int) -> None:
        assert self.groups is not None
        num_draft = num_hit_tokens if self.check_draft_kv else 0
        problem = self.groups.mismatch(state.tables, state.token_ids, num_hit_tokens,
                                       num_draft)
        if problem is not None:
            raise HitMismatch(f"request {state.data.request_id}: hit of {num_hit_tokens} "
                              f"tokens: {problem}")
        self.num_hits_checked += num_hit_tokens


def toy_core(
    manager: KVCacheManager,
    num_spec_tokens: int = 0,
    *,
    vocab_size: int = 32000,
    kv: SymbolicKV | None = None,
    check_draft_kv: bool = True,
    max_num_batched_tokens: int = 1 << 20,
    max_num_seqs: int = 256,
    connector: KVConnector | None = None,
    check_computed_kv: bool = False,
    load_failure_policy: str = "recompute",
) -> EngineCore:
    """The real scheduler over `manager`, run by a `ToyRunner` (`core.runner`).

    `kv` is group 0's store; on a hybrid layout every other group gets a store of its own
    (`SymbolicGroups`: sliding-window KV, Mamba / GDN states per block id), so every hit and
    every resumed request is checked in every group.

    `connector` (not yet initialized) needs `kv` to be a `PagedSymbolicKV` (its tensors are
    what the connector copies) and a single full-attention group; it is initialized here with
    the manager's hash mode."""
    groups = symbolic_groups(manager, kv) if kv is not None else None
    scheduler_connector = runner_connector = None
    if connector is not None:
        target_cache = getattr(kv, "target_cache", None)
        if target_cache is None:
            raise ValueError("a KV connector under the toy runner needs a PagedSymbolicKV")
        block_size = manager.managers[0].block_size
        if len(manager.managers) == 1:
            initialize_connector(connector, target_cache,
                                 kv.draft_cache,  # type: ignore[union-attr]
                                 manager.hash_mode, block_size)
        else:  # every group in tensors the connector's lanes copy
            groups = connect_groups(connector, manager, kv)
        scheduler_connector = SchedulerConnector(connector, manager, load_failure_policy)
        runner_connector = RunnerConnector(connector, block_size)
    scheduler = Scheduler(manager, max_num_batched_tokens, max_num_seqs, num_spec_tokens,
                          scheduler_connector)
    runner = ToyRunner(num_spec_tokens, vocab_size, kv, check_draft_kv, runner_connector,
                       check_computed_kv, groups)
    return EngineCore(scheduler, runner)


def connect_groups(connector: KVConnector, manager: KVCacheManager,
                   kv: SymbolicKV) -> SymbolicGroups:
    """Initialize `connector` over every group of a hybrid layout, each group's symbolic
    store in tensors (`tier_groups.tensor_groups`); returns those stores."""
    if not isinstance(kv, PagedSymbolicKV):
        raise ValueError("a KV connector under the toy runner needs a PagedSymbolicKV")
    groups, device = tensor_groups([m.spec for m in manager.managers],
                                   [pool.num_blocks for pool in manager.pools], kv)
    connector.initialize(device, ConnectorMode.from_hash_mode(
        manager.hash_mode, manager.hash_block_size, 0, group_modes(manager),
        manager.alignment_tokens))
    return groups


def symbolic_groups(manager: KVCacheManager, kv: SymbolicKV) -> SymbolicGroups:
    """Every group's symbolic store over `manager`'s layout: `kv` for group 0, a fresh one
    per block id of its pool for each other group (Mamba groups: `SymbolicState`)."""
    specs = [m.spec for m in manager.managers]
    if specs[0].block_size != kv.block_size or isinstance(specs[0], MambaSpec):
        raise ValueError(f"the symbolic KV has blocks of {kv.block_size} tokens; group 0 is "
                         f"{specs[0]}")
    draft_group = next((g for g, spec in enumerate(specs)
                        if isinstance(spec, FullAttentionSpec)), None)
    stores: list[object] = [kv]
    for g, spec in enumerate(specs[1:], 1):
        num_blocks = manager.pools[g].num_blocks  # a group's own pool, or the shared one
        if isinstance(spec, MambaSpec):
            stores.append(SymbolicState(num_blocks, spec.block_size))
        else:
            depth = kv.draft_depth if g == draft_group else 0
            stores.append(SymbolicKV(num_blocks, spec.block_size, depth))
    return SymbolicGroups(specs, stores, kv.draft_depth)


def run_to_completion(core: EngineCore, requests: Sequence[Request]) -> None:
    """Add the requests and step until they are all finished; RuntimeError if the KV cache
    cannot hold one of them."""
    for request in requests:
        core.scheduler.add_request(request)
    while core.scheduler.has_unfinished_requests():
        for output in core.step():
            if output.finish_reason is FinishReason.ERROR:
                raise RuntimeError(f"request {output.request_id}: {output.error}")
