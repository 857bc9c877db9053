"""The benches' one wait for a server's health check (`speckv.bench.health`)."""

from __future__ import annotations

import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from speckv.bench.health import wait_healthy
from speckv.events.endpoints import free_port


class _WarmingUp(BaseHTTPRequestHandler):
    """/health answers 503 twice (a server still loading), then 200."""

    probes: list[str] = []

    def do_GET(self):  # http.server calls this name
        self.probes.append(self.path)
        self.send_response(503 if len(self.probes) <= 2 else 200)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_it_returns_once_health_answers_200():
    _WarmingUp.probes = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _WarmingUp)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        wait_healthy(url, None, 1800, "a server", poll_s=0.01)  # not a wall limit
    finally:
        server.shutdown()
        server.server_close()
    assert _WarmingUp.probes == ["/health"] * 3


def test_a_process_that_exits_first_is_named_with_its_detail():
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.wait()
    with pytest.raises(RuntimeError, match=r"^speckv serve exited with 3; log says why$"):
        wait_healthy(f"http://127.0.0.1:{free_port()}", process, 1800,  # not a wall limit
                     "speckv serve", exit_detail=lambda: "; log says why")


def test_a_server_that_never_answers_runs_out_the_callers_time():
    with pytest.raises(RuntimeError, match="vllm serve did not become healthy in 0 s"):
        wait_healthy(f"http://127.0.0.1:{free_port()}", None, 0.05,  # not a wall limit
                     "vllm serve", poll_s=0.01)
