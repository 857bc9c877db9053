"""Waiting for a benchmark's server process to answer its health check.

Owns the one loop every bench that starts servers (speckv serve, speckv router, vllm serve)
waits in: poll `GET /health` until it answers 200, failing at once, with the process's own
words, when the process exits first, and after the caller's limit otherwise.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

HEALTH_PATH = "/health"
PROBE_TIMEOUT_S = 2.0  # one probe: a server that is up answers well within it


def _no_detail() -> str:
    return ""


def wait_healthy(base_url: str, process: subprocess.Popen | None, timeout_s: float, name: str,
                 *, exit_detail: Callable[[], str] = _no_detail, poll_s: float = 0.5) -> None:
    """Return once `base_url` + /health answers 200. RuntimeError naming `name` when `process`
    (None: a server started elsewhere) exits first, with `exit_detail()` appended (its log's
    tail, say), or when `timeout_s` seconds pass; between probes, `poll_s` seconds."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process is not None and process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}{exit_detail()}")
        try:
            if httpx.get(base_url + HEALTH_PATH, timeout=PROBE_TIMEOUT_S).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(poll_s)
    raise RuntimeError(f"{name} did not become healthy in {timeout_s:.0f} s")
