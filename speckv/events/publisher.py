"""The KV-event publisher: ZeroMQ PUB with sequence numbers and a replay socket.

Owns the engine side of the event stream. It mirrors vLLM's `ZmqEventPublisher` protocol, so
vLLM subscribers work against it:

    PUB     multipart (topic, seq as 8-byte big-endian, msgpack payload)   one per batch
    ROUTER  request  [identity, b"", start_seq (8-byte big-endian)]
            replies  [identity, b"", seq, payload] for every buffered batch with seq >= start_seq,
                     then [identity, b"", -1 (8 bytes, signed), b""] as the end marker

The engine calls `publish(records)` once per step from its own thread. That call never blocks
and never touches a socket: it stamps a sequence number and appends to a bounded queue; a
background thread converts, encodes, sends and keeps a ring buffer of recent payloads for
replay. When the queue is full the *oldest* queued batch is dropped and counted. Unlike vLLM,
sequence numbers are assigned at `publish` time, so a dropped batch leaves a visible gap that
subscribers detect (and cannot replay: it was never sent), rather than vanishing silently.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import zmq

from speckv.cache import events as records
from speckv.events.schema import HashEncoding, KVEventBatch, encode_batch, to_wire_batch

END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class PublisherConfig:
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    buffer_steps: int = 10_000  # batches kept for replay
    max_queue_size: int = 100_000  # batches waiting for the sender thread
    hwm: int = 100_000  # ZeroMQ high-water mark of the PUB socket, in messages
    data_parallel_rank: int | None = None
    hash_encoding: HashEncoding = HashEncoding.BYTES
    bind: bool = True  # False: connect the PUB socket (e.g. to a forwarding proxy)
    shutdown_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("buffer_steps", "max_queue_size", "hwm"):
            if getattr(self, name) < 1:
                raise ValueError(f"PublisherConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.shutdown_timeout_s < 0:
            raise ValueError("PublisherConfig.shutdown_timeout_s must be >= 0")


@dataclass(frozen=True)
class PublisherStats:
    published_batches: int  # accepted by publish()
    sent_batches: int  # sent on the PUB socket
    dropped_batches: int  # dropped from a full queue, never sent
    replay_requests: int
    send_errors: int
    next_seq: int


class ZmqEventPublisher:
    """Reliable-ish PUB/ROUTER publisher with an in-memory replay buffer."""

    # how long the sender thread sleeps when idle; bounds replay latency
    _IDLE_WAIT_S = 0.005

    def __init__(self, config: PublisherConfig, context: zmq.Context | None = None) -> None:
        self.config = config
        # A context of our own unless the caller shares one: ZeroMQ closes sockets
        # asynchronously, and only `term()` on the owning context waits until the listening
        # TCP sockets are really gone, so a restarted publisher can bind the same ports.
        self._owns_ctx = context is None
        self._ctx = zmq.Context(io_threads=1) if context is None else context
        self._topic = config.topic.encode("utf-8")
        # queue of (seq, ts, records-or-batch); deque ops are atomic, the lock makes
        # "full? drop oldest, count, append" one step
        self._queue: deque[tuple[int, float, object]] = deque()
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._next_seq = 0
        self._published = 0
        self._sent = 0
        self._dropped = 0
        self._replays = 0
        self._send_errors = 0
        self._running = True
        self._pub: zmq.Socket = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            if config.bind:
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            self._term_context()
            raise
        self._thread = threading.Thread(target=self._run, name="speckv-kv-events", daemon=True)
        self._thread.start()

    # ---- engine side -------------------------------------------------------------------------
    def publish(self, events: Sequence[records.KVCacheEvent] | KVEventBatch) -> int | None:
        """Queue one step's events; returns the batch's sequence number, or None for an empty
        step (nothing is sent). Never blocks. The records must not be mutated afterwards (the
        block pool builds fresh lists per record)."""
        if not self._running:
            raise RuntimeError("the KV event publisher is shut down")
        if isinstance(events, KVEventBatch):
            if not events.events:
                return None
        elif not events:
            return None
        ts = time.time()
        with self._lock:
            seq = self._next_seq
            self._next_seq += 1
            if len(self._queue) >= self.config.max_queue_size:
                self._queue.popleft()
                self._dropped += 1
            self._queue.append((seq, ts, events))
            self._published += 1
        self._wake.set()
        return seq

    @property
    def stats(self) -> PublisherStats:
        with self._lock:
            return PublisherStats(
                self._published, self._sent, self._dropped, self._replays, self._send_errors,
                self._next_seq,
            )

    def wait_sent(self, timeout_s: float) -> bool:
        """Wait until every queued batch is sent (tests, samples). True if drained in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                # published = sent + dropped + send errors + (queued or being sent)
                if self._sent + self._dropped + self._send_errors == self._published:
                    return True
            time.sleep(0.001)
        return False

    def shutdown(self) -> None:
        """Send what is queued (up to `shutdown_timeout_s`), stop the thread, close sockets."""
        if not self._running:
            return
        self._running = False
        self._wake.set()
        self._thread.join(timeout=self.config.shutdown_timeout_s + 1.0)
        if not self._thread.is_alive():
            self._close_sockets()
            self._term_context()  # returns once the ports are released

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # ---- sender thread -----------------------------------------------------------------------
    def _run(self) -> None:
        stop_deadline: float | None = None
        while True:
            if self._replay is not None:
                self._service_replay()
            item = self._pop()
            if item is None:
                if not self._running:
                    break
                self._wake.wait(self._IDLE_WAIT_S)
                self._wake.clear()
                continue
            if not self._running:
                if stop_deadline is None:
                    stop_deadline = time.monotonic() + self.config.shutdown_timeout_s
                elif time.monotonic() > stop_deadline:
                    break
            self._send(*item)
        self._close_sockets()

    def _pop(self) -> tuple[int, float, object] | None:
        with self._lock:
            return self._queue.popleft() if self._queue else None

    def _send(self, seq: int, ts: float, events: object) -> None:
        try:
            if isinstance(events, KVEventBatch):
                batch = events
                if batch.data_parallel_rank is None:
                    batch.data_parallel_rank = self.config.data_parallel_rank
            else:
                batch = to_wire_batch(
                    events,  # type: ignore[arg-type]
                    ts=ts,
                    data_parallel_rank=self.config.data_parallel_rank,
                    encoding=self.config.hash_encoding,
                )
            payload = encode_batch(batch)
            seq_bytes = seq.to_bytes(8, "big")
            # NOBLOCK: a PUB socket drops at its HWM instead of blocking, but be explicit
            self._pub.send_multipart((self._topic, seq_bytes, payload), flags=zmq.NOBLOCK)
            self._buffer.append((seq, payload))
            with self._lock:
                self._sent += 1
        except (zmq.ZMQError, TypeError, ValueError):
            # a batch we cannot encode or send is lost (the gap is visible downstream)
            with self._lock:
                self._send_errors += 1

    def _service_replay(self) -> None:
        replay = self._replay
        assert replay is not None
        # answer every waiting request; malformed requests are ignored
        while replay.poll(0):
            try:
                frames = replay.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3 or len(frames[2]) != 8:
                continue
            client_id, _, start_bytes = frames
            start_seq = int.from_bytes(start_bytes, "big")
            with self._lock:
                self._replays += 1
            try:
                for seq, payload in list(self._buffer):
                    if seq >= start_seq:
                        replay.send_multipart(
                            (client_id, b"", seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK
                        )
                replay.send_multipart((client_id, b"", END_SEQ, b""), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                continue  # client gone or its pipe full: it will time out and may ask again

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None and not sock.closed:
                sock.close(linger=0)

    def _term_context(self) -> None:
        if self._owns_ctx and not self._ctx.closed:
            self._ctx.term()


def publisher_for_endpoints(endpoint: str, replay_endpoint: str | None = None
                            ) -> ZmqEventPublisher:
    """The engine's publisher for `EngineConfig.kv_events_endpoint` (bound; defaults else).
    A busy or malformed endpoint is the user's error: a ValueError naming it."""
    try:
        config = PublisherConfig(endpoint=endpoint, replay_endpoint=replay_endpoint)
        return ZmqEventPublisher(config)
    except zmq.ZMQError as error:
        where = endpoint if replay_endpoint is None else f"{endpoint} / {replay_endpoint}"
        raise ValueError(f"cannot bind the KV-event endpoint {where}: {error}") from None
