"""Scheduler: continuous batching over the KV cache manager, and the request lifecycle.

Owns the requests (waiting queue, running list) and both halves of every step:

`schedule()` decides what runs under a token budget (`max_num_batched_tokens`) and a batch
limit (`max_num_seqs`) and hands the runner a `SchedulerOutput` (block-id deltas, drafts):

1. Running requests first, in arrival order: a decode takes `1 + len(drafts)` tokens, an
   unfinished prefill its next chunk. When `allocate_slots` finds no free blocks, the most
   recently added running request is preempted by recompute (its computed blocks cached, then
   freed; it goes back to the front of the queue) until the allocation fits.
2. Then waiting requests, unless a preemption happened this step: a prefix-cache hit (hit
   tokens skip their prefill and cost no budget; a preempted request re-hits what it had
   cached), then what a KV connector's tier holds right after it (loaded before the forward,
   also free of budget), then as much of the prompt as the budget allows (chunked prefill).
   A hit that reuses a block at a divergence point adds its `BlockCopy` to the output; a
   request whose divergent block another request computes in this very step waits a step
   for it (a copy reads KV an earlier step wrote), and the queue behind it too.

With a KV connector (`kv_connector.py`), the step's connector metadata rides in the
SchedulerOutput; preempted and exiting requests are shown to it before their blocks are freed;
a load failure the runner reports rolls its request back to the first failed token.

`update_from_output()` applies what the runner sampled: rejected drafts' positions are rolled
back, real tokens appended (new block hashes follow), the next drafts kept, and finished
requests leave (their last completed block cached, then freed). The runner has already written
the draft KV of every position made final in the step, so a block is cached only after its
target and draft KV exist.

    hit → allocate → (runner computes, verifies, drafts) → append real tokens → finish / preempt
"""

from __future__ import annotations

from collections import deque

