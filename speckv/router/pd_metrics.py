"""The P/D router's own Prometheus metrics (its own registry; `engine` = the router's name for
a prefill or decode engine, `--prefill NAME=URL` / `--decode NAME=URL`).

    speckv_router:requests {engine, reason}      requests answered by decode engine `engine`:
                                                 reason "transferred" (the prefill engine's KV
                                                 was sent on) or "local_prefill" (it was not)
    speckv_router:prefill_requests {engine}      requests sent to prefill engine `engine`
    speckv_router:prefill_failures {engine}      of those, failed or answered without
                                                 kv_transfer_params (the decode engine prefilled)
    speckv_router:upstream_errors {engine}       decode engine connection failures and 5xx
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics, generate_latest

_PREFIX = "speckv_router:"


class PDMetrics:
    def __init__(self) -> None:
        disable_created_metrics()
        self.registry = r = CollectorRegistry()

        def counter(name: str, doc: str, labels: tuple[str, ...] = ("engine",)) -> Counter:
            return Counter(_PREFIX + name, doc, list(labels), registry=r)

        self.requests = counter("requests", "Requests answered by a decode engine, by "
                                "whether the prefill engine's KV was transferred.",
                                ("engine", "reason"))
        self.prefill_requests = counter("prefill_requests", "Requests sent to a prefill "
                                        "engine.")
        self.prefill_failures = counter("prefill_failures", "Prefill requests that failed or "
                                        "came back without kv_transfer_params.")
        self.upstream_errors = counter("upstream_errors", "Decode engine connection failures "
                                       "and 5xx answers.")

    def render(self) -> bytes:
        return generate_latest(self.registry)
