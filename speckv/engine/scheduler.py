"""Scheduler: continuous batching over the KV cache manager, one step at a time.

Owns the waiting queue and the running list, and decides what runs in each step under a token
budget (`max_num_batched_tokens`) and a batch limit (`max_num_seqs`):

1. Running requests first, in arrival order: a decode takes `1 + len(drafts)` tokens, an
   unfinished prefill its next chunk. When `allocate_slots` finds no free blocks, the most
   recently added running request is preempted by recompute (its computed blocks cached, then
   freed; it goes back to the front of the queue) until the allocation fits.
2. Then waiting requests, unless a preemption happened this step: a prefix-cache hit (hit
   tokens skip their prefill and cost no budget; a preempted request re-hits what it had
   cached), then as much of the prompt as the budget allows (chunked prefill).
   `Request.num_cached_tokens` records the hit of the first schedule only.

The lifecycle follows `speckv.engine.cache_sim`: hit → allocate → (the caller computes) →
verify drafts → append real tokens → finish / preempt. `num_computed_tokens` is advanced here,
right after `allocate_slots` (hit + new tokens); `SchedulerOutput` records where each request's
new tokens start so the model runner knows which positions to compute.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from speckv.cache.kv_cache_manager import KVCacheManager
from speckv.engine.request import Request, RequestStatus
from speckv.engine.stats import StatsCollector  # [stats hook]


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    start: int  # first position computed this step
    num_new_tokens: int  # tokens computed this step, drafts included
    num_drafts: int  # drafts among them (the last ones)
    num_hit_tokens: int  # prefix-cache hit taken this step, tokens (0 unless from waiting)
    # True when this step reaches the request's last real token (its logits sample); fixed at
    # schedule time (the request's token count grows once the step's tokens are appended)
    samples: bool

    @property
    def end(self) -> int:
        """One past the last position computed this step."""
        return self.start + self.num_new_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]  # in batch order
    preempted: list[Request]  # preempted this step (they are waiting again)
    num_scheduled_tokens: int  # tokens computed this step, all requests

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self,
        manager: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        num_spec_tokens: int = 0,
    ) -> None:
        self.manager = manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.num_spec_tokens = num_spec_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.stats = StatsCollector(num_spec_tokens)  # [stats hook] filled during a step

    # ---- queue ---------------------------------------------------------------------------------
    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def remove(self, request: Request) -> None:
        """Take a request out of both queues (finish / abort); the caller frees its blocks."""
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted: list[Request] = []
        scheduled_ids: set[str] = set()

        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            num_pending = request.num_tokens - request.num_computed_tokens  # real tokens
            num_drafts = len(request.spec_token_ids)
            num_new = min(num_pending + num_drafts, budget)
            if num_new < num_pending + num_drafts:
                # the budget cuts the drafts (or the prefill chunk): drop what does not fit
                num_drafts = max(0, num_new - num_pending)
                request.spec_token_ids = request.spec_token_ids[:num_drafts]
            lookahead = self.num_spec_tokens if num_new >= num_pending else 0
            while True:
                allocation = self.manager.allocate_slots(request, num_new, None, lookahead)
                if allocation is not None:
                    break
                victim = self.running.pop()  # the most recently added running request
                self._preempt(victim)
                preempted.append(victim)
                if victim is request:
                    break
            if allocation is None:
                break  # preempted itself: everything after it is preempted too
            start = request.num_computed_tokens
            request.num_computed_tokens += num_new
            scheduled.append(
                ScheduledRequest(request, start, num_new, num_drafts, 0, self._samples(request))
            )
            scheduled_ids.add(request.request_id)
            budget -= num_new
            index += 1

        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                request = self.waiting[0]
                # a waiting request has nothing computed (new, or preempted: reset to 0)
                assert request.num_computed_tokens == 0
                hit = self.manager.get_computed_blocks(request)
                num_hit = hit.num_computed_tokens
                num_pending = request.num_tokens - num_hit
                num_new = min(num_pending, budget)
                lookahead = self.num_spec_tokens if num_new == num_pending else 0
                allocation = self.manager.allocate_slots(request, num_new, hit, lookahead)
                if allocation is None:
                    break  # no room: it waits (and everything behind it) for a finish
                self.waiting.popleft()
                self.stats.record_admission(  # [stats hook]
                    request.request_id, request.num_tokens, num_hit, request.num_preemptions > 0)
                if request.num_preemptions == 0:  # first schedule (only preemption re-queues)
                    request.num_cached_tokens = num_hit
                request.status = RequestStatus.RUNNING
                start = num_hit
                request.num_computed_tokens = start + num_new
                self.running.append(request)
                scheduled.append(
                    ScheduledRequest(request, start, num_new, 0, num_hit, self._samples(request))
                )
                budget -= num_new

        return SchedulerOutput(scheduled, preempted, self.max_num_batched_tokens - budget)

    @staticmethod
    def _samples(request: Request) -> bool:
        """After advancing num_computed_tokens: does this step compute the last real token?"""
        return request.num_computed_tokens - len(request.spec_token_ids) >= request.num_tokens

    def _preempt(self, request: Request) -> None:
        """Preemption by recompute: cache what is computed (a later hit recovers it), free."""
        self.manager.cache_computed_blocks(request)
        self.manager.free(request)
        self.stats.record_preemption()  # [stats hook]
        request.preempt()
        self.waiting.appendleft(request)
