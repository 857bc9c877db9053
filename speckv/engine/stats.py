"""Per-step engine statistics: what a metrics exporter needs from inside the engine.

Owns the typed record `SchedulerStats` (one per `LLMEngine.step`, read as
`LLMEngine.last_stats`) and `StatsCollector`, the mutable tally the scheduler and the engine fill
during a step. Everything that can be seen from the outside (`RequestOutput` deltas: tokens,
timings, finish reasons) is *not* here; only what the engine alone knows:

    prefix cache   prompt tokens looked up and found, counted once per request at its first
                   admission (a preempted request's re-lookup is counted apart, as vLLM does,
                   so a victim re-hitting its own blocks does not inflate the hit rate)
    preemptions    requests preempted in the step
    spec decoding  verification steps with drafts, drafted / accepted tokens, and accepted
                   tokens per draft position (accepted drafts are a prefix, so position i is
                   accepted iff more than i drafts were)
    occupancy      running / waiting requests and the KV blocks in use after the step
    admissions     ids first admitted in the step (a server stamps their queue time)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefixCacheStats:
    num_requests: int = 0  # first admissions in the step
    num_query_tokens: int = 0  # their prompt tokens (real tokens at admission), tokens
    num_hit_tokens: int = 0  # tokens served by the prefix cache, tokens
    num_preempted_requests: int = 0  # re-admissions after preemption (counted apart)
    num_preempted_query_tokens: int = 0
    num_preempted_hit_tokens: int = 0


@dataclass(frozen=True)
class SpecDecodingStats:
    """One step's drafts and acceptances (vLLM's per-step spec-decoding stats); the engine's
    lifetime figures and the adaptive policy's belief are `SpeculationReport`."""

    num_drafts: int  # verification steps that had at least one draft
    num_draft_tokens: int  # drafts verified, tokens
    num_accepted_tokens: int  # drafts accepted (kept in the output), tokens
    num_accepted_tokens_per_pos: tuple[int, ...]  # [num_spec_tokens]: accepted at position i


@dataclass(frozen=True)
class SchedulerStats:
    num_running_reqs: int  # after the step
    num_waiting_reqs: int  # after the step
    num_used_blocks: int  # KV blocks held by requests after the step (null block excluded)
    num_usable_blocks: int  # KV blocks requests can use (all but the null block)
    num_preemptions: int  # in the step
    prefix_cache: PrefixCacheStats
    spec_decoding: SpecDecodingStats | None  # None: speculative decoding is off
    newly_admitted_request_ids: tuple[str, ...]  # first admission in the step
    # first admissions under a KV connector (tiers, P/D transfer): their prompt tokens, and
    # those the connector loaded (vLLM's external prefix cache queries / hits), tokens
    num_external_query_tokens: int = 0
    num_external_hit_tokens: int = 0

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of usable KV blocks held by requests, 0..1 (vLLM's kv_cache_usage_perc)."""
        return self.num_used_blocks / self.num_usable_blocks if self.num_usable_blocks else 0.0


class StatsCollector:
    """The step's running tally; `take` turns it into a `SchedulerStats` and starts over."""

    def __init__(self, num_spec_tokens: int = 0) -> None:
        self.num_spec_tokens = num_spec_tokens
        self._reset()

    def _reset(self) -> None:
        self._prefix = [0, 0, 0, 0, 0, 0]
        self._num_preemptions = 0
        self._num_drafts = 0
        self._num_draft_tokens = 0
        self._num_accepted_tokens = 0
        self._per_pos = [0] * self.num_spec_tokens
        self._admitted: list[str] = []
        self._external = [0, 0]  # query tokens, hit tokens

    # ---- filled during a step ------------------------------------------------------------------
    def record_admission(self, request_id: str, num_query_tokens: int, num_hit_tokens: int,
                         preempted: bool, num_external_tokens: int | None = None) -> None:
        """A waiting request was admitted with a prefix-cache hit of `num_hit_tokens`, and
        `num_external_tokens` a KV connector loads (None: the engine has no connector)."""
        offset = 3 if preempted else 0
        self._prefix[offset] += 1
        self._prefix[offset + 1] += num_query_tokens
        self._prefix[offset + 2] += num_hit_tokens
        if not preempted:
            self._admitted.append(request_id)
            if num_external_tokens is not None:
                self._external[0] += num_query_tokens
                self._external[1] += num_external_tokens

    def record_preemption(self) -> None:
        self._num_preemptions += 1

    def record_verification(self, num_drafts: int, num_accepted: int) -> None:
        """One request's drafts verified in the step: `num_accepted` of `num_drafts` kept."""
        if num_drafts <= 0:
            return
        if not 0 <= num_accepted <= num_drafts:
            raise ValueError(f"{num_accepted} drafts accepted of {num_drafts}")
        self._num_drafts += 1
        self._num_draft_tokens += num_drafts
        self._num_accepted_tokens += num_accepted
        for position in range(min(num_accepted, len(self._per_pos))):
            self._per_pos[position] += 1

    def record_verifications(self, num_drafts: Sequence[int], num_accepted: Sequence[int]
                             ) -> None:
        """`record_verification` of the step's requests that verified drafts, at once:
        request i kept num_accepted[i] of num_drafts[i] (each >= 1)."""
        if len(num_drafts) != len(num_accepted):
            raise ValueError("num_drafts and num_accepted need one entry per request")
        for d, a in zip(num_drafts, num_accepted):
            if d <= 0 or not 0 <= a <= d:
                raise ValueError(f"{a} drafts accepted of {d}")
        self._num_drafts += len(num_drafts)
        self._num_draft_tokens += sum(num_drafts)
        self._num_accepted_tokens += sum(num_accepted)
        per_pos = self._per_pos
        if per_pos:
            # requests that accepted at least j + 1 drafts, per position j
            at_least = [0] * (len(per_pos) + 1)
            for a in num_accepted:
                at_least[min(a, len(per_pos))] += 1
            count = 0
            for position in range(len(per_pos) - 1, -1, -1):
                count += at_least[position + 1]
                per_pos[position] += count

    # ---- end of step ---------------------------------------------------------------------------
    def take(self, num_running_reqs: int, num_waiting_reqs: int, num_free_blocks: int,
             num_usable_blocks: int) -> SchedulerStats:
        spec = None
        if self.num_spec_tokens:
            spec = SpecDecodingStats(self._num_drafts, self._num_draft_tokens,
                                     self._num_accepted_tokens, tuple(self._per_pos))
        stats = SchedulerStats(
            num_running_reqs=num_running_reqs,
            num_waiting_reqs=num_waiting_reqs,
            num_used_blocks=num_usable_blocks - num_free_blocks,
            num_usable_blocks=num_usable_blocks,
            num_preemptions=self._num_preemptions,
            prefix_cache=PrefixCacheStats(*self._prefix),
            spec_decoding=spec,
            newly_admitted_request_ids=tuple(self._admitted),
            num_external_query_tokens=self._external[0],
            num_external_hit_tokens=self._external[1],
        )
        self._reset()
        return stats
