"""The router's Prometheus metrics (its own registry; label `engine` = the router's name).

    speckv_router:requests {engine, reason}             requests sent, by decision reason
    speckv_router:retries {engine}                      requests retried elsewhere after it failed
    speckv_router:upstream_errors {engine}              connection failures and 5xx answers
    speckv_router:stream_errors {engine}                streams that broke mid-way
    speckv_router:predicted_cached_tokens {engine}      the router's prediction, summed over the
    speckv_router:reported_cached_tokens {engine}       requests whose answer reported
                                                        usage.prompt_tokens_details.cached_tokens
    speckv_router:prediction_checks {engine}            such requests
    speckv_router:prediction_mismatches {engine}        of those, prediction != report
    speckv_router:prompt_token_mismatches {engine}      usage.prompt_tokens != the router's count
    read at scrape time from the fleet:
    speckv_router:engine_healthy {engine}               1 in rotation, 0 out
    speckv_router:index_blocks {engine}                 blocks the index holds for the engine
    speckv_router:pending_blocks {engine}               routed blocks awaiting their events
    speckv_router:inflight_requests {engine}
    speckv_router:events_applied {engine}               events applied to the index
    speckv_router:event_apply_errors {engine}           batches that failed to apply
    speckv_router:event_seq_gaps {engine}               gaps in sequence numbers seen live
    speckv_router:event_replays {engine}                replay requests sent
    speckv_router:event_replayed_batches / _lost_batches / _malformed_messages /
    speckv_router:event_duplicate_batches {engine}
    speckv_router:hash_mismatched_blocks {engine}       published hashes the router's recompute
                                                        disagrees with
    speckv_router:epochs {engine}                       engine epochs seen (1 + restarts)
    speckv_router:index_resets {engine}                 restarts and expiries
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from speckv.router.fleet import Fleet
from speckv.router.prometheus import PREFIX, RouterRegistry


class _FleetCollector(Collector):
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        state = self.fleet.state()

        def family(kind, name: str, doc: str, values: dict[str, float]):
            metric = kind(PREFIX + name, doc, labels=["engine"])
            for engine, value in values.items():
                metric.add_metric([engine], value)
            return metric

        def each(getter) -> dict[str, float]:
            return {engine: float(getter(s)) for engine, s in state.items()}

        gauge, counter = GaugeMetricFamily, CounterMetricFamily
        yield family(gauge, "engine_healthy", "1 while the engine is in rotation.",
                     each(lambda s: s["healthy"] and s["refused"] is None))
        yield family(gauge, "index_blocks", "Blocks the index holds for the engine.",
                     each(lambda s: s["index"]["cached_blocks"]))
        yield family(gauge, "pending_blocks", "Routed blocks awaiting their KV events.",
                     each(lambda s: s["index"]["pending_blocks"]))
        yield family(gauge, "inflight_requests", "Requests in flight through the router.",
                     each(lambda s: s["inflight"]))
        yield family(counter, "events_applied", "KV events applied to the index.",
                     each(lambda s: s["events_applied"]))
        yield family(counter, "event_apply_errors", "KV event batches that failed to apply.",
                     each(lambda s: s["apply_errors"]))
        for key, name, doc in (
                ("seq_gaps", "event_seq_gaps", "Gaps in KV-event sequence numbers seen live."),
                ("replay_requests", "event_replays", "Replay requests sent to the engine."),
                ("replayed_batches", "event_replayed_batches", "Batches recovered by replay."),
                ("lost_batches", "event_lost_batches", "Batches missing and not recoverable."),
                ("malformed_messages", "event_malformed_messages",
                 "Event messages with bad frames or payloads, skipped."),
                ("duplicate_batches", "event_duplicate_batches",
                 "Batches already delivered or out of order, skipped.")):
            yield family(counter, name, doc, each(lambda s, key=key: s["subscriber"][key]))
        yield family(counter, "hash_mismatched_blocks",
                     "Published block hashes the router's recomputation disagrees with.",
                     each(lambda s: s["index"]["mismatched_blocks"]))
        yield family(counter, "epochs", "Engine epochs seen (1 + restarts).",
                     each(lambda s: s["epochs_seen"]))
        yield family(counter, "index_resets", "Index resets (restarts, expiries).",
                     each(lambda s: s["index_resets"]))


class RouterMetrics(RouterRegistry):
    def __init__(self, fleet: Fleet) -> None:
        super().__init__()
        counter = self.counter
        self.requests = counter("requests", "Requests sent to an engine, by decision reason.",
                                ("engine", "reason"))
        self.retries = counter("retries", "Requests retried elsewhere after this engine "
                               "failed before answering.")
        self.upstream_errors = counter("upstream_errors", "Connection failures and 5xx "
                                       "answers from the engine.")
        self.stream_errors = counter("stream_errors", "Streams that broke mid-way (ended "
                                     "with an error chunk).")
        self.predicted = counter("predicted_cached_tokens", "Cached tokens the router "
                                 "predicted, over requests with a usage report.")
        self.reported = counter("reported_cached_tokens", "usage.prompt_tokens_details."
                                "cached_tokens the engine reported.")
        self.checks = counter("prediction_checks", "Requests whose answer reported cached "
                              "tokens.")
        self.mismatches = counter("prediction_mismatches", "Requests whose reported cached "
                                  "tokens differ from the prediction.")
        self.prompt_mismatches = counter("prompt_token_mismatches", "Requests whose "
                                         "usage.prompt_tokens differ from the router's count.")
        self.registry.register(_FleetCollector(fleet))

    def report(self, engine: str, predicted: int, usage: object, num_prompt_tokens: int
               ) -> None:
        """Compare a response's `usage` with the prediction (no usage: nothing to compare)."""
        if not isinstance(usage, dict):
            return
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if not isinstance(cached, int):
            return
        self.predicted.labels(engine).inc(predicted)
        self.reported.labels(engine).inc(cached)
        self.checks.labels(engine).inc()
        if cached != predicted:
            self.mismatches.labels(engine).inc()
        if usage.get("prompt_tokens") != num_prompt_tokens:
            self.prompt_mismatches.labels(engine).inc()
