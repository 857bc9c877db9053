"""The KV-event subscriber: SUB socket, sequence-gap detection, replay, safe decoding.

Owns the consumer side of the publisher's protocol (`speckv.events.publisher`, and vLLM's,
whose replay answers carry the topic frame too). It delivers
batches in sequence order, each once:

- a live batch whose seq is past the next expected one means batches were missed (a slow
  joiner, a PUB high-water mark, a restarted subscriber): it asks the replay socket for
  everything from the first missing seq, delivers what comes back in order, then the live one;
  batches the replay buffer no longer has (or that the publisher dropped) are counted as lost;
- with `start_seq` set (default 0) it catches up through replay as soon as it starts, so a
  subscriber that connects late still sees the history the publisher buffers;
- a payload that does not decode, or a message with the wrong frame layout, is counted and
  skipped; nothing from the socket is ever unpickled or evaluated (msgspec only).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import msgspec
import zmq

from speckv.events.schema import KVEventBatch, decode_batch

_END = -1


@dataclass(frozen=True)
class SubscriberConfig:
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    topic: str = ""
    # first seq the consumer wants; None: start with whatever arrives live
    start_seq: int | None = 0
    replay_timeout_s: float = 1.0  # silence after which a replay answer is given up
    rcvhwm: int = 100_000  # messages
    # A gap is noticed when a later batch arrives; a subscriber that missed the END of a burst
    # (it joined, or its catch-up ran, while the last batches were in flight) would wait for the
    # next step's batch. After this long without a batch it asks replay for anything newer.
    # None: never (only with a replay endpoint, once a seq is known).
    idle_resync_s: float | None = 1.0

    def __post_init__(self) -> None:
        if self.start_seq is not None and self.start_seq < 0:
            raise ValueError(f"SubscriberConfig.start_seq must be >= 0, got {self.start_seq}")
        if self.replay_timeout_s <= 0:
            raise ValueError("SubscriberConfig.replay_timeout_s must be > 0")
        if self.idle_resync_s is not None and self.idle_resync_s <= 0:
            raise ValueError("SubscriberConfig.idle_resync_s must be > 0 or None")


@dataclass
class SubscriberStats:
    received_batches: int = 0  # delivered to the consumer (live or replayed)
    replayed_batches: int = 0  # of those, recovered through replay
    replay_requests: int = 0
    lost_batches: int = 0  # missing and not recoverable
    malformed_messages: int = 0  # bad frames or payloads, skipped
    duplicate_batches: int = 0  # already delivered, skipped
    seq_gaps: int = 0  # live batches that arrived past the next expected seq
    gaps: list[tuple[int, int]] = field(default_factory=list)  # [first, last] missing, recent

    def as_dict(self) -> dict[str, int]:
        return {
            "received_batches": self.received_batches,
            "replayed_batches": self.replayed_batches,
            "replay_requests": self.replay_requests,
            "lost_batches": self.lost_batches,
            "malformed_messages": self.malformed_messages,
            "duplicate_batches": self.duplicate_batches,
            "seq_gaps": self.seq_gaps,
        }


Delivered = tuple[int, KVEventBatch]


class EventSubscriber:
    """Single-threaded: create, `poll` or iterate from one thread, `close`."""

    _MAX_GAPS_KEPT = 32

    def __init__(self, config: SubscriberConfig, context: zmq.Context | None = None) -> None:
        self.config = config
        self._ctx = context if context is not None else zmq.Context.instance()
        self.stats = SubscriberStats()
        self.next_seq: int | None = config.start_seq
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.RCVHWM, config.rcvhwm)
        self._sub.setsockopt(zmq.SUBSCRIBE, config.topic.encode("utf-8"))
        self._sub.connect(config.endpoint)
        self._replay: zmq.Socket | None = None
        self._pending: list[Delivered] = []
        self._last_heard = time.monotonic()  # a live batch or a replay answer
        if config.replay_endpoint is not None and config.start_seq is not None:
            self._pending.extend(self._catch_up())

    # ---- reads -------------------------------------------------------------------------------
    def poll(self, timeout_s: float) -> list[Delivered]:
        """Batches that arrived within `timeout_s` (replays included), in seq order."""
        out, self._pending = self._pending, []
        if out:
            timeout_s = 0.0
        deadline = time.monotonic() + timeout_s
        while True:
            remaining_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not self._sub.poll(remaining_ms):
                return out or self._resync_if_idle()
            # drain what is already queued without waiting again
            while True:
                try:
                    frames = self._sub.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                out.extend(self._on_live(frames))
            if out:
                return out

    def __iter__(self) -> Iterator[Delivered]:
        while True:
            yield from self.poll(0.1)

    def close(self) -> None:
        for sock in (self._sub, self._replay):
            if sock is not None and not sock.closed:
                sock.close(linger=0)

    def __enter__(self) -> EventSubscriber:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- internals ---------------------------------------------------------------------------
    def _resync_if_idle(self) -> list[Delivered]:
        """Anything the publisher buffers past `next_seq`, once the stream has been quiet for
        `idle_resync_s` (at most one replay request per quiet period)."""
        idle_s = self.config.idle_resync_s
        if (idle_s is None or self.config.replay_endpoint is None or self.next_seq is None
                or time.monotonic() - self._last_heard < idle_s):
            return []
        out, self.next_seq = self._replayed(self.next_seq, None)
        self._last_heard = time.monotonic()
        return out

    def _on_live(self, frames: list[bytes]) -> list[Delivered]:
        self._last_heard = time.monotonic()
        if len(frames) != 3 or len(frames[1]) != 8:
            self.stats.malformed_messages += 1
            return []
        _, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        out: list[Delivered] = []
        if self.next_seq is not None:
            if seq < self.next_seq:
                self.stats.duplicate_batches += 1
                return []
            if seq > self.next_seq:
                self.stats.seq_gaps += 1
                out.extend(self._recover(self.next_seq, seq))
        self.next_seq = seq + 1
        batch = self._decode(payload)
        if batch is not None:
            out.append((seq, batch))
            self.stats.received_batches += 1
        return out

    def _decode(self, payload: bytes) -> KVEventBatch | None:
        try:
            return decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.stats.malformed_messages += 1
            return None

    def _catch_up(self) -> list[Delivered]:
        """Everything the publisher buffers from `start_seq` on, before going live."""
        assert self.next_seq is not None
        out, self.next_seq = self._replayed(self.next_seq, None)
        return out

    def _recover(self, first_missing: int, live_seq: int) -> list[Delivered]:
        """Replay `[first_missing, live_seq)`; count what cannot be recovered."""
        out: list[Delivered] = []
        expected = first_missing
        if self.config.replay_endpoint is not None:
            out, expected = self._replayed(first_missing, live_seq)
        if expected < live_seq:
            self._count_lost(expected, live_seq)
        return out

    def _replayed(self, first: int, end: int | None) -> tuple[list[Delivered], int]:
        """The batches replay returns in `[first, end)` (no bound: `end` None), counting the
        holes between them as lost; and the seq expected after the last one."""
        out: list[Delivered] = []
        expected = first
        for seq, payload in self._request_replay(first):
            if seq < expected:
                continue
            if end is not None and seq >= end:
                break
            if seq > expected:
                self._count_lost(expected, seq)
            expected = seq + 1
            batch = self._decode(payload)
            if batch is not None:
                out.append((seq, batch))
                self.stats.received_batches += 1
                self.stats.replayed_batches += 1
        return out, expected

    def _count_lost(self, first: int, end: int) -> None:
        self.stats.lost_batches += end - first
        self.stats.gaps.append((first, end - 1))
        del self.stats.gaps[: -self._MAX_GAPS_KEPT]

    def _replay_socket(self) -> zmq.Socket:
        if self._replay is None:
            assert self.config.replay_endpoint is not None
            # DEALER, not REQ: one request gets many replies
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.connect(self.config.replay_endpoint)
        return self._replay

    def _drop_replay_socket(self) -> None:
        # a timed-out answer may still arrive later; a fresh socket never sees it
        if self._replay is not None:
            self._replay.close(linger=0)
            self._replay = None

    def _request_replay(self, start_seq: int) -> list[tuple[int, bytes]]:
        """(seq, payload) pairs the publisher buffers from `start_seq`; [] on timeout."""
        sock = self._replay_socket()
        self.stats.replay_requests += 1
        try:
            sock.send_multipart((b"", start_seq.to_bytes(8, "big")), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            self._drop_replay_socket()
            return []
        timeout_ms = int(self.config.replay_timeout_s * 1000)
        replies: list[tuple[int, bytes]] = []
        while sock.poll(timeout_ms):
            frames = sock.recv_multipart()
            if frames and frames[0] == b"":
                frames = frames[1:]
            if len(frames) == 3:  # vLLM's publisher replays (topic, seq, payload)
                frames = frames[1:]
            if len(frames) != 2 or len(frames[0]) != 8:
                self.stats.malformed_messages += 1
                continue
            seq = int.from_bytes(frames[0], "big", signed=True)
            if seq == _END:
                return replies
            replies.append((seq, frames[1]))
        self._drop_replay_socket()  # no end marker: the publisher is gone or slow
        return replies


def run_subscriber(
    subscriber: EventSubscriber,
    on_batch: Callable[[int, KVEventBatch], None],
    should_stop: Callable[[], bool],
    poll_timeout_s: float = 0.05,
) -> None:
    """Feed batches to `on_batch` until `should_stop()`; for a background thread."""
    while not should_stop():
        for seq, batch in subscriber.poll(poll_timeout_s):
            on_batch(seq, batch)
