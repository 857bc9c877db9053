"""Publisher and subscriber over loopback sockets: replay after missed batches, a publisher
that never blocks the engine, malformed payloads counted and skipped, clean shutdown."""

from __future__ import annotations

import time

import pytest
import zmq

from speckv.cache import events as records
from speckv.events.publisher import END_SEQ, PublisherConfig, ZmqEventPublisher
from speckv.events.schema import encode_batch, to_wire_batch
from speckv.events.subscriber import EventSubscriber, SubscriberConfig
from tests.events.events_helpers import collect, wait_subscribed
from tests.patience import WATCHDOG_S


def removed(i: int) -> list[records.KVCacheEvent]:
    return [records.BlockRemoved(block_hashes=[i.to_bytes(32, "big")], group_idx=0)]


def seq_of(batch) -> int:
    return int.from_bytes(batch.events[0].block_hashes[0], "big")


def test_late_subscriber_recovers_history_by_replay(endpoints, make_publisher):
    pub_ep, replay_ep = endpoints
    publisher = make_publisher(endpoint=pub_ep, replay_endpoint=replay_ep)
    for i in range(20):
        publisher.publish(removed(i))
    assert publisher.wait_sent(WATCHDOG_S)
    with EventSubscriber(SubscriberConfig(endpoint=pub_ep, replay_endpoint=replay_ep)) as sub:
        got = collect(sub, 20)
        assert [s for s, _ in got] == list(range(20))
        assert [seq_of(b) for _, b in got] == list(range(20))
        wait_subscribed()
        for i in range(20, 25):
            publisher.publish(removed(i))
        got = collect(sub, 5)
        assert [s for s, _ in got] == list(range(20, 25))
        assert sub.stats.replayed_batches == 20 and sub.stats.lost_batches == 0


def test_gap_in_live_stream_is_replayed(endpoints, make_publisher):
    pub_ep, replay_ep = endpoints
    publisher = make_publisher(endpoint=pub_ep, replay_endpoint=replay_ep)
    config = SubscriberConfig(endpoint=pub_ep, replay_endpoint=replay_ep, start_seq=None)
    with EventSubscriber(config) as sub:
        wait_subscribed()
        publisher.publish(removed(0))
        assert [s for s, _ in collect(sub, 1)] == [0]
        # the subscriber stops listening (its SUB socket is gone) while 1..9 are sent
        sub._sub.setsockopt(zmq.UNSUBSCRIBE, b"")
        time.sleep(0.2)
        for i in range(1, 10):
            publisher.publish(removed(i))
        assert publisher.wait_sent(WATCHDOG_S)
        sub._sub.setsockopt(zmq.SUBSCRIBE, b"")
        time.sleep(0.2)
        publisher.publish(removed(10))
        got = collect(sub, 10)
    assert [s for s, _ in got] == list(range(1, 11))
    assert [seq_of(b) for _, b in got] == list(range(1, 11))
    assert sub.stats.replay_requests == 1 and sub.stats.replayed_batches == 9
    assert sub.stats.lost_batches == 0


def test_missed_end_of_a_burst_is_replayed_once_the_stream_is_quiet(endpoints, make_publisher):
    """No later batch reveals the gap: the subscriber asks replay after `idle_resync_s`."""
    pub_ep, replay_ep = endpoints
    publisher = make_publisher(endpoint=pub_ep, replay_endpoint=replay_ep)
    config = SubscriberConfig(endpoint=pub_ep, replay_endpoint=replay_ep, idle_resync_s=0.3)
    with EventSubscriber(config) as sub:
        wait_subscribed()
        publisher.publish(removed(0))
        assert [s for s, _ in collect(sub, 1)] == [0]
        sub._sub.setsockopt(zmq.UNSUBSCRIBE, b"")  # deaf while the rest of the burst is sent
        time.sleep(0.2)
        for i in range(1, 5):
            publisher.publish(removed(i))
        assert publisher.wait_sent(WATCHDOG_S)
        sub._sub.setsockopt(zmq.SUBSCRIBE, b"")
        got = collect(sub, 4)
    assert [s for s, _ in got] == [1, 2, 3, 4]
    assert sub.stats.replayed_batches == 4 and sub.stats.lost_batches == 0


def test_no_idle_resync_when_it_is_off(endpoints, make_publisher):
    pub_ep, replay_ep = endpoints
    publisher = make_publisher(endpoint=pub_ep, replay_endpoint=replay_ep)
    config = SubscriberConfig(endpoint=pub_ep, replay_endpoint=replay_ep, idle_resync_s=None)
    with EventSubscriber(config) as sub:
        wait_subscribed()
        sub._sub.setsockopt(zmq.UNSUBSCRIBE, b"")
        time.sleep(0.2)
        publisher.publish(removed(0))
        assert publisher.wait_sent(WATCHDOG_S)
        assert collect(sub, 1, quiet_s=1.0) == []
    assert sub.stats.replay_requests == 1  # the catch-up at start only


