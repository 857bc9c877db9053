"""Helpers shared by the KV-event tests (imported by module name: tests are not a package)."""

from __future__ import annotations

import time

from speckv.events.schema import KVEventBatch
from speckv.events.subscriber import EventSubscriber


def collect(
    subscriber: EventSubscriber, count: int, timeout_s: float = 5.0
) -> list[tuple[int, KVEventBatch]]:
    """Poll until `count` batches arrived or the timeout passed."""
    got: list[tuple[int, KVEventBatch]] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got.extend(subscriber.poll(0.1))
    return got


def wait_subscribed() -> None:
    """PUB/SUB slow joiner: give a new subscription time to reach the publisher (there is no
    probe batch to wait for: empty steps are never published)."""
    time.sleep(0.2)
