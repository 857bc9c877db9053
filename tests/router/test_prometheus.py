"""The routers' shared registry (`speckv.router.prometheus`), through the P/D router's metrics."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from speckv.router.pd_metrics import PDMetrics


def _samples(text: bytes) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text.decode())
            for s in family.samples}


def test_each_router_counts_in_its_own_registry_under_the_router_prefix():
    first, second = PDMetrics(), PDMetrics()  # a shared registry would refuse the second
    first.requests.labels("d0", "transferred").inc()
    first.prefill_requests.labels("p0").inc(2)
    samples = _samples(first.render())
    assert samples[("speckv_router:requests_total",
                    (("engine", "d0"), ("reason", "transferred")))] == 1
    assert samples[("speckv_router:prefill_requests_total", (("engine", "p0"),))] == 2
    assert not any(name.endswith("_created") for name, _ in samples)
    assert _samples(second.render()) == {}
