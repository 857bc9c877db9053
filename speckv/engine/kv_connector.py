"""The engine's side of a KV connector: building it, and the calls the scheduler and runner make.

Owns the glue between the engine's parts and `speckv.connectors` (the connector's own
docstring, `speckv/connectors/base.py`, lists the call sites in step order):

    start-up      `build_connector` (config → connector; the disk tier's identity from the
                  target's and drafter's weights), `initialize_connector` (the target's and
                  drafter's paged caches + the engine's hash mode)
    scheduler     `SchedulerConnector`: the external hit after the local one (`external_hit`:
                  tokens, and whether the load is asynchronous), the state after allocation,
                  the step's metadata (carried to the runner in SchedulerOutput), preemption
                  and exit before blocks are freed (`finished` returns the connector's
                  `FinishDecision`: `delay_free`, `kv_transfer_params`), the load failure
                  policy (`roll_back_load`, `load_failure_error`)
    runner        `RunnerConnector`: start the step's loads (and the snapshot of its saves)
                  before the forward, name the requests of the batch whose load failed (they
                  are cut from it), and report the connector's output after the forward
    states        `RemoteLoad` (a request in WAITING_FOR_REMOTE_KVS), `HeldBlocks` (a
                  finished request whose blocks a transfer still holds)

The life of a request with an asynchronous load (the scheduler's side):

    waiting ──ext.load_async──► WAITING_FOR_REMOTE_KVS (blocks allocated, not scheduled)
        ──finished_recving──► waiting, computed up to the loaded end (or the first failed
        token), those blocks cached now ──schedule──► running ...
    abort while loading ──► held until finished_recving, then freed
    finish with delay_free ──► held until finished_sending, then freed

A load that fails leaves its device blocks allocated but holding garbage. Those blocks were
never cached (`KVCacheManager.allocate_slots` caches nothing past the local hit in the step
that loads, and an asynchronous load's blocks are cached only when it is reported done), the
runner computes nothing for the request in that step, and the scheduler sets its
`num_computed_tokens` back to the failure's first failed token, so the request recomputes
from there and no hash ever names the garbage (`--kv-load-failure-policy fail`: the request
ends with an error instead).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from speckv.attention.grouped import GroupedKVCache
from speckv.cache.specs import MambaSpec, SlidingWindowSpec
from speckv.connectors import (
    ConnectorMode,
    ConnectorOutput,
    DeviceKV,
    ExternalHit,
    FinishDecision,
    GroupBlockIds,
    KVConnector,
    LoadFailure,
    RequestBlocks,
    StepMetadata,
    TierIdentity,
    fingerprint_tensors,
    make_connector,
    persistent_hash_seed,
)
from speckv.connectors.config import (
    DEFAULT_LOAD_FAILURE_POLICY,
    check_load_failure_policy,
    needs_identity,
)
from speckv.connectors.layout import (
    DRAFT,
    TARGET,
    DeviceSegment,
    GroupedDeviceKV,
    KVSegment,
)
from speckv.connectors.multi import combine
from speckv.connectors.rules import GroupMode

if TYPE_CHECKING:
    from speckv.attention import PagedKVCache
    from speckv.cache.hash_mode import HashMode
    from speckv.cache.kv_cache_manager import KVCacheManager
    from speckv.engine.config import EngineConfig
    from speckv.engine.messages import ScheduledRequest
    from speckv.engine.request import Request
    from speckv.models.base import TargetModel
    from speckv.models.common.kv_layout import KVCacheLayout

logger = logging.getLogger("speckv.engine")

GROUP_ID = 0  # the connector copies the one full-attention group the engine runs


# ---- start-up ----------------------------------------------------------------------------------
def build_connector(config: EngineConfig, model: TargetModel, drafter: Any | None
                    ) -> KVConnector | None:
    """The configured connector, not yet initialized (None: no `kv_connector`, no
    `kv_transfer`).

    A disk tier or a shared store is namespaced by a fingerprint of the target's and the
    drafter's weights: the draft KV it keeps depends on both."""
    transfer = build_transfer_connector(config)
    connector_config = config.kv_connector
    if connector_config is None:
        return transfer
    identity = None
    if needs_identity(connector_config):
        named = [(f"target.{name}", tensor) for name, tensor in model.named_parameters()]
        if drafter is not None:
            named += [(f"draft.{name}", tensor) for name, tensor in drafter.named_parameters()]
        identity = TierIdentity(fingerprint_tensors(named), config.cache.hash_algo,
                                config.cache.hash_seed)
    # the tiers first: a request they can serve locally pulls nothing from the prefill engine
    return combine([make_connector(connector_config, identity), transfer])


def build_transfer_connector(config: EngineConfig) -> KVConnector | None:
    """The prefill/decode transfer connector of `--kv-transfer-config` (None: off)."""
    transfer = config.kv_transfer
    if transfer is None:
        return None
    seed = persistent_hash_seed(config.cache.hash_seed, "--kv-transfer-config")
    return transfer.build(config.kv_load_failure_policy, config.cache.hash_algo, seed)


def initialize_connector(connector: KVConnector, target_cache: Any,
                         draft_cache: PagedKVCache | None, hash_mode: HashMode,
                         block_size: int, *, manager: KVCacheManager | None = None,
                         layout: KVCacheLayout | None = None, state_cache: Any = None) -> None:
    """Bind the connector to the engine's caches and hash mode (once, before the first step).

    A hybrid model (`manager` with several KV cache groups): every group's device blocks
    (`group_device_kv`) and every group's mode (`group_modes`), under one alignment unit."""
    if manager is None or len(manager.managers) == 1:
        connector.initialize(DeviceKV(target_cache, draft_cache),
                             ConnectorMode.from_hash_mode(hash_mode, block_size, GROUP_ID))
    else:
        if layout is None:
            raise ValueError("a hybrid model's connector needs its KV cache layout")
        connector.initialize(
            group_device_kv(layout, manager, target_cache, draft_cache, state_cache),
            ConnectorMode.from_hash_mode(hash_mode, block_size, GROUP_ID,
                                         group_modes(manager), manager.alignment_tokens))
    logger.info("KV connector %s: %s (%s)", connector.name, hash_mode.label, hash_mode.reason)


def group_modes(manager: KVCacheManager) -> tuple[GroupMode, ...]:
    """Every KV cache group as a tier carries it: the local cache's block sizes, hash chains,
    what a hit reads and what it keeps (`speckv.connectors.rules.GroupMode`)."""
    modes = []
    for manager_g in manager.managers:
        spec, info = manager_g.spec, manager_g.group
        partial = isinstance(spec, SlidingWindowSpec | MambaSpec)
        needed = (spec.num_window_blocks if isinstance(spec, SlidingWindowSpec)
                  else 1 if isinstance(spec, MambaSpec) else 0)
        modes.append(GroupMode(
            info.group_id, spec.kind, spec.block_size, info.lookahead_tokens,
            spec.block_size // manager.hash_block_size, needed,
            manager_g.num_tail_blocks if partial else 0,
            manager.retention if partial else None))
    return tuple(modes)


def group_device_kv(layout: KVCacheLayout, manager: KVCacheManager, target_cache: Any,
                    draft_cache: PagedKVCache | None, state_cache: Any) -> GroupedDeviceKV:
    """Every group's device blocks. Attention groups: the group's own `PagedKVCache` (a
    `GroupedKVCache`), the whole cache (the model's only attention group), or the group's
    layers of a cache every attention layer shares; the drafter's KV rides on the draft
    group. A Mamba / GDN group: the conv and recurrent state tensors of `state_cache`, one
    checkpoint per block of the unit."""
    attention = [g for g, group in enumerate(layout.groups)
                 if not isinstance(group.spec, MambaSpec)]
    groups = []
    for g, group in enumerate(layout.groups):
        spec = group.spec
        num_blocks = manager.pools[g].num_blocks
        if isinstance(spec, MambaSpec):
            if state_cache is None:
                raise ValueError("a Mamba / GDN group's connector needs the state cache")
            segments = [
                DeviceSegment(KVSegment.state(name, (tensor.shape[0], *tensor.shape[2:]),
                                              spec.block_size, tensor.dtype), tensor, 1)
                for name, tensor in (("state.conv", state_cache.conv),
                                     ("state.recurrent", state_cache.recurrent))]
        else:
            if isinstance(target_cache, GroupedKVCache):
                segments = [DeviceSegment.of_cache(TARGET, target_cache.caches[g])]
            elif len(attention) == 1:
                segments = [DeviceSegment.of_cache(TARGET, target_cache)]
            else:
                segments = [DeviceSegment.of_cache(TARGET, target_cache, group.layer_indices)]
            if g == layout.draft_group and draft_cache is not None:
                segments.append(DeviceSegment.of_cache(DRAFT, draft_cache))
        groups.append(DeviceKV(segments=segments, num_blocks=num_blocks))
    return GroupedDeviceKV(groups)