def test_gap_beyond_the_replay_buffer_is_counted_lost(endpoints, make_publisher):
    pub_ep, replay_ep = endpoints
    publisher = make_publisher(endpoint=pub_ep, replay_endpoint=replay_ep, buffer_steps=3)
    for i in range(10):
        publisher.publish(removed(i))
    assert publisher.wait_sent(WATCHDOG_S)
    with EventSubscriber(SubscriberConfig(endpoint=pub_ep, replay_endpoint=replay_ep)) as sub:
        got = collect(sub, 3)
    assert [s for s, _ in got] == [7, 8, 9]
    assert sub.stats.lost_batches == 7 and sub.stats.gaps == [(0, 6)]


def test_replay_protocol_is_vllms(endpoints, make_publisher):
    pub_ep, replay_ep = endpoints
    publisher = make_publisher(endpoint=pub_ep, replay_endpoint=replay_ep)
    for i in range(3):
        publisher.publish(removed(i))
    assert publisher.wait_sent(WATCHDOG_S)
    req = zmq.Context.instance().socket(zmq.REQ)  # a vLLM-style client: REQ, raw start seq
    req.setsockopt(zmq.LINGER, 0)
    req.connect(replay_ep)
    req.send((1).to_bytes(8, "big"))
    assert req.poll(2000)
    seq_bytes, payload = req.recv_multipart()
    assert int.from_bytes(seq_bytes, "big") == 1 and payload
    req.close()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(replay_ep)
    dealer.send_multipart((b"", (1).to_bytes(8, "big")))
    frames = []
    while dealer.poll(2000):
        frame = dealer.recv_multipart()
        frames.append(frame)
        if frame[1] == END_SEQ:
            break
    dealer.close()
    assert [int.from_bytes(f[1], "big", signed=True) for f in frames] == [1, 2, -1]
    assert frames[-1][2] == b""


def test_no_subscriber_never_blocks_the_engine(endpoints):
    pub_ep, replay_ep = endpoints
    config = PublisherConfig(endpoint=pub_ep, replay_endpoint=replay_ep, max_queue_size=4,
                             hwm=1, buffer_steps=8)
    publisher = ZmqEventPublisher(config)
    try:
        batch = removed(1)
        start = time.perf_counter()
        for _ in range(10_000):
            publisher.publish(batch)
        elapsed = time.perf_counter() - start
        assert elapsed < 2.0, f"10k publish calls took {elapsed:.2f} s"
        assert publisher.wait_sent(WATCHDOG_S)
        stats = publisher.stats
        assert stats.published_batches == 10_000 and stats.next_seq == 10_000
        assert stats.sent_batches + stats.dropped_batches == 10_000
    finally:
        start = time.perf_counter()
        publisher.shutdown()
        assert time.perf_counter() - start < 3.0


def test_dead_subscriber_does_not_stop_the_publisher(endpoints, make_publisher):
    pub_ep, replay_ep = endpoints
    publisher = make_publisher(endpoint=pub_ep, replay_endpoint=replay_ep, hwm=10)
    # a subscriber that connects and never reads
    dead = zmq.Context.instance().socket(zmq.SUB)
    dead.setsockopt(zmq.LINGER, 0)
    dead.setsockopt(zmq.RCVHWM, 1)
    dead.setsockopt(zmq.SUBSCRIBE, b"")
    dead.connect(pub_ep)
    time.sleep(0.2)
    start = time.perf_counter()
    for i in range(5_000):
        publisher.publish(removed(i))
    assert publisher.wait_sent(WATCHDOG_S)
    assert time.perf_counter() - start < 10.0
    assert publisher.stats.sent_batches == 5_000
    dead.close()


def test_malformed_payloads_are_counted_and_skipped(endpoints):
    pub_ep, _ = endpoints
    pub = zmq.Context.instance().socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(pub_ep)
    good = encode_batch(to_wire_batch(removed(5)))
    try:
        with EventSubscriber(SubscriberConfig(endpoint=pub_ep, start_seq=None)) as sub:
            time.sleep(0.2)
            pub.send_multipart((b"", (0).to_bytes(8, "big"), b"\xc1garbage"))
            pub.send_multipart((b"", (1).to_bytes(8, "big"), encode_batch(to_wire_batch([]))[:-1]))
            pub.send_multipart((b"", b"short", good))  # bad sequence frame
            pub.send_multipart((b"only-one-frame",))
            pub.send_multipart((b"", (2).to_bytes(8, "big"), b"\x93\x01\x02\x03"))  # wrong shape
            pub.send_multipart((b"", (3).to_bytes(8, "big"), good))
            got = collect(sub, 1)
            assert [s for s, _ in got] == [3]
            assert seq_of(got[0][1]) == 5
            assert sub.stats.malformed_messages == 5
    finally:
        pub.close()


def test_publish_after_shutdown_raises(endpoints):
    pub_ep, replay_ep = endpoints
    publisher = ZmqEventPublisher(PublisherConfig(endpoint=pub_ep, replay_endpoint=replay_ep))
    publisher.publish(removed(0))
    publisher.shutdown()
    assert publisher.stats.sent_batches == 1
    with pytest.raises(RuntimeError, match="shut down"):
        publisher.publish(removed(1))
    # the ports are free again
    ZmqEventPublisher(PublisherConfig(endpoint=pub_ep, replay_endpoint=replay_ep)).shutdown()


def test_empty_steps_publish_nothing(endpoints, make_publisher):
    pub_ep, _ = endpoints
    publisher = make_publisher(endpoint=pub_ep)
    assert publisher.publish([]) is None
    assert publisher.stats.next_seq == 0
