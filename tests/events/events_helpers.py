"""Helpers shared by the KV-event tests (imported by module name: tests are not a package)."""

from __future__ import annotations

import time

from speckv.events.publisher import ZmqEventPublisher
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


def wait_subscribed(publisher: ZmqEventPublisher, subscriber: EventSubscriber) -> None:
    """PUB/SUB slow joiner: publish nothing-batches is not allowed (empty steps are skipped),
    so just give the subscription time to reach the publisher."""
    time.sleep(0.2)
