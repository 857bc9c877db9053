"""Loopback port probes shared by the events CLI, the benchmark and the tests."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def port_is_free(host: str, port: int) -> bool:
    """Whether a TCP socket can bind `host:port` now (in use, or not a local address: False)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port the OS reports free on `host` (it may be taken again before it is used)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def loopback_endpoint() -> str:
    """A ZeroMQ TCP endpoint on a free loopback port."""
    return f"tcp://{LOOPBACK}:{free_port()}"