# ---- scheduler side ----------------------------------------------------------------------------
@dataclass(frozen=True)
class RemoteLoad:
    """A request in WAITING_FOR_REMOTE_KVS: its blocks hold the local hit, then the range the
    connector loads asynchronously, `[num_hit_tokens, num_hit_tokens + num_external_tokens)`."""

    num_hit_tokens: int
    num_external_tokens: int

    @property
    def end(self) -> int:
        return self.num_hit_tokens + self.num_external_tokens


@dataclass
class HeldBlocks:
    """A finished request whose blocks stay allocated (not freed, not reusable) until no
    transfer touches them: its asynchronous load still in flight (an abort while waiting), or
    the connector still sending them (`FinishDecision.delay_free`)."""

    request: Request
    waits_for_load: bool
    waits_for_send: bool

    @property
    def released(self) -> bool:
        return not self.waits_for_load and not self.waits_for_send


class SchedulerConnector:
    """The scheduler's calls into the connector. Reads the cache manager for block ids; never
    touches device memory. `load_failure_policy` (`--kv-load-failure-policy`): what a failed
    load does to its request, "recompute" (from the first failed token) or "fail" (it ends
    with an error)."""

    def __init__(self, connector: KVConnector, manager: KVCacheManager,
                 load_failure_policy: str = DEFAULT_LOAD_FAILURE_POLICY) -> None:
        self.connector = connector
        self.manager = manager
        self.load_failure_policy = check_load_failure_policy(load_failure_policy)
        self.multi_group = len(manager.managers) > 1
        if self.multi_group:
            manager.record_released_blocks()

    def _blocks(self, request: Request, num_written_tokens: int) -> RequestBlocks:
        tables = self.manager.get_block_ids(request.request_id)
        if not self.multi_group:
            return RequestBlocks(request, tables[GROUP_ID], num_written_tokens)
        return RequestBlocks(request, tables[GROUP_ID], num_written_tokens, tables,
                             self.manager.take_released_block_ids(request.request_id))

    def external_hit(self, request: Request, num_local_hit_tokens: int) -> ExternalHit:
        """What a tier (or a remote engine) can load right after the local hit (whole
        blocks), and whether that load is asynchronous."""
        return self.connector.get_num_new_matched_tokens(request, num_local_hit_tokens)

    def num_external_tokens(self, request: Request, num_local_hit_tokens: int) -> int:
        """Tokens a tier can load right after the local hit (whole blocks, 0 for none)."""
        return self.external_hit(request, num_local_hit_tokens).num_tokens

    def after_alloc(self, request: Request, group_block_ids: GroupBlockIds,
                    num_local_hit_tokens: int, num_external_tokens: int) -> None:
        """The request got its blocks (`group_block_ids`: its whole table of every group)."""
        self.connector.update_state_after_alloc_groups(request, group_block_ids,
                                                       num_local_hit_tokens,
                                                       num_external_tokens)

    def build_metadata(self, scheduled: Sequence[ScheduledRequest],
                       requests: Mapping[str, Request]) -> StepMetadata:
        """This step's loads and saves. A running request's KV is written up to its `start`.
        A request in its first step (new or resumed) counts as having written nothing yet:
        its local hit may name blocks that another request computes in this very step (they
        were cached when that request's slots were allocated, and are written by this step's
        forward), and its external range is loaded only in this step's worker phase, after
        the saves are snapshotted. Its next step saves all of it."""
        meta = self.connector.build_connector_meta([
            self._blocks(requests[item.request_id],
                         0 if item.replaces_block_table else item.start)
            for item in scheduled
        ])
        if self.multi_group:  # releases not listed now may be reused from the next step
            self.manager.drop_released_block_ids()
        return meta

    def preempted(self, request: Request) -> None:
        """Before the preempted request's blocks are freed (its computed tokens still set)."""
        self.connector.request_preempted(self._blocks(request, request.num_computed_tokens))

    def finished(self, request: Request) -> FinishDecision:
        """Before the exiting request's blocks are freed. With `delay_free` the scheduler
        keeps them until the connector lists the request in `finished_sending`."""
        return self.connector.request_finished(
            self._blocks(request, request.num_computed_tokens))


