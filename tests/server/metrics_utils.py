"""Reading a server's /metrics in tests (imported by module name: tests are not a package)."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of GET /metrics: (name, sorted labels) -> value."""
    response = httpx.get(f"{base_url}/metrics", timeout=30)
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name: str, **labels: str) -> float:
    """The sample `name` with `labels` (model_name / engine are matched loosely: any)."""
    found = [v for (n, ls), v in samples.items()
             if n == name and all(dict(ls).get(k) == want for k, want in labels.items())]
    assert len(found) == 1, f"{name} {labels}: {len(found)} samples"
    return found[0]
