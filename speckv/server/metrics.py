"""Prometheus metrics under vLLM's names, so existing vLLM dashboards work unchanged.

Owns one `CollectorRegistry` per server (tests run several servers in one process) and the
`LoopObserver` that fills it from the engine loop thread:

    engine stats (`SchedulerStats`, one per step)
        vllm:prefix_cache_queries / vllm:prefix_cache_hits   prompt tokens looked up / found
        vllm:external_prefix_cache_queries / _hits   the same under a KV connector: prompt
            tokens of requests admitted with one / tokens it loaded (a tier or P/D transfer)
        vllm:num_preemptions, vllm:num_requests_running / _waiting, vllm:kv_cache_usage_perc
        vllm:spec_decode_num_drafts / _num_draft_tokens / _num_accepted_tokens
        vllm:spec_decode_num_accepted_tokens_per_pos {position}
    request outputs (timed at the step that produced them)
        vllm:prompt_tokens, vllm:generation_tokens, vllm:request_success {finished_reason}
        vllm:time_to_first_token_seconds, vllm:inter_token_latency_seconds,
        vllm:e2e_request_latency_seconds, vllm:request_queue_time_seconds
    ours
        speckv:hash_mode_info {hash_mode, reason} = 1, speckv:lookahead_tokens (L, 0 when
        off), speckv:legacy_block_drop (1 while the last matched block is dropped)
    the adaptive draft length (`LLMEngine.spec_decode_stats`, read at each scrape)
        speckv:spec_decode_steps_by_num_spec_tokens {num_spec_tokens}: decode steps that
        drafted k tokens; speckv:spec_decode_num_spec_tokens: the current choice;
        speckv:spec_decode_predicted_speedup: its predicted tokens/s over no drafts
    the KV budget (`LLMEngine.kv_budget`, set at start)
        speckv:kv_cache_group_blocks / speckv:kv_cache_group_bytes {group, kind}: each KV cache
        group's rows (null block included) and bytes; speckv:kv_cache_per_group_pools (1: a
        pool per group, 0: one shared); speckv:kv_cache_context_tokens: the longest context
        one request can hold

Labels `model_name` and `engine` as vLLM sets them; buckets are vLLM's. Counters are exposed
with prometheus_client's `_total` suffix, as vLLM's are. Times run from the HTTP arrival.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from speckv.cache.hash_mode import HashMode
from speckv.engine.kv_budget import KVBudget
from speckv.engine.outputs import RequestOutput
from speckv.engine.stats import SchedulerStats
from speckv.server.engine_loop import EngineRequest
from speckv.speculation.adaptive import SpeculationReport

__all__ = ["CONTENT_TYPE", "ServerMetrics"]

FINISH_REASONS = ("stop", "length", "abort")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass(frozen=True)
class _Metric:
    kind: type[Counter] | type[Gauge] | type[Histogram]
    name: str  # vLLM's name
    doc: str  # vLLM's help text
    buckets: tuple[float, ...] = ()  # histograms only


# ServerMetrics attribute -> metric; each carries the `model_name` and `engine` labels
_LABELLED_METRICS: dict[str, _Metric] = {
    "running": _Metric(
        Gauge, "vllm:num_requests_running", "Number of requests in model execution batches."),
    "waiting": _Metric(
        Gauge, "vllm:num_requests_waiting", "Number of requests waiting to be processed."),
    "kv_usage": _Metric(
        Gauge, "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    "queries": _Metric(
        Counter, "vllm:prefix_cache_queries",
        "Prefix cache queries, in terms of number of queried tokens."),
    "hits": _Metric(
        Counter, "vllm:prefix_cache_hits",
        "Prefix cache hits, in terms of number of cached tokens."),
    "external_queries": _Metric(
        Counter, "vllm:external_prefix_cache_queries",
        "External prefix cache queries from KV connector cross-instance cache sharing, in "
        "terms of number of queried tokens."),
    "external_hits": _Metric(
        Counter, "vllm:external_prefix_cache_hits",
        "External prefix cache hits from KV connector cross-instance cache sharing, in terms "
        "of number of cached tokens."),
    "preemptions": _Metric(
        Counter, "vllm:num_preemptions", "Cumulative number of preemption from the engine."),
    "prompt_tokens": _Metric(
        Counter, "vllm:prompt_tokens", "Number of prefill tokens processed."),
    "generation_tokens": _Metric(
        Counter, "vllm:generation_tokens", "Number of generation tokens processed."),
    "ttft": _Metric(
        Histogram, "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.", TTFT_BUCKETS),
    "itl": _Metric(
        Histogram, "vllm:inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    "e2e": _Metric(
        Histogram, "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS),
    "queue_time": _Metric(
        Histogram, "vllm:request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS),
    "num_drafts": _Metric(
        Counter, "vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
    "num_draft_tokens": _Metric(
        Counter, "vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
    "num_accepted": _Metric(
        Counter, "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
    "lookahead_tokens": _Metric(
        Gauge, "speckv:lookahead_tokens",
        "L: successor tokens hashed into each block hash (0: legacy hashes)."),
    "legacy_block_drop": _Metric(
        Gauge, "speckv:legacy_block_drop",
        "1 while the legacy last-block drop is on (hits lose their last matched block), else 0."),
}


@dataclass
class _Timing:
    arrival_s: float
    num_prompt_tokens: int
    last_token_s: float | None = None


class ServerMetrics:
    """One server's metrics: the `_LABELLED_METRICS` keys are its attributes (`self.ttft`, ...),
    plus `success` per finish reason and `accepted_per_pos` per draft position."""

    def __init__(self, model_name: str, hash_mode: HashMode, num_spec_tokens: int,
                 engine_index: int = 0,
                 spec_stats: Callable[[], SpeculationReport | None] | None = None,
                 kv_budget: KVBudget | None = None) -> None:
        """`spec_stats`: the engine's `spec_decode_stats` (None: no draft-length gauges);
        `kv_budget`: the engine's blocks and bytes per KV cache group (None: no gauges)."""
        disable_created_metrics()  # vLLM exposes no *_created series either
        self.registry = CollectorRegistry()
        labels = ["model_name", "engine"]
        values = (model_name, str(engine_index))
        r = self.registry

        for attr, m in _LABELLED_METRICS.items():
            extra = {"buckets": m.buckets} if m.buckets else {}
            setattr(self, attr, m.kind(m.name, m.doc, labels, registry=r, **extra).labels(*values))
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          [*labels, "finished_reason"], registry=r)
        self.success = {reason: success.labels(*values, reason) for reason in FINISH_REASONS}
        per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per "
                          "draft position.", [*labels, "position"], registry=r)
        self.accepted_per_pos = [per_pos.labels(*values, str(p)) for p in range(num_spec_tokens)]
        info = Gauge("speckv:hash_mode_info", "Block-hash mode in force (lookahead L, or legacy "
                     "hashes with or without the last-block drop); the value is always 1.",
                     [*labels, "hash_mode", "reason"], registry=r)
        info.labels(*values, hash_mode.label, hash_mode.reason).set(1)
        self.lookahead_tokens.set(hash_mode.lookahead_tokens)
        self.legacy_block_drop.set(int(hash_mode.drops_last_unit))
        if kv_budget is not None:
            self._set_kv_budget(kv_budget, labels, values)
        self._timings: dict[str, _Timing] = {}
        self._spec_stats = spec_stats if num_spec_tokens else None
        if self._spec_stats is not None:
            by_k = Gauge("speckv:spec_decode_steps_by_num_spec_tokens", "Decode steps that "
                         "drafted k tokens (the adaptive draft length's choices).",
                         [*labels, "num_spec_tokens"], registry=r)
            self.steps_by_k = [by_k.labels(*values, str(k)) for k in range(num_spec_tokens + 1)]
            self.current_k = Gauge("speckv:spec_decode_num_spec_tokens", "Drafts per request "
                                   "the adaptive policy chooses now.", labels,
                                   registry=r).labels(*values)
            self.predicted_speedup = Gauge(
                "speckv:spec_decode_predicted_speedup", "Predicted tokens/s of the current "
                "draft length over no drafts (0 until predicted).", labels,
                registry=r).labels(*values)

    def _set_kv_budget(self, budget: KVBudget, labels: list[str], values: tuple[str, ...]
                       ) -> None:
        r = self.registry
        blocks = Gauge("speckv:kv_cache_group_blocks", "KV blocks (rows) of each KV cache "
                       "group, the null block included.", [*labels, "group", "kind"], registry=r)
        nbytes = Gauge("speckv:kv_cache_group_bytes", "Bytes of each KV cache group's "
                       "tensors.", [*labels, "group", "kind"], registry=r)
        for index, group in enumerate(budget.groups):
            blocks.labels(*values, str(index), group.kind).set(group.num_blocks)
            nbytes.labels(*values, str(index), group.kind).set(group.nbytes)
        Gauge("speckv:kv_cache_per_group_pools", "1: each KV cache group has a pool of its "
              "own; 0: one pool shared by every group.", labels,
              registry=r).labels(*values).set(int(budget.per_group_pools))
        Gauge("speckv:kv_cache_context_tokens", "The longest context (prompt + output) one "
              "request can hold in the KV budget.", labels,
              registry=r).labels(*values).set(budget.context_tokens)

    def render(self) -> bytes:
        if self._spec_stats is not None:
            stats = self._spec_stats()  # tuples and floats the engine thread replaces whole
            if stats is not None:
                for gauge, steps in zip(self.steps_by_k, stats.steps_by_num_spec_tokens):
                    gauge.set(steps)
                self.current_k.set(stats.last_num_spec_tokens)
                self.predicted_speedup.set(stats.predicted_speedup or 0.0)
        return generate_latest(self.registry)

    # ---- LoopObserver (engine loop thread) -----------------------------------------------------
    def request_added(self, request: EngineRequest) -> None:
        self._timings[request.request_id] = _Timing(request.arrival_s,
                                                    len(request.prompt_token_ids))

    def step_done(self, stats: SchedulerStats | None, outputs: list[RequestOutput],
                  start_s: float, end_s: float) -> None:
        if stats is not None:
            self._record_stats(stats, start_s)
        for output in outputs:
            self._record_output(output, end_s)

    def request_aborted(self, output: RequestOutput, now_s: float) -> None:
        self._record_output(output, now_s)

    def engine_idle(self) -> None:
        self.running.set(0)
        self.waiting.set(0)
        self.kv_usage.set(0)

    def _record_stats(self, stats: SchedulerStats, start_s: float) -> None:
        self.running.set(stats.num_running_reqs)
        self.waiting.set(stats.num_waiting_reqs)
        self.kv_usage.set(stats.kv_cache_usage)
        self.queries.inc(stats.prefix_cache.num_query_tokens)
        self.hits.inc(stats.prefix_cache.num_hit_tokens)
        self.external_queries.inc(stats.num_external_query_tokens)
        self.external_hits.inc(stats.num_external_hit_tokens)
        self.preemptions.inc(stats.num_preemptions)
        for request_id in stats.newly_admitted_request_ids:
            timing = self._timings.get(request_id)
            if timing is not None:  # admitted at the start of the step
                self.queue_time.observe(max(0.0, start_s - timing.arrival_s))
        spec = stats.spec_decoding
        if spec is not None:
            self.num_drafts.inc(spec.num_drafts)
            self.num_draft_tokens.inc(spec.num_draft_tokens)
            self.num_accepted.inc(spec.num_accepted_tokens)
            for counter, count in zip(self.accepted_per_pos, spec.num_accepted_tokens_per_pos):
                counter.inc(count)

    def _record_output(self, output: RequestOutput, now_s: float) -> None:
        timing = self._timings.get(output.request_id)
        if timing is None:
            return
        if output.delta_token_ids:
            self.generation_tokens.inc(len(output.delta_token_ids))
            if timing.last_token_s is None:
                self.prompt_tokens.inc(timing.num_prompt_tokens)
                self.ttft.observe(now_s - timing.arrival_s)
            else:
                self.itl.observe(now_s - timing.last_token_s)
            timing.last_token_s = now_s
        if output.finished:
            del self._timings[output.request_id]
            self.e2e.observe(now_s - timing.arrival_s)
            reason = output.finish_reason if output.finish_reason in self.success else "abort"
            self.success[reason].inc()
