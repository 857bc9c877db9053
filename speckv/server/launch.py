"""Running a server: on a socket bound up front (the CLI), or in a background thread (tests,
the demo, `speckv bench serve`).

Owns binding the listening socket before uvicorn starts (a busy port is a one-line user error,
not a traceback) and `ServerThread`: uvicorn on a free loopback port in a daemon thread, with
`url`, `stop()` and a context manager. The engine loop starts with the app (lifespan) and stops
with it.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import uvicorn

from speckv.events.endpoints import LOOPBACK
from speckv.server.app import OpenAIServer


def bind_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on host:port (port 0: any free one), or a ValueError."""
    if not 0 <= port < 65536:
        raise ValueError(f"--port must be in 0..65535, got {port}")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio turns Nagle off only on sockets that say TCP, and
    # without that a response's body waits for the client's delayed ACK of its headers (40 ms)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as error:
        sock.close()
        raise ValueError(f"cannot listen on {host}:{port}: {error.strerror}") from None
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _uvicorn(server: OpenAIServer, log_level: str) -> uvicorn.Server:
    config = uvicorn.Config(server.app, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


def serve_forever(server: OpenAIServer, sock: socket.socket,
                  log_level: str = "warning") -> None:
    """Serve on the listening `sock` (from `bind_socket`) until SIGINT / SIGTERM (the CLI);
    returns after a graceful shutdown and closes the socket."""
    try:
        _uvicorn(server, log_level).run(sockets=[sock])
    except KeyboardInterrupt:  # uvicorn re-raises the SIGINT it shut down on: a normal exit
        pass
    finally:
        sock.close()


class ServerThread:
    """`server` on a free loopback port in a background thread."""

    def __init__(self, server: OpenAIServer, host: str = LOOPBACK, port: int = 0,
                 log_level: str = "warning", start_timeout_s: float = 60.0) -> None:
        self.server = server
        self._sock = bind_socket(host, port)
        self.host, self.port = self._sock.getsockname()[:2]
        self._uvicorn = _uvicorn(server, log_level)
        self._start_timeout_s = start_timeout_s
        self._thread = threading.Thread(target=self._run, name="speckv-http", daemon=True)
        self._failure: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + self._start_timeout_s
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the HTTP server did not start: {self._failure!r}")
            time.sleep(0.01)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        self._uvicorn.should_exit = True
        self._thread.join(timeout_s)
        self._sock.close()

    def _run(self) -> None:
        try:
            asyncio.run(self._uvicorn.serve(sockets=[self._sock]))
        except BaseException as error:
            self._failure = error
            raise

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
