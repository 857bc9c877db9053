"""The side channel of a NIXL transfer: a ZeroMQ request/reply service on the prefill engine.

Owns the control messages (msgspec Structs, msgpack, tagged; never pickle) and both ends:

    Hello(engine_id, epoch)                 -> Welcome(layout, agent_metadata) | Refused
    Admit(epoch, lease_id, block_ids)       -> Admitted(pin_s) | Refused(field, reason)
    Heartbeat(epoch, lease_ids)             -> Alive(live per lease)
    Release(epoch, lease_id)                -> Released(held)

`SideChannelServer` binds where `--host` says (never a wildcard unless the user asks), serves
on its own thread, and answers from a `LeaseService` (the prefill side's lease table behind a
lock). A READ is admitted only for blocks under a live lease the server's engine issued in
this epoch. Messages are bounded in size; a malformed one gets a `Refused`.
`SideChannelClient` is the decode side's end: one call at a time, a timeout per call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from speckv.connectors.nixl.layout_desc import KVLayoutDesc
from speckv.connectors.nixl.lease import LeaseRefused, LeaseTable

logger = logging.getLogger("speckv.connectors.nixl")

MAX_MESSAGE_BYTES = 16 << 20


class Hello(msgspec.Struct, frozen=True, tag=True):
    engine_id: str
    epoch: str


class Welcome(msgspec.Struct, frozen=True, tag=True):
    layout: KVLayoutDesc
    agent_metadata: bytes


class Admit(msgspec.Struct, frozen=True, tag=True):
    epoch: str
    lease_id: str
    block_ids: list[list[int]]
    pin_s: float


class Admitted(msgspec.Struct, frozen=True, tag=True):
    pin_s: float


class Heartbeat(msgspec.Struct, frozen=True, tag=True):
    epoch: str
    lease_ids: list[str]


class Alive(msgspec.Struct, frozen=True, tag=True):
    live: list[bool]


class Release(msgspec.Struct, frozen=True, tag=True):
    epoch: str
    lease_id: str


class Released(msgspec.Struct, frozen=True, tag=True):
    held: bool


class Refused(msgspec.Struct, frozen=True, tag=True):
    field: str
    reason: str


RequestMsg = Hello | Admit | Heartbeat | Release
ReplyMsg = Welcome | Admitted | Alive | Released | Refused

_encoder = msgspec.msgpack.Encoder()
_request_decoder = msgspec.msgpack.Decoder(RequestMsg)
_reply_decoder = msgspec.msgpack.Decoder(ReplyMsg)


class LeaseService:
    """The prefill side's leases behind a lock: the engine thread issues them and collects the
    released and expired ones; the side channel thread admits, renews and releases."""

    def __init__(self, lease_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.table = LeaseTable(lease_s)
        self.clock = clock
        self._lock = threading.Lock()
        self._ended: list[str] = []  # released lease ids, for the engine thread

    def issue(self, request_id: str, block_ids: list[list[int]],
              lease_s: float | None = None) -> str:
        with self._lock:
            return self.table.issue(request_id, block_ids, self.clock(), lease_s).lease_id

    def admit(self, lease_id: str, block_ids: list[list[int]], pin_s: float) -> float:
        with self._lock:
            self.table.admit(lease_id, block_ids, self.clock(), pin_s)
        return pin_s

    def renew(self, lease_ids: list[str]) -> list[bool]:
        with self._lock:
            now = self.clock()
            return [self.table.renew(lease_id, now) for lease_id in lease_ids]

    def release(self, lease_id: str) -> bool:
        with self._lock:
            lease = self.table.release(lease_id)
            if lease is not None:
                self._ended.append(lease.request_id)
            return lease is not None

    def take_ended(self) -> list[str]:
        """Request ids whose lease was released or expired since the last call."""
        with self._lock:
            for lease in self.table.expire(self.clock()):
                logger.info("KV lease of request %s expired before the decode side pulled it",
                            lease.request_id)
                self._ended.append(lease.request_id)
            ended, self._ended = self._ended, []
            return ended

    def __len__(self) -> int:
        with self._lock:
            return len(self.table)


class SideChannelServer:
    """The prefill engine's side channel: binds `tcp://host:port` (port 0: any free port)."""

    def __init__(self, host: str, port: int, epoch: str, welcome: Welcome,
                 leases: LeaseService, max_pin_s: float = 60.0) -> None:
        self.epoch = epoch
        self.welcome = welcome
        self.leases = leases
        self.max_pin_s = max_pin_s
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self._socket.setsockopt(zmq.LINGER, 0)
        bracketed = f"[{host}]" if ":" in host else host
        if port:
            self._socket.bind(f"tcp://{bracketed}:{port}")
        else:
            port = self._socket.bind_to_random_port(f"tcp://{bracketed}")
        if ":" in host:
            self._socket.setsockopt(zmq.IPV6, 1)
        self.host, self.port = host, port
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="speckv-nixl-side-channel",
                                        daemon=True)
        self._thread.start()

    def _answer(self, message: RequestMsg) -> ReplyMsg:
        if isinstance(message, Hello):
            return self.welcome
        if message.epoch != self.epoch:
            return Refused("epoch", f"the prefill engine restarted (epoch {self.epoch}, the "
                           f"params name {message.epoch})")
        if isinstance(message, Admit):
            try:
                pin = self.leases.admit(message.lease_id, message.block_ids,
                                        min(message.pin_s, self.max_pin_s))
            except LeaseRefused as refused:
                return Refused(refused.field, refused.reason)
            return Admitted(pin)
        if isinstance(message, Heartbeat):
            return Alive(self.leases.renew(message.lease_ids))
        return Released(self.leases.release(message.lease_id))

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._socket, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                continue
            if len(frames) < 3:
                continue
            try:
                reply = self._answer(_request_decoder.decode(frames[-1]))
            except (msgspec.DecodeError, msgspec.ValidationError) as error:
                reply = Refused("message", f"malformed side-channel message: {error}")
            except Exception as error:  # the channel keeps serving
                logger.exception("side channel: error answering a request")
                reply = Refused("message", f"internal error: {error}")
            self._socket.send_multipart([*frames[:-1], _encoder.encode(reply)])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2.0)
        self._socket.close(0)


