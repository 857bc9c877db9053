"""Shared fixtures for the KV-event tests: free loopback endpoints, publishers, subscribers."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator

import pytest

from speckv.events.publisher import PublisherConfig, ZmqEventPublisher


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def endpoints() -> tuple[str, str]:
    return f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"


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
