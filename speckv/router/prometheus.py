"""The routers' own Prometheus registry: `speckv_router:` counters labelled by engine.

Owns what the prefix router's metrics (`metrics.py`) and the P/D router's (`pd_metrics.py`)
share: one registry of their own (no `_created` series), counters named with the one prefix,
and the scrape text.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, disable_created_metrics, generate_latest

PREFIX = "speckv_router:"


class RouterRegistry:
    """A router's metrics: `counter` adds one to its own registry; `render` is the scrape."""

    def __init__(self) -> None:
        disable_created_metrics()
        self.registry = CollectorRegistry()

    def counter(self, name: str, doc: str, labels: tuple[str, ...] = ("engine",)) -> Counter:
        """`speckv_router:<name>` with `labels` (the engine's name by default)."""
        return Counter(PREFIX + name, doc, list(labels), registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