class SideChannelError(ConnectionError):
    """The prefill engine's side channel did not answer in time (dead or unreachable)."""


class SideChannelClient:
    """One decode engine's connection to one prefill engine's side channel."""

    def __init__(self, host: str, port: int, timeout_s: float = 5.0) -> None:
        self.address = f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
        self.timeout_ms = max(1, int(timeout_s * 1000))
        self._context = zmq.Context.instance()
        self._socket: zmq.Socket | None = None
        self._lock = threading.Lock()
        self._closed = False

    def _connect(self) -> zmq.Socket:
        if self._socket is None:
            sock = self._context.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
            sock.setsockopt(zmq.RCVTIMEO, self.timeout_ms)
            sock.setsockopt(zmq.SNDTIMEO, self.timeout_ms)
            if self.address.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
            sock.connect(self.address)
            self._socket = sock
        return self._socket

    def call(self, message: RequestMsg) -> ReplyMsg:
        with self._lock:
            if self._closed:
                raise SideChannelError(f"the connection to {self.address} is closed")
            sock = self._connect()
            try:
                sock.send(_encoder.encode(message))
                return _reply_decoder.decode(sock.recv())
            except zmq.Again:
                sock.close(0)  # a REQ socket that missed its reply cannot send again
                self._socket = None
                raise SideChannelError(f"no answer from the prefill engine at {self.address} "
                                       f"within {self.timeout_ms} ms") from None
            except (msgspec.DecodeError, msgspec.ValidationError) as error:
                raise SideChannelError(f"malformed answer from {self.address}: {error}"
                                       ) from None
            finally:
                if self._closed:  # closed while this call waited: the closer did not wait
                    self._close_socket()

    def _close_socket(self) -> None:
        if self._socket is not None:
            self._socket.close(0)
            self._socket = None

    def close(self) -> None:
        """Close now, or (a call waits on a silent peer) when that call ends: never waits."""
        self._closed = True
        if self._lock.acquire(blocking=False):
            try:
                self._close_socket()
            finally:
                self._lock.release()
