"""Scheduler: continuous batching over the KV cache manager, and the request lifecycle.

Owns the requests (waiting queue, running list) and both halves of every step:

`schedule()` decides what runs under a token budget (`max_num_batched_tokens`) and a batch
limit (`max_num_seqs`) and hands the runner a `SchedulerOutput` (block-id deltas, drafts):
running requests first (decodes, prefill chunks; preemption by recompute of the most recently
added when blocks run out), then, unless a preemption happened this step, waiting ones through
the one admission path `_admit`: a prefix-cache hit (free of budget; a preempted request
re-hits what it had cached), what a KV connector's tier holds right after it (loaded before
the forward, also free), then as much of the prompt as the budget allows (chunked prefill).
A hit that reuses a block at a divergence point adds its `BlockCopy`; a request whose
divergent block another request computes in this very step waits a step for it.

With a KV connector, the step's connector metadata rides in the SchedulerOutput; preempted
and exiting requests are shown to it before their blocks are freed; load failures roll back
(or end) their requests; an asynchronous hit parks its request in WAITING_FOR_REMOTE_KVS, and
blocks a transfer still touches after a finish stay held (the life cycle: `kv_connector.py`).

`update_from_output()` applies what the runner sampled: rejected drafts rolled back, real
tokens appended (new block hashes follow, after the runner wrote their draft KV), the next
drafts kept, finished requests out (their last completed block cached, then freed).

    hit → allocate → (runner computes, verifies, drafts) → append real tokens → finish / preempt
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from speckv.cache.kv_cache_manager import KVCacheManager
from speckv.cache.results import BlockCopy, CacheHit
from speckv.connectors import ConnectorOutput, LoadFailure
from speckv.engine.kv_connector import (
    HeldBlocks,
    RemoteLoad,
    SchedulerConnector,
    apply_load_failure,
    load_failure_error,
    roll_back_load,
)
from speckv.engine.messages import (
    EngineCoreOutput,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from speckv.engine.request import Request, RequestStatus
from speckv.engine.stats import SchedulerStats, StatsCollector

EMPTY_CUTS: Mapping[str, int] = MappingProxyType({})


@dataclass
class _StepBatch:
    """What one `schedule()` call has gathered so far (lives for that call only)."""

    budget: int  # tokens still free under max_num_batched_tokens
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    new_requests: list[NewRequestData] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    copies: list[BlockCopy] = field(default_factory=list)  # divergent block reuse of the hits


def _error_output(request: Request, error: str,
                  kv_transfer_params: dict[str, Any] | None = None) -> EngineCoreOutput:
    """A request that ends with FinishReason.ERROR (no tokens; `error` says why)."""
    return EngineCoreOutput(
        request_id=request.request_id, new_token_ids=[], finish_reason=FinishReason.ERROR,
        num_cached_tokens=request.num_cached_tokens, num_preemptions=request.num_preemptions,
        error=error, num_external_cached_tokens=request.num_external_cached_tokens,
        kv_transfer_params=kv_transfer_params,
    )


class Scheduler:
    def __init__(
        self,
        manager: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        num_spec_tokens: int = 0,
        connector: SchedulerConnector | None = None,
    ) -> None:
        if connector is not None and manager.reuses_divergent_blocks:
            raise ValueError("divergent block reuse does not run under a KV connector (its tiers "
                             "are keyed by whole block hashes): build the hash mode with the "
                             "connector (resolve_connector_hash_mode)")
        self.manager = manager
        self.connector = connector
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.num_spec_tokens = num_spec_tokens
        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_ids: set[str] = set()  # left since the last schedule (runner forgets)
        self._seen_ids: set[str] = set()  # unfinished requests the runner has been sent
        self._outputs: list[EngineCoreOutput] = []  # finished outside a step (no-fit errors)
        self._remote: dict[str, RemoteLoad] = {}  # WAITING_FOR_REMOTE_KVS, by id
        self._loaded: set[str] = set()  # waiting with their blocks (an async load finished)
        self._held: dict[str, HeldBlocks] = {}  # finished, blocks kept for a transfer
        self.stats = StatsCollector(num_spec_tokens)  # filled during a step, see `take_stats`

    # ---- queue ---------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests or request.request_id in self._held:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: list[str], reason: FinishReason
                        ) -> dict[str, dict[str, Any]]:
        """End unfinished requests now (an abort, between steps).
        ABORT frees their blocks; other reasons first cache what the last token completed.
        Unknown or finished ids are ignored. Returns the KV connector's `kv_transfer_params`
        of those that have some, by id. Mutates."""
        params: dict[str, dict[str, Any]] = {}
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, reason)
                if request.finished_kv_transfer_params is not None:
                    params[request_id] = request.finished_kv_transfer_params
        return params

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self._remote)

    def has_unfinished_requests(self) -> bool:
        """Requests to serve, or finished requests whose blocks a KV transfer still holds
        (steps must go on until the connector reports it done)."""
        return bool(self.requests) or bool(self._held)

    @property
    def num_held_requests(self) -> int:
        """Finished requests whose blocks a KV transfer still holds."""
        return len(self._held)

    # ---- one step: what runs -----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """One step's batch: running requests first (decodes, prefill chunks, preemption by
        recompute), then waiting ones (local hit, connector hit, allocation: `_admit`)."""
        batch = _StepBatch(self.max_num_batched_tokens)
        self._schedule_running(batch)
        if not batch.preempted:
            self._schedule_waiting(batch)
        if not batch.scheduled:
            self._fail_unschedulable()
        finished_ids = frozenset(self._finished_ids)
        self._finished_ids.clear()
        meta = (self.connector.build_metadata(batch.scheduled, self.requests)
                if self.connector is not None else None)
        return SchedulerOutput(
            new_requests=batch.new_requests,
            scheduled=batch.scheduled,
            finished_request_ids=finished_ids,
            preempted_request_ids=frozenset(request.request_id for request in batch.preempted),
            num_scheduled_tokens=self.max_num_batched_tokens - batch.budget,
            kv_connector_metadata=meta,
            block_copies=tuple(batch.copies),
        )

    def _schedule_running(self, batch: _StepBatch) -> None:
        """Running requests in arrival order: a decode takes `1 + len(drafts)` tokens, an
        unfinished prefill its next chunk; where no blocks are free, the most recently added
        running request is preempted until the allocation fits. The per-request hot loop of
        every step, with its attributes bound to locals once."""
        budget = batch.budget
        scheduled = batch.scheduled
        preempted = batch.preempted
        index = 0
        running = self.running
        allocate_slots = self.manager.allocate_slots
        num_spec_tokens = self.num_spec_tokens
        while index < len(running) and budget > 0:
            request = running[index]
            num_tokens = len(request.all_token_ids)  # real tokens
            start = request.num_computed_tokens
            num_pending = num_tokens - start
            drafts = request.spec_token_ids
            num_drafts = len(drafts)
            num_new = min(num_pending + num_drafts, budget)
            if num_new < num_pending + num_drafts:
                # the budget cuts the drafts (or the prefill chunk): drop what does not fit
                num_drafts = max(0, num_new - num_pending)
                request.spec_token_ids = drafts = drafts[:num_drafts]
            num_draft_slots = num_spec_tokens if num_new >= num_pending else 0
            while True:
                allocation = allocate_slots(request, num_new, None, num_draft_slots)
                if allocation is not None:
                    break
                victim = running.pop()  # the most recently added running request
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if allocation is None:
                break  # preempted itself: everything after it is preempted too
            request.num_computed_tokens = start + num_new
            scheduled.append(ScheduledRequest(
                request_id=request.request_id, start=start, num_new_tokens=num_new,
                draft_token_ids=tuple(drafts), new_block_ids=allocation.new_block_ids,
                replaces_block_table=False, num_hit_tokens=0,
                # does this step compute the last real token? (see `_samples`)
                samples=start + num_new - num_drafts >= num_tokens,
            ))
            budget -= num_new
            index += 1
        batch.budget = budget

    def _schedule_waiting(self, batch: _StepBatch) -> None:
        """Waiting requests in queue order while budget and batch room last: each one's local
        hit, then what a KV connector holds right after it, then `_admit`. A request whose
        asynchronous load finished holds its blocks already and is admitted as it stands."""
        deferred: list[Request] = []  # waiting a step for a divergent block (see below)
        while self.waiting and batch.budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            if request.request_id in self._loaded:
                if not self._admit(batch, request):
                    break  # no room: it waits (and everything behind it) for a finish
                continue
            # a waiting request has nothing computed (new, or preempted: reset to 0)
            assert request.num_computed_tokens == 0
            hit = self.manager.get_computed_blocks(request)
            if hit.copy_next_step and batch.scheduled:
                # its divergent block is computed in this step: it keeps its place and
                # copies the block next step (cheaper than recomputing it, measured on a
                # first wave); the requests behind it go on (a whole queue a step late
                # costs more than the copy saves)
                deferred.append(self.waiting.popleft())
                continue
            external = (self.connector.external_hit(request, hit.num_computed_tokens)
                        if self.connector is not None else None)
            num_external = external.num_tokens if external is not None else 0
            load_async = external is not None and external.load_async and num_external > 0
            if not self._admit(batch, request, hit, num_external, load_async=load_async):
                break  # no room: it waits (and everything behind it) for a finish
        if deferred:
            self.waiting.extendleft(reversed(deferred))

    def _admit(self, batch: _StepBatch, request: Request, hit: CacheHit | None = None,
               num_external: int = 0, *, load_async: bool = False) -> bool:
        """The one way from the waiting queue's head into the batch (or into
        WAITING_FOR_REMOTE_KVS). `hit` None: a request whose asynchronous load finished (it
        holds its blocks and has computed what loaded; the runner gets its whole block table).
        Otherwise its local hit, then `num_external` tokens a KV connector loads: in this
        step's worker phase, or with `load_async` later (blocks allocated now, no budget,
        nothing past the hit cached until the load succeeded). False: no room. Mutates."""
        request_id = request.request_id
        loaded = hit is None
        num_hit = request.num_computed_tokens if hit is None else hit.num_computed_tokens
        start = num_hit + num_external
        num_new = num_draft_slots = 0
        if not load_async:
            num_pending = request.num_tokens - start
            num_new = min(num_pending, batch.budget)
            num_draft_slots = self.num_spec_tokens if num_new == num_pending else 0
        allocation = self.manager.allocate_slots(request, num_new, hit, num_draft_slots,
                                                 num_external)
        if allocation is None:
            return False
        self.waiting.popleft()
        if loaded:
            self._loaded.discard(request_id)
        else:
            batch.copies.extend(allocation.copies)
            self.stats.record_admission(request_id, request.num_tokens, num_hit,
                                        request.num_preemptions > 0,
                                        None if self.connector is None else num_external)
            if self.connector is not None:
                self.connector.after_alloc(request, allocation.new_block_ids, num_hit,
                                           num_external)
            if request.num_preemptions == 0:  # first schedule (only preemption re-queues)
                request.num_cached_tokens = start
                request.num_external_cached_tokens = num_external
        if load_async:
            request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
            self._remote[request_id] = RemoteLoad(num_hit, num_external)
            return True
        if request_id not in self._seen_ids:
            self._seen_ids.add(request_id)
            batch.new_requests.append(request.new_request_data())
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = start + num_new
        self.running.append(request)
        batch.scheduled.append(ScheduledRequest(
            request_id=request_id, start=start, num_new_tokens=num_new, draft_token_ids=(),
            new_block_ids=(self.manager.get_block_ids(request_id) if loaded
                           else allocation.new_block_ids),
            replaces_block_table=True, num_hit_tokens=num_hit, samples=self._samples(request),
            num_external_tokens=num_external,
        ))
        batch.budget -= num_new
        return True

    @staticmethod
    def _samples(request: Request) -> bool:
        """After advancing num_computed_tokens: does this step compute the last real token?"""
        return request.num_computed_tokens - len(request.spec_token_ids) >= request.num_tokens

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: cache what is computed (a later hit recovers it), free."""
        if self.connector is not None:
            self.connector.preempted(request)
        self.manager.cache_computed_blocks(request)
        self.manager.free(request)
        self.stats.record_preemption()
        request.preempt()
        self.waiting.appendleft(request)

    def _fail_unschedulable(self) -> None:
        """Nothing could run: the waiting head needs more blocks than the whole cache has
        (its prompt plus what it generated outgrew the cache). It ends with an error."""
        if self.running or self._remote or self._held or not self.waiting:
            return  # (loads and transfers in flight end and free blocks)
        request = self.waiting[0]
        capacity = (self.manager.pool.num_blocks - 1) * self.manager.hash_block_size
        error = (
            f"{request.num_tokens} tokens no longer fit in the KV cache (it holds {capacity} "
            "tokens in all); raise the KV cache size or lower max_tokens"
        )
        self._finish(request, FinishReason.ERROR)
        self._outputs.append(_error_output(request, error))

    # ---- one step: what it produced ----------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput,
        stop_string_cuts: Mapping[str, int] = EMPTY_CUTS,
    ) -> list[EngineCoreOutput]:
        """Apply one step's sampled tokens and drafts; finish what stopped. `stop_string_cuts`:
        per request whose sampled tokens complete a stop string, how many of them to keep
        (the output processor finds them in the text; the request ends with STOP). Mutates."""
        outputs, self._outputs = self._outputs, []
        connector_output = runner_output.kv_connector_output
        if connector_output is not None:
            # first, so nothing below caches or stores a block whose load failed
            self._apply_connector_output(scheduler_output, connector_output, outputs)
        sampled_by_id = runner_output.sampled_token_ids
        drafts_by_id = runner_output.draft_token_ids
        reasons = runner_output.finish_reasons
        accepted_by_id = runner_output.num_accepted_drafts
        requests = self.requests
        verified: list[int] = []  # drafts verified, per request that had drafts
        verified_accepted: list[int] = []  # of them kept
        for item in scheduler_output.scheduled:
            request_id = item.request_id
            sampled = sampled_by_id.get(request_id)
            if sampled is None:
                continue  # a prefill chunk that does not sample yet
            request = requests.get(request_id)
            if request is None:
                continue
            # the runner cut `sampled` at the first stop token and named the reason
            reason = reasons.get(request_id)
            if stop_string_cuts:
                cut = stop_string_cuts.get(request_id)
                if cut is not None:
                    sampled = sampled[:cut]
                    reason = FinishReason.STOP
            num_drafts = len(item.draft_token_ids)
            request.apply_verification(num_drafts, sampled)
            num_accepted = 0
            if num_drafts:
                # what the verification accepted, as far as the stop kept it
                num_accepted = min(accepted_by_id[request_id], len(sampled) - 1)
                verified.append(num_drafts)
                verified_accepted.append(num_accepted)
            if reason is None:
                next_drafts = drafts_by_id.get(request_id)
                request.spec_token_ids = list(next_drafts) if next_drafts else []
            else:
                self._finish(request, reason)
            outputs.append(EngineCoreOutput(
                request_id=request_id, new_token_ids=sampled, finish_reason=reason,
                num_cached_tokens=request.num_cached_tokens, num_draft_tokens=num_drafts,
                num_accepted_tokens=num_accepted, num_preemptions=request.num_preemptions,
                num_external_cached_tokens=request.num_external_cached_tokens,
                kv_transfer_params=(request.finished_kv_transfer_params
                                    if reason is not None else None),
            ))
        if verified:
            self.stats.record_verifications(verified, verified_accepted)
        # the runner has copied this step's copy sources and written its blocks' KV
        self.manager.step_executed()
        return outputs

    def _apply_connector_output(self, scheduler_output: SchedulerOutput,
                                output: ConnectorOutput, outputs: list[EngineCoreOutput]
                                ) -> None:
        """Load failures (this step's batch, and finished asynchronous loads), asynchronous
        loads done, finished sends. Mutates."""
        failures = {failure.request_id: failure for failure in output.load_failures}
        for request_id in sorted(output.finished_recving):
            self._remote_load_done(request_id, failures.pop(request_id, None), outputs)
        items = {item.request_id: item for item in scheduler_output.scheduled}
        for failure in failures.values():
            request = self.requests.get(failure.request_id)
            if request is None:
                continue
            apply_load_failure(request, items[failure.request_id], failure)
            if self._fails_loads:
                self._end_with_load_error(request, failure, outputs)
        for request_id in output.finished_sending:
            held = self._held.get(request_id)
            if held is not None:
                held.waits_for_send = False
                self._free_if_released(held)

    @property
    def _fails_loads(self) -> bool:
        return self.connector is not None and self.connector.load_failure_policy == "fail"

    def _end_with_load_error(self, request: Request, failure: LoadFailure,
                             outputs: list[EngineCoreOutput]) -> None:
        """`--kv-load-failure-policy fail`: the request ends with an error (what loaded before
        the failure may be cached; nothing after it). Mutates."""
        self._finish(request, FinishReason.ERROR)
        outputs.append(_error_output(request, load_failure_error(failure),
                                     request.finished_kv_transfer_params))

    def _remote_load_done(self, request_id: str, failure: LoadFailure | None,
                          outputs: list[EngineCoreOutput]) -> None:
        """An asynchronous load finished (up to `failure`, if any). A request still waiting
        computed what loaded: those blocks are cached now, never before; it is scheduled from
        the front of the queue. An aborted one's blocks may now be freed. Mutates."""
        held = self._held.get(request_id)
        if held is not None:
            held.waits_for_load = False
            self._free_if_released(held)
            return
        load = self._remote.pop(request_id, None)
        if load is None:
            raise RuntimeError(f"KV connector reported an asynchronous load of request "
                               f"{request_id!r}, which is not waiting for one")
        request = self.requests[request_id]
        if failure is not None:
            roll_back_load(request, load.num_hit_tokens, load.end, failure)
            if self._fails_loads:
                request.status = RequestStatus.WAITING
                self._end_with_load_error(request, failure, outputs)
                return
        else:
            request.num_computed_tokens = load.end
        self.manager.cache_computed_blocks(request)
        request.status = RequestStatus.WAITING
        self._loaded.add(request_id)
        self.waiting.appendleft(request)

    def _free_if_released(self, held: HeldBlocks) -> None:
        if held.released:
            del self._held[held.request.request_id]
            self.manager.free(held.request)

    def take_stats(self) -> SchedulerStats:
        """The statistics of the steps since the last call (occupancy as of now)."""
        return self.stats.take(len(self.running), len(self.waiting),
                               self.manager.get_num_free_blocks(), self.manager.get_num_blocks())

    def _finish(self, request: Request, reason: FinishReason) -> None:
        """Every way out of the scheduler ends here: out of the queues, blocks released
        (cached first unless aborted), the runner told at the next step."""
        request_id = request.request_id
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
            self._loaded.discard(request_id)
        loading = self._remote.pop(request_id, None) is not None
        delay_free = False
        if self.connector is not None:
            decision = self.connector.finished(request)
            delay_free = decision.delay_free
            request.finished_kv_transfer_params = decision.kv_transfer_params
        if reason is not FinishReason.ABORT:
            self.manager.cache_computed_blocks(request)
        if loading or delay_free:
            # a transfer still writes (a load) or reads (a send) these blocks: kept until the
            # connector reports it done, then freed (`_free_if_released`)
            self._held[request_id] = HeldBlocks(request, loading, delay_free)
        else:
            self.manager.free(request)
        request.status = RequestStatus.finished(reason)
        del self.requests[request_id]
        if request_id in self._seen_ids:
            self._seen_ids.discard(request_id)
            self._finished_ids.add(request_id)
