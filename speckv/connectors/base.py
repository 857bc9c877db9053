"""The KV connector interface: a scheduler side, a worker side, and where the engine calls each.

A connector moves KV blocks between this engine's paged caches and something else (a CPU pool,
a directory, another engine). As in vLLM's `KVConnectorBase_V1`, its methods split into a
scheduler side (decides, never touches device memory) and a worker side (copies, never decides);
the scheduler side hands the worker side one typed `StepMetadata` per step. Both sides of one
connector object live in the engine process and may share the tier.

Where the engine calls each method (one engine step, in order):

    start-up, after the hash mode is resolved (`engine.speculative.resolve_connector_hash_mode`) and
    the target's and drafter's `PagedKVCache`s exist:
        connector.initialize(DeviceKV(target_cache, draft_cache),
                             ConnectorMode.from_hash_mode(hash_mode, block_size))

    Scheduler.schedule(), for a waiting request, right after the local hit
    `hit = manager.get_computed_blocks(request)` (the connector may read
    `request.kv_transfer_params`, the API request's field):
        ext = connector.get_num_new_matched_tokens(request, hit.num_computed_tokens)
        synchronous (ext.load_async False, or ext.num_tokens 0):
            # allocate slots for ext.num_tokens more computed tokens + the new tokens; the
            # request computes in this step, after the worker phase loaded its range
        asynchronous (ext.load_async, ext.num_tokens > 0):
            # allocate the hit's and the loaded range's blocks only; the request moves to
            # WAITING_FOR_REMOTE_KVS and is not scheduled (no budget) until its load finished
    right after a successful `allocate_slots` of that request (ext may be 0; one table per
    KV cache group, `update_state_after_alloc` with group 0's unless a connector overrides):
        connector.update_state_after_alloc_groups(request, group_block_ids,
                                                  hit.num_computed_tokens, ext.num_tokens)
    in Scheduler._preempt, before `manager.free(request)` (num_written = its
    num_computed_tokens before `preempt()` resets it):
        connector.request_preempted(RequestBlocks(request, block_ids, num_written))

    after schedule(), before ModelRunner.execute (every step that runs, even with nothing
    to load; every built metadata must be started, or the next build raises):
        meta = connector.build_connector_meta(
            [RequestBlocks(item.request, block_ids, written) for item in scheduled])
        # written = item.start for a running request; 0 in a request's first step (new,
        # resumed, or after its asynchronous load): its local hit may name blocks another
        # request computes in this very step (cached at that request's allocation, written by
        # this step's forward), and its external range is loaded after the saves are
        # snapshotted (the connector also caps that step's saves at the local hit itself)
        connector.start_load_kv(meta)         # snapshots this step's saves, then loads;
                                              # an asynchronous load may return before done
        failed = connector.get_block_ids_with_load_errors()
        # a scheduled request owning a failed block: cut it from this step's batch, set its
        # num_computed_tokens to the failure's first_failed_token; it recomputes from there
        # (kv_load_failure_policy "fail": it ends with an error instead)

    after ModelRunner.execute, the sampler and the drafter's catch-up (draft KV written):
        connector.wait_for_save()

    at request exit (finish, abort, unschedulable), before `manager.free` / `finish` frees:
        decision = connector.request_finished(
            RequestBlocks(request, block_ids, request.num_computed_tokens))
        # decision.kv_transfer_params ride to the request's final output (and the API's
        # response); decision.delay_free: the blocks stay allocated, not reusable, until
        # get_finished() lists the request in finished_sending. A request aborted while its
        # asynchronous load runs keeps its blocks until finished_recving lists it.

    end of the step (its report goes back to Scheduler.update_from_output):
        output = connector.get_finished()
        # load_failures first; finished_recving: asynchronous loads done (a failure also in
        # load_failures): the request's num_computed_tokens moves past what loaded (or to the
        # first failed token), those blocks are cached only now, and it is scheduled from the
        # front of the queue; finished_sending: delayed frees done, the blocks are freed
        events = connector.take_events()      # BlockStored / BlockRemoved with medium

Device KV changes only inside the worker phase: `start_load_kv`, the forward and the drafter.
A save listed for step `t` names blocks whose KV was complete at the end of step `t - 1`
(possibly blocks freed since, by a finish or a preemption, and already handed to another
request); `start_load_kv` snapshots them first, before any load or forward of step `t` can
overwrite them. That is why no tier connector here needs to delay freeing a block; a
connector that reads blocks after the step (a transfer to another engine) asks `delay_free`.

Blocks entering the device from a tier must not enter the local prefix cache (the pool's hash
map) until their load succeeded: `allocate_slots` must not cache the external range in the step
that loads it; the next `allocate_slots` (or `cache_computed_blocks` at exit) caches them. An
asynchronous load's blocks are cached when `finished_recving` reports it, up to its first
failed token.
Otherwise a failed load would leave hashes naming garbage, and another request scheduled in
the same step could take a local hit on them.

A tier block holds the target KV and the drafter's KV of its positions, so the drafter treats
external hit tokens exactly like local hit tokens: their draft KV is already in its cache.

A hybrid model (several KV cache groups: full attention, sliding window, Mamba / GDN state)
shows a connector every group's table (`RequestBlocks.group_block_ids`, the tables in
`update_state_after_alloc_groups`) and the cached blocks the manager released from a request
in this step's scheduling (`RequestBlocks.released_block_ids`: behind a window, old state
checkpoints), which a connector may snapshot in this step's `start_load_kv` only. A connector
says which groups it carries (`kv_group_support`); the tiers carry all (`group_tiers.py`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from speckv.cache.events import KVCacheEvent
from speckv.connectors.capability import SINGLE_FULL_ATTENTION, KVGroupSupport
from speckv.connectors.layout import DeviceKV
from speckv.connectors.metadata import ConnectorOutput, ConnectorStats, StepMetadata
from speckv.connectors.rules import ConnectorMode, ConnectorRequest

MEDIUM_CPU = "CPU"
MEDIUM_DISK = "DISK"


GroupBlockIds = tuple[Sequence[int], ...]  # one block table per KV cache group, group order
ReleasedBlocks = tuple[tuple[tuple[int, int], ...], ...]  # per group: (block index, block id)


@dataclass(frozen=True)
class RequestBlocks:
    """One request as the engine shows it to a connector at one moment.

    `block_ids` are the request's device blocks of group 0 (the full-attention group the
    drafter's KV follows), in position order (the null block 0 stands for "no KV here");
    `num_written_tokens` counts the positions whose target and draft KV are in those blocks
    right now.

    Hybrid models (several KV cache groups, each with a pool of its own, so the same id means
    different memory in different groups): `group_block_ids[g]` is group g's table
    (`group_block_ids[0] == block_ids`); empty means one group, `(block_ids,)`.
    `released_block_ids[g]` lists (block index, block id) pairs of group g that the cache
    manager released from the request in this step's scheduling (blocks behind a sliding
    window, old state checkpoints; their table entries are null now). Each held a cached
    block's KV, which stays intact until this step's worker phase, so a connector may
    snapshot them in this step's `start_load_kv` (and only then: the ids may be reused after).
    """

    request: ConnectorRequest
    block_ids: Sequence[int]
    num_written_tokens: int
    group_block_ids: GroupBlockIds = ()
    released_block_ids: ReleasedBlocks = ()

    def __post_init__(self) -> None:
        if self.num_written_tokens < 0:
            raise ValueError(f"num_written_tokens must be >= 0, got {self.num_written_tokens}")
        if self.group_block_ids and self.group_block_ids[0] is not self.block_ids \
                and list(self.group_block_ids[0]) != list(self.block_ids):
            raise ValueError("group_block_ids[0] must be block_ids (group 0's table)")

    @property
    def groups(self) -> GroupBlockIds:
        """Every group's table, in group order (one group: `(block_ids,)`)."""
        return self.group_block_ids or (self.block_ids,)

    def released(self, group: int) -> tuple[tuple[int, int], ...]:
        """Group `group`'s (block index, block id) pairs released in this step's scheduling."""
        released = self.released_block_ids
        return released[group] if group < len(released) else ()


@dataclass(frozen=True)
class ExternalHit:
    """Tokens a connector can load beyond the local hit: whole blocks, 0 for none.

    `load_async` (vLLM's `load_kv_async`): the load may outlast a step. The engine then
    allocates the request's blocks, parks it in `WAITING_FOR_REMOTE_KVS` and schedules it only
    after `get_finished()` lists it in `finished_recving`; False: the load is done (or failed)
    when `start_load_kv` returns, and the request computes in the step that loads."""

    num_tokens: int
    medium: str | None = None  # where they come from ("CPU", "DISK"); None when 0
    load_async: bool = False


@dataclass(frozen=True)
class FinishDecision:
    """What a connector wants done with a finishing request's blocks.

    `delay_free`: keep the blocks (allocated, not reusable) until `get_finished()` lists the
    request in `finished_sending` (a transfer still reads them). `kv_transfer_params` ride to
    the request's final output (`RequestOutput.kv_transfer_params`, the API's field of that
    name), e.g. where a decode engine finds the blocks."""

    delay_free: bool = False
    kv_transfer_params: dict[str, Any] | None = None


class TransferParamsError(ValueError):
    """A request's `kv_transfer_params` a connector refuses; `field` names the offending field
    (`param` in the API's words: `kv_transfer_params.host`)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"kv_transfer_params.{field}: {message}" if field
                         else f"kv_transfer_params: {message}")
        self.field = field

    @property
    def param(self) -> str:
        return f"kv_transfer_params.{self.field}".rstrip(".")


class KVConnector(ABC):
    """Base of every connector. Subclasses implement both sides; see the module docstring for
    the engine's call sites."""

    name: str = "connector"

    @property
    def supports_lookahead_block_hashes(self) -> bool:
        """True if the connector stays correct with lookahead block hashes.

        Content-addressed tiers that store and look up only blocks covered by the request's
        block hashes opt in; anything else keeps the default, and the engine falls back to
        legacy hashes with the last-block drop.
        """
        return False

    @property
    def kv_group_support(self) -> KVGroupSupport:
        """The KV cache groups this connector stores and loads (`capability.py`): by default
        one full-attention group. The engine refuses a connector that cannot carry every
        group of its model."""
        return SINGLE_FULL_ATTENTION

    @abstractmethod
    def initialize(self, kv: DeviceKV, mode: ConnectorMode) -> None:
        """Bind the device caches and the hash mode; called once before anything else."""

    # ---- scheduler side ----------------------------------------------------------------------
    @abstractmethod
    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_local_hit_tokens: int) -> ExternalHit:
        """Tokens loadable beyond the local hit (a whole number of blocks), and whether the
        load is asynchronous. No side effects beyond statistics: it may be called again for
        the same request."""

    def peek_num_matched_tokens(self, request: ConnectorRequest,
                                num_local_hit_tokens: int) -> ExternalHit:
        """`get_num_new_matched_tokens` without counting a lookup (a multi-connector asks
        again after allocation)."""
        return self.get_num_new_matched_tokens(request, num_local_hit_tokens)

    @abstractmethod
    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[int],
                                 num_local_hit_tokens: int, num_external_tokens: int) -> None:
        """The request got its blocks: plan loading `num_external_tokens` (from
        `get_num_new_matched_tokens`, possibly 0) into them, after the local hit."""

    def update_state_after_alloc_groups(self, request: ConnectorRequest,
                                        group_block_ids: GroupBlockIds,
                                        num_local_hit_tokens: int,
                                        num_external_tokens: int) -> None:
        """`update_state_after_alloc` with every KV cache group's table (`group_block_ids[g]`,
        group order; what the engine calls). By default a connector of one group gets
        group 0's table; a connector that carries several groups overrides this."""
        self.update_state_after_alloc(request, group_block_ids[0], num_local_hit_tokens,
                                      num_external_tokens)

    def sibling_loads(self, request: ConnectorRequest, num_local_hit_tokens: int,
                      num_external_tokens: int) -> None:
        """Another connector of a multi-connector loads `num_external_tokens` after the local
        hit into this request's blocks (this one got 0 in `update_state_after_alloc`). A
        connector that saves blocks of groups a load fills only in part (a sliding window's
        tail, a state) must not save the rest of that range. Default: nothing to do."""
        return None

    @abstractmethod
    def build_connector_meta(self, scheduled: Sequence[RequestBlocks]) -> StepMetadata:
        """This step's loads (planned since the last call) and saves (blocks of `scheduled`
        requests, and of requests that exited since the last call, whose KV is complete)."""

    @abstractmethod
    def request_finished(self, blocks: RequestBlocks) -> FinishDecision:
        """The request exits; its blocks are freed after this returns, unless delayed (until
        `finished_sending` lists it) or its asynchronous load still runs (until
        `finished_recving` lists it)."""

    @abstractmethod
    def request_preempted(self, blocks: RequestBlocks) -> None:
        """The request's blocks are freed by a preemption; it will come back as new."""

    def take_events(self) -> list[KVCacheEvent]:
        """KV events of the tier (blocks stored and removed, with `medium`) since the last call."""
        return []

    def reset_cache(self) -> bool:
        """Forget everything stored (not the local prefix cache). False if blocks are in use."""
        return True

    # ---- a request's kv_transfer_params (the API passes them on untouched) --------------------
    def check_transfer_params(self, params: Mapping[str, Any] | None) -> None:
        """When a request is added, before it is queued: TransferParamsError if this connector
        refuses its `kv_transfer_params`. No I/O (it runs on the engine's thread)."""
        return None

    def transfer_abandoned(self, params: Mapping[str, Any] | None) -> None:
        """A request with these params was refused before the engine took it (a bad field, a
        full queue): whatever a peer keeps for it may go. Never blocks."""
        return None

    # ---- worker side -------------------------------------------------------------------------
    def start_load_kv(self, meta: StepMetadata) -> None:
        """Before the forward: snapshot the step's saves, then load into the device blocks.
        A synchronous load is in device memory (or reported failed) when this returns; an
        asynchronous one (`ExternalHit.load_async`) may land in a later step, reported then
        in `get_finished().finished_recving`."""
        self.snapshot_saves(meta)
        self.load_blocks(meta)

    @abstractmethod
    def snapshot_saves(self, meta: StepMetadata) -> None:
        """First half of `start_load_kv`: copy the saved blocks' bytes out of device memory.
        Separate so a multi-connector snapshots for every child before any child loads."""

    @abstractmethod
    def load_blocks(self, meta: StepMetadata) -> None:
        """Second half of `start_load_kv`: copy tier blocks into the device blocks."""

    def wait_for_save(self) -> None:
        """After the forward and the drafter. Every connector here snapshots its saves in
        `start_load_kv` and stores them on a copy thread, so none waits here."""
        return None

    @abstractmethod
    def get_finished(self) -> ConnectorOutput:
        """Loads finished in the last `start_load_kv`, requests whose saves have all settled,
        load failures, asynchronous loads done (`finished_recving`) and delayed frees done
        (`finished_sending`); each reported once."""

    @abstractmethod
    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        """Device blocks of the last `start_load_kv` that hold no valid KV."""

    # ---- both --------------------------------------------------------------------------------
    @abstractmethod
    def stats(self) -> dict[str, ConnectorStats]:
        """Counters per tier, by connector name."""

    def flush(self, timeout_s: float | None = None) -> bool:
        """Between steps only: store every pending save and wait for the copy thread. True if
        everything settled within `timeout_s`."""
        return True

    def startup_lines(self) -> tuple[str, ...]:
        """What `speckv serve` prints about this connector when it starts (nothing here)."""
        return ()

    def shutdown(self) -> None:
        """Stop background threads; pending stores are dropped."""
        return None