def load_failure_error(failure: LoadFailure) -> str:
    """The error a request ends with under `--kv-load-failure-policy fail`."""
    return (f"loading the prompt's KV cache through the KV connector failed at token "
            f"{failure.first_failed_token} ({failure.reason}); --kv-load-failure-policy fail "
            "ends the request (recompute would compute those tokens instead)")


def apply_load_failure(request: Request, item: ScheduledRequest, failure: LoadFailure) -> None:
    """The request's load failed from `failure.first_failed_token` on; the runner computed
    nothing for it this step. Roll it back so it recomputes from there. Mutates."""
    roll_back_load(request, item.num_hit_tokens, item.start, failure)


def roll_back_load(request: Request, num_hit_tokens: int, end: int,
                   failure: LoadFailure) -> None:
    """A load of `[num_hit_tokens, end)` failed from `failure.first_failed_token` on: the
    request's computed tokens stop there, its cached counts drop by what was lost. Mutates."""
    first = failure.first_failed_token
    if not num_hit_tokens <= first < end:
        raise RuntimeError(
            f"request {request.request_id}: load failure at token {first} outside its loaded "
            f"range [{num_hit_tokens}, {end})"
        )
    num_lost = end - first
    request.num_computed_tokens = first
    if request.num_preemptions == 0:  # the first schedule's counts are what outputs report
        request.num_cached_tokens -= num_lost
        request.num_external_cached_tokens -= num_lost


# ---- runner side -------------------------------------------------------------------------------
def failed_requests(scheduled: Sequence[ScheduledRequest], block_tables: Mapping[str, list[int]],
                    failed_block_ids: frozenset[int], block_size: int) -> dict[str, int]:
    """Request id → first failed token, for every scheduled request whose loaded range holds a
    failed block (the runner's own block tables; loads only fill blocks of that range)."""
    if not failed_block_ids:
        return {}
    failed: dict[str, int] = {}
    for item in scheduled:
        if not item.num_external_tokens:
            continue
        table = block_tables[item.request_id]
        for index in range(item.num_hit_tokens // block_size, item.start // block_size):
            if table[index] in failed_block_ids:
                failed[item.request_id] = index * block_size
                break
    return failed


class RunnerConnector:
    """The runner's calls into the connector (worker side): it copies, never decides."""

    def __init__(self, connector: KVConnector, block_size: int) -> None:
        self.connector = connector
        self.block_size = block_size
        self._cut: dict[str, int] = {}
        self._scheduled_ids: frozenset[str] = frozenset()

    def start_step(self, meta: StepMetadata | None, scheduled: Sequence[ScheduledRequest],
                   block_tables: Mapping[str, list[int]]) -> dict[str, int]:
        """Before the forward: snapshot the step's saves, load its tier blocks. Returns the
        requests to cut from this step's batch (their load failed): id → first failed token."""
        if meta is None:
            raise RuntimeError("the engine has a KV connector but the step carries no metadata")
        self.connector.start_load_kv(meta)
        self._scheduled_ids = frozenset(item.request_id for item in scheduled)
        self._cut = failed_requests(scheduled, block_tables,
                                    self.connector.get_block_ids_with_load_errors(),
                                    self.block_size)
        return self._cut

    def finish_step(self) -> ConnectorOutput:
        """After the forward and the drafter's catch-up: the connector's report of the step."""
        self.connector.wait_for_save()
        output = self.connector.get_finished()
        # a failure of this step's batch was cut from it; any other is an asynchronous load's
        reported = {failure.request_id: failure.first_failed_token
                    for failure in output.load_failures
                    if failure.request_id in self._scheduled_ids}
        if reported != self._cut:
            raise RuntimeError(f"KV connector {self.connector.name!r} reported load failures "
                               f"{reported}, its failed blocks say {self._cut}")
        stray = {failure.request_id for failure in output.load_failures
                 if failure.request_id not in self._scheduled_ids} - output.finished_recving
        if stray:
            raise RuntimeError(f"KV connector {self.connector.name!r} reported load failures "
                               f"of {sorted(stray)}, neither in this step's batch nor in "
                               "finished_recving")
        self._cut = {}
        return output

