"""Helpers shared by the KV-event tests (imported by module name: tests are not a package)."""

from __future__ import annotations

import time

from speckv.events.schema import KVEventBatch
from speckv.events.subscriber import EventSubscriber
from tests.patience import wait_until


def collect(
    subscriber: EventSubscriber, count: int, quiet_s: float | None = None
) -> list[tuple[int, KVEventBatch]]:
    """Poll until `count` batches arrived (bounded in CPU time, `tests.patience`: a batch that
    never comes fails the wait); with `quiet_s`, poll for that many seconds instead (a check
    that nothing comes)."""
    got: list[tuple[int, KVEventBatch]] = []
    if quiet_s is not None:
        until = time.monotonic() + quiet_s
        while len(got) < count and time.monotonic() < until:
            got.extend(subscriber.poll(0.1))
        return got

    def arrived() -> bool:
        got.extend(subscriber.poll(0.1))
        return len(got) >= count

    wait_until(arrived, f"{count} event batches arrive", poll_s=0)
    return got


def wait_subscribed() -> None:
    """PUB/SUB slow joiner: give a new subscription time to reach the publisher (there is no
    probe batch to wait for: empty steps are never published)."""
    time.sleep(0.2)
