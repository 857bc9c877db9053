"""The decode side's bookkeeping of a transfer: the link to a prefill engine (`PeerLink`), one
request's pull under that engine's lease (`Pull`), a NIXL READ in flight (`ReadInFlight`), and
the thread that delivers control messages (releases, heartbeats) so that no step ever blocks on
a dead peer (`ControlSender`).
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Any

from speckv.connectors.metadata import RequestLoad
from speckv.connectors.nixl.layout_desc import KVLayoutDesc
from speckv.connectors.nixl.params import KVTransferParams
from speckv.connectors.nixl.side_channel import SideChannelClient, SideChannelError
from speckv.connectors.nixl.transport import ReadHandle

logger = logging.getLogger("speckv.connectors.nixl")


@dataclass
class PeerLink:
    client: SideChannelClient
    agent_name: str
    layout: KVLayoutDesc


@dataclass
class Pull:
    """One decode-side request that names a prefill engine's lease."""

    params: KVTransferParams
    peer: PeerLink | None = None
    # per KV cache group, the blocks to READ (local i <- remote i): only what the hit reads
    local_block_ids: tuple[tuple[int, ...], ...] = ()
    remote_block_ids: tuple[tuple[int, ...], ...] = ()
    num_blocks: int = 0  # blocks of every group the READ moves
    first_token: int = 0
    released: bool = False
    error: str | None = None  # why the handshake failed (None: it did not)
    load: RequestLoad | None = None  # what to READ, once the blocks are allocated


@dataclass
class ReadInFlight:
    load: RequestLoad
    pull: Pull
    read: ReadHandle
    started: float
    deadline: float


class ControlSender:
    """A bounded queue of side-channel messages and the daemon thread that sends them."""

    def __init__(self, capacity: int = 4096) -> None:
        self._queue: queue.Queue[tuple[SideChannelClient, Any, bool] | None] = \
            queue.Queue(capacity)
        self._thread = threading.Thread(target=self._loop, daemon=True,
                                        name="speckv-nixl-control")
        self._thread.start()

    def send(self, client: SideChannelClient, message: Any, close: bool = False) -> None:
        """Queue `message` for `client` (closed after it when `close`); never blocks."""
        try:
            self._queue.put_nowait((client, message, close))
        except queue.Full:
            logger.warning("nixl: control queue full; a lease is left to expire")

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=2.0)

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            client, message, close = item
            try:
                client.call(message)
            except SideChannelError as error:
                logger.info("nixl: %s not delivered (%s)", type(message).__name__, error)
            finally:
                if close:
                    client.close()