from speckv.cache.kv_cache_manager import KVCacheManager
from speckv.cache.results import BlockCopy
from speckv.engine.kv_connector import SchedulerConnector, apply_load_failure
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
from speckv.engine.stopping import first_stop


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
        # finished requests whose blocks a KV connector keeps (delay_free), until it lists
        # them in `finished_sending`
        self._sending: dict[str, Request] = {}
        self.stats = StatsCollector(num_spec_tokens)  # filled during a step, see `take_stats`

    # ---- queue ---------------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def finish_requests(self, request_ids: list[str], reason: FinishReason) -> None:
        """End unfinished requests now (abort, or a stop string the output processor found).
        ABORT frees their blocks; other reasons first cache what the last token completed.
        Unknown or finished ids are ignored. Mutates."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, reason)

    def get_request(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        """Requests to run, or finished ones whose blocks a KV connector still keeps (the
        engine keeps stepping so it hears when they are released)."""
        return bool(self.requests) or bool(self._sending)

    @property
    def num_sending(self) -> int:
        """Finished requests whose blocks a KV connector keeps (a prefill engine's leases)."""
        return len(self._sending)

    # ---- one step: what runs -----------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        new_requests: list[NewRequestData] = []
        preempted: list[Request] = []
        copies: list[BlockCopy] = []  # divergent block reuse of the hits taken this step

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
            lookahead = num_spec_tokens if num_new >= num_pending else 0
            while True:
                allocation = allocate_slots(request, num_new, None, lookahead)
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
                request.request_id, start, num_new, tuple(drafts),
                allocation.new_block_ids, False, 0,
                # does this step compute the last real token? (see `_samples`)
                start + num_new - num_drafts >= num_tokens,
            ))
            budget -= num_new
            index += 1

        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                # a waiting request has nothing computed (new, or preempted: reset to 0)
                assert request.num_computed_tokens == 0
                hit = self.manager.get_computed_blocks(request)
                if hit.copy_next_step and scheduled:
                    # its divergent block is computed in this step: admitted next step, it
                    # copies it (and the queue keeps its order)
                    break
                num_hit = hit.num_computed_tokens
                num_external = (self.connector.num_external_tokens(request, num_hit)
                                if self.connector is not None else 0)
                num_pending = request.num_tokens - num_hit - num_external
                num_new = min(num_pending, budget)
                lookahead = self.num_spec_tokens if num_new == num_pending else 0
                allocation = self.manager.allocate_slots(request, num_new, hit, lookahead,
                                                         num_external)
                if allocation is None:
                    break  # no room: it waits (and everything behind it) for a finish
                self.waiting.popleft()
                copies.extend(allocation.copies)
                self.stats.record_admission(request.request_id, request.num_tokens, num_hit,
                                            request.num_preemptions > 0)
                if self.connector is not None:
                    self.connector.after_alloc(request, allocation.new_block_ids[0], num_hit,
                                               num_external)
                if request.num_preemptions == 0:  # first schedule (only preemption re-queues)
                    request.num_cached_tokens = num_hit + num_external
                    request.num_external_cached_tokens = num_external
                if request.request_id not in self._seen_ids:
                    self._seen_ids.add(request.request_id)
                    new_requests.append(request.new_request_data())
                request.status = RequestStatus.RUNNING
                request.num_computed_tokens = num_hit + num_external + num_new
                self.running.append(request)
                scheduled.append(ScheduledRequest(
                    request.request_id, num_hit + num_external, num_new, (),
                    allocation.new_block_ids, True, num_hit, self._samples(request),
                    num_external,
                ))
                budget -= num_new

        if not scheduled:
            self._fail_unschedulable()
        finished_ids = frozenset(self._finished_ids)
        self._finished_ids.clear()
        meta = (self.connector.build_metadata(scheduled, self.requests)
                if self.connector is not None else None)
        return SchedulerOutput(
            new_requests, scheduled, finished_ids,
            frozenset(request.request_id for request in preempted),
            self.max_num_batched_tokens - budget, meta, tuple(copies),
        )

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
        if self.running or not self.waiting:
            return
        request = self.waiting[0]
        capacity = (self.manager.pool.num_blocks - 1) * self.manager.hash_block_size
        error = (
            f"{request.num_tokens} tokens no longer fit in the KV cache (it holds {capacity} "
            "tokens in all); raise the KV cache size or lower max_tokens"
        )
        self._finish(request, FinishReason.ERROR)
        self._outputs.append(EngineCoreOutput(
            request.request_id, [], FinishReason.ERROR, request.num_cached_tokens,
            num_preemptions=request.num_preemptions, error=error,
            num_external_cached_tokens=request.num_external_cached_tokens,
        ))

    # ---- one step: what it produced ----------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Apply one step's sampled tokens and drafts; finish what stopped. Mutates."""
        outputs, self._outputs = self._outputs, []
        connector_output = runner_output.kv_connector_output
        if connector_output is not None:
            for request_id in connector_output.finished_sending:
                held = self._sending.pop(request_id, None)
                if held is not None:
                    self.manager.free(held)
        if connector_output is not None and connector_output.load_failures:
            # first, so nothing below caches or stores a block whose load failed
            items = {item.request_id: item for item in scheduler_output.scheduled}
            for failure in connector_output.load_failures:
                request = self.requests.get(failure.request_id)
                if request is not None:  # nothing past the failed token is computed
                    apply_load_failure(request, items[failure.request_id], failure)
                if request is not None and failure.fatal:
                    self._finish(request, FinishReason.ERROR)
                    outputs.append(EngineCoreOutput(
                        request.request_id, [], FinishReason.ERROR, request.num_cached_tokens,
                        num_preemptions=request.num_preemptions,
                        error=f"the KV transfer failed: {failure.reason}"))
        sampled_by_id = runner_output.sampled_token_ids
        drafts_by_id = runner_output.draft_token_ids
        requests = self.requests
        record_verification = self.stats.record_verification
        for item in scheduler_output.scheduled:
            request_id = item.request_id
            sampled = sampled_by_id.get(request_id)
            if sampled is None:
                continue  # a prefill chunk that does not sample yet
            request = requests.get(request_id)
            if request is None:
                continue
            # the runner already cut `sampled` at the first stop; this names the reason
            num_kept, reason = first_stop(
                sampled, len(request.all_token_ids), request.num_prompt_tokens,
                request.stop_limits
            )
            sampled = sampled[:num_kept]
            num_drafts = len(item.draft_token_ids)
            request.apply_verification(num_drafts, sampled)
            num_accepted = len(sampled) - 1
            if num_drafts:
                record_verification(num_drafts, num_accepted)
            if reason is None:
                next_drafts = drafts_by_id.get(request_id)
                request.spec_token_ids = list(next_drafts) if next_drafts else []
            else:
                self._finish(request, reason)
            outputs.append(EngineCoreOutput(
                request_id, sampled, reason, request.num_cached_tokens, num_drafts,
                num_accepted, request.num_preemptions, None,
                request.num_external_cached_tokens,
                kv_transfer_params=request.kv_transfer_params_out,
            ))
        # the runner has copied this step's copy sources and written its blocks' KV
        self.manager.step_executed()
        return outputs

    def take_stats(self) -> SchedulerStats:
        """The statistics of the steps since the last call (occupancy as of now)."""
        pool = self.manager.pool
        return self.stats.take(len(self.running), len(self.waiting),
                               self.manager.get_num_free_blocks(), pool.num_blocks - 1)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        """Every way out of the scheduler ends here: out of the queues, blocks released
        (cached first unless aborted), the runner told at the next step."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        decision = self.connector.finished(request) if self.connector is not None else None
        if decision is not None:
            request.kv_transfer_params_out = decision.kv_transfer_params
        if decision is not None and decision.delay_free:
            if reason is not FinishReason.ABORT:
                self.manager.cache_computed_blocks(request)
            self._sending[request.request_id] = request  # freed at its finished_sending
        elif reason is FinishReason.ABORT:
            self.manager.free(request)
        else:
            self.manager.finish(request)
        request.status = RequestStatus.finished(reason)
        del self.requests[request.request_id]
        if request.request_id in self._seen_ids:
            self._seen_ids.discard(request.request_id)
            self._finished_ids.add(request.request_id)
