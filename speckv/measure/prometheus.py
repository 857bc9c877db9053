"""Reading a server's `/metrics` page: Prometheus text into totals per sample name.

Owns `metric_totals`, what the demo's server step and the serve / route benches read hit and
acceptance counters with.
"""

from __future__ import annotations


def metric_totals(text: str) -> dict[str, float]:
    """Sample name -> value summed over label sets, from Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals
