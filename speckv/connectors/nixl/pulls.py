"""The decode side's bookkeeping of a transfer: the link to a prefill engine (`PeerLink`), one
request's pull under that engine's lease (`Pull`), its side-channel calls before the READ (the
handshake with a new peer, the READ's admission: `admit_async`, on a thread of its own), a
transfer in flight (`ReadInFlight`), and the thread that delivers control messages (releases,
heartbeats) (`ControlSender`). No engine step ever waits on a peer: a step only looks at what
these threads finished.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from speckv.connectors.metadata import RequestLoad
from speckv.connectors.nixl.layout_desc import KVLayoutDesc, check_peer_layout
from speckv.connectors.nixl.params import KVTransferParams, ParamsError
from speckv.connectors.nixl.side_channel import (
    Admit,
    Admitted,
    Heartbeat,
    Hello,
    Refused,
    Release,
    SideChannelClient,
    SideChannelError,
    Welcome,
)
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
    load: RequestLoad | None = None  # what to READ, once the blocks are allocated


@dataclass(frozen=True)
class Admission:
    """A READ the prefill engine admitted; `welcome` is a first contact's handshake answer
    (its layout already checked against ours; None: a known peer's `client`)."""

    client: SideChannelClient
    welcome: Welcome | None


@dataclass
class ReadInFlight:
    """A transfer from its admission (`admission` pending, `read` None) to its READ's end."""

    load: RequestLoad
    pull: Pull
    started: float
    deadline: float  # monotonic seconds; the admission's, then the READ's
    admission: Future[Admission]
    read: ReadHandle | None = None


@dataclass(frozen=True)
class Caller:
    """Who the decode engine is, to a prefill engine's side channel."""

    engine_id: str
    epoch: str
    layout: KVLayoutDesc
    timeout_s: float


def _check_welcome(params: KVTransferParams, welcome: Welcome, local: KVLayoutDesc) -> None:
    layout = welcome.layout
    if (layout.engine_id, layout.epoch) != (params.engine_id, params.epoch):
        field = "engine_id" if layout.engine_id != params.engine_id else "epoch"
        raise ParamsError(field, f"the engine at {params.host}:{params.port} is "
                          f"{layout.engine_id} epoch {layout.epoch}, the params name "
                          f"{params.engine_id} epoch {params.epoch}")
    if params.hash_contract != layout.hash_contract:
        raise ParamsError("hash_contract", "differs from the prefill engine's own")
    check_peer_layout(local, layout)


def admit(caller: Caller, params: KVTransferParams, block_ids: Sequence[Sequence[int]],
          link: PeerLink | None) -> Admission:
    """Blocking (a thread's work): shake hands with a new peer (`link` None), then have it
    admit a READ of `block_ids` (per group) under the params' lease. ParamsError or
    SideChannelError say why not."""
    client = link.client if link is not None else SideChannelClient(params.host, params.port,
                                                                     caller.timeout_s)
    try:
        welcome = None
        if link is None:
            reply = client.call(Hello(caller.engine_id, caller.epoch))
            if isinstance(reply, Refused):
                raise ParamsError(reply.field, reply.reason)
            if not isinstance(reply, Welcome):
                raise SideChannelError(f"unexpected answer {type(reply).__name__} to a "
                                       "handshake")
            _check_welcome(params, reply, caller.layout)
            welcome = reply
        answer = client.call(Admit(params.epoch, params.lease_id,
                                   [list(ids) for ids in block_ids], caller.timeout_s))
        if not isinstance(answer, Admitted):
            reason = (f"{answer.field}: {answer.reason}" if isinstance(answer, Refused)
                      else "unexpected answer")
            raise SideChannelError(f"the prefill engine refused the READ ({reason})")
    except BaseException:
        if link is None:
            client.close()
        raise
    return Admission(client, welcome)


def run_async(fn: Callable[..., Any], *args: Any) -> Future:
    """`fn(*args)` on a daemon thread of its own (a hung peer holds only that thread, and
    never delays the process's exit); its result or exception in the Future."""
    future: Future = Future()

    def work() -> None:
        if not future.set_running_or_notify_cancel():
            return
        try:
            future.set_result(fn(*args))
        except BaseException as error:  # the step that polls the future reports it
            future.set_exception(error)

    threading.Thread(target=work, name="speckv-nixl-admit", daemon=True).start()
    return future


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

    def release(self, pull: Pull, timeout_s: float) -> None:
        """Tell the pull's prefill engine its lease is not needed any more."""
        message = Release(pull.params.epoch, pull.params.lease_id)
        if pull.peer is not None:
            self.send(pull.peer.client, message)
        else:  # never shook hands (refused or unreachable): tell it anyway, best effort
            self.send(SideChannelClient(pull.params.host, pull.params.port, timeout_s),
                      message, close=True)

    def heartbeats(self, pulls: Iterable[Pull]) -> None:
        """Keep alive the leases of these pulls, one message per linked prefill engine."""
        by_peer: dict[int, tuple[PeerLink, list[str]]] = {}
        for pull in pulls:
            if pull.peer is not None and not pull.released:
                by_peer.setdefault(id(pull.peer), (pull.peer, []))[1].append(
                    pull.params.lease_id)
        for peer, lease_ids in by_peer.values():
            self.send(peer.client, Heartbeat(peer.layout.epoch, lease_ids))

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


def peer_key(params: KVTransferParams) -> tuple[str, int, str]:
    """A prefill engine's identity for the peer table: its side channel and its epoch."""
    return params.host, params.port, params.epoch


def close_unused(future: Future) -> None:
    """An admission answered after its load was given up: its new client is not kept (the
    load's failure already released the lease)."""
    if not future.cancelled() and future.exception() is None:
        admission = future.result()
        if admission.welcome is not None:
            admission.client.close()
