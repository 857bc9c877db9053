"""Shared fixtures for the KV-event tests: free loopback endpoints, publishers, subscribers."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from speckv.events.endpoints import loopback_endpoint
from speckv.events.publisher import PublisherConfig, ZmqEventPublisher


@pytest.fixture
def endpoints() -> tuple[str, str]:
    """A (PUB, replay) pair of free loopback endpoints."""
    return loopback_endpoint(), loopback_endpoint()


@pytest.fixture
def make_publisher() -> Iterator[Callable[..., ZmqEventPublisher]]:
    made: list[ZmqEventPublisher] = []

    def make(**kwargs) -> ZmqEventPublisher:
        publisher = ZmqEventPublisher(PublisherConfig(**kwargs))
        made.append(publisher)
        return publisher

    yield make
    for publisher in made:
        publisher.shutdown()
