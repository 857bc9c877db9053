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

from speckv.router.prometheus import RouterRegistry


class PDMetrics(RouterRegistry):
    def __init__(self) -> None:
        super().__init__()
        counter = self.counter
        self.requests = counter("requests", "Requests answered by a decode engine, by "
                                "whether the prefill engine's KV was transferred.",
                                ("engine", "reason"))
        self.prefill_requests = counter("prefill_requests", "Requests sent to a prefill "
                                        "engine.")
        self.prefill_failures = counter("prefill_failures", "Prefill requests that failed or "
                                        "came back without kv_transfer_params.")
        self.upstream_errors = counter("upstream_errors", "Decode engine connection failures "
                                       "and 5xx answers.")
