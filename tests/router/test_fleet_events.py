"""The fleet's event thread over a real ZeroMQ PUB socket: malformed frames, undecodable
payloads, out-of-order and duplicate batches and inconsistent events are counted, never
fatal; later events still apply; a reset drops an engine's entries; pending routed blocks
count until their events arrive or their time runs out."""

from __future__ import annotations

import time

import zmq

from speckv.events.endpoints import loopback_endpoint
from speckv.events.schema import BlockStored, KVEventBatch, encode_batch
from speckv.hashing.formats import format_for
from speckv.hashing.functions import get_hash_algo, make_none_hash
from speckv.hashing.request_hasher import hash_prompt
from speckv.router.contract import parse_contract
from speckv.router.fleet import EngineLink, EngineSpec, Fleet, FleetConfig
from speckv.router.tokenizer import TokenizerCache
from tests.patience import wait_until
from tests.router.test_contract import contract_body

B = 4
ALGO = get_hash_algo("sha256")


def stored(tokens, lookahead=1, num_blocks=None):
    """A BlockStored of the chain of `tokens` from the root, as the engine would send it."""
    hashes = hash_prompt(ALGO, make_none_hash(ALGO, "0"), B, format_for(lookahead), tokens)
    n = len(hashes) if num_blocks is None else num_blocks
    return BlockStored(block_hashes=hashes[:n], parent_block_hash=None,
                       token_ids=list(tokens[: n * B]), block_size=B, lora_id=None,
                       medium=None, lora_name=None,
                       lookahead_token_ids=[[tokens[(i + 1) * B]] for i in range(n)])


def wait_for(predicate):
    wait_until(predicate, "the fleet applies the events")


def test_bad_events_are_counted_and_later_ones_apply():
    endpoint = loopback_endpoint()
    context = zmq.Context.instance()
    pub = context.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(endpoint)
    body = contract_body(kv_events={"endpoint": endpoint, "replay_endpoint": None,
                                    "topic": "", "hash_encoding": "bytes"})
    link = EngineLink(EngineSpec("a", "http://127.0.0.1:1"),
                      parse_contract("a", "http://127.0.0.1:1", body))
    fleet = Fleet([link], TokenizerCache(), FleetConfig(pending_ttl_s=0.5))
    fleet.start()
    first, second = list(range(1, 22)), list(range(100, 121))

    def send(seq, payload):
        pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))

    try:
        batch = encode_batch(KVEventBatch(ts=0.0, events=[stored(first)]))
        # the SUB socket joins late: resend seq 0 until it lands (repeats are duplicates)
        def landed() -> bool:
            if link.events_applied > 0:
                return True
            send(0, batch)
            return False

        wait_until(landed, "the late SUB socket receives seq 0", poll_s=0.05)
        # copies of seq 0 still in flight land as duplicates: a marker (a malformed message)
        # sent now arrives after all of them (one PUB socket keeps its order)
        pub.send_multipart((b"marker",))
        wait_for(lambda: link.subscriber_stats()["malformed_messages"] == 1)
        assert fleet.plan(first, ["a"])["a"].predicted_cached_tokens == 20
        stats = link.subscriber_stats()
        base_duplicates = stats["duplicate_batches"]
        pub.send_multipart((b"only", b"two"))  # wrong frame layout
        send(1, b"\xc1 not msgpack")  # undecodable payload
        send(1, batch)  # out of order: seq 1 was taken by the bad payload
        bad_shape = stored(second)
        bad_shape.token_ids = bad_shape.token_ids[:-1]  # inconsistent with its block count
        send(5, encode_batch(KVEventBatch(ts=0.0, events=[bad_shape])))  # a gap: 2..4
        send(6, encode_batch(KVEventBatch(ts=0.0, events=[stored(second, num_blocks=3)])))
        wait_for(lambda: link.events_applied >= 3)
        stats = link.subscriber_stats()
        assert stats["malformed_messages"] == 1 + 2
        assert stats["duplicate_batches"] == base_duplicates + 1
        assert stats["seq_gaps"] == 1 and stats["lost_batches"] == 3
        state = fleet.state()["a"]
        assert state["index"]["unverifiable_blocks"] == 5  # indexed, but counted
        assert state["apply_errors"] == 0
        # the good batch after the bad ones applied: 5 blocks of `second` (bad shape) indexed
        assert fleet.plan(second, ["a"])["a"].predicted_cached_tokens == 20

        # pending: a routed prompt's blocks count as the engine's at once, until their
        # events arrive or their time runs out
        third = list(range(300, 321))
        plan = fleet.plan(third, ["a"])["a"]
        fleet.routed("a", plan)
        now = fleet.plan(third, ["a"])["a"]
        assert (now.published_cached_tokens, now.predicted_cached_tokens) == (0, 20)
        time.sleep(0.6)  # past pending_ttl_s, but the request is still in flight
        assert fleet.plan(third, ["a"])["a"].predicted_cached_tokens == 20
        fleet.finished("a", plan, 1)
        assert fleet.plan(third, ["a"])["a"].predicted_cached_tokens == 20
        time.sleep(0.6)  # answered, and past pending_ttl_s: no events came
        assert fleet.plan(third, ["a"])["a"].predicted_cached_tokens == 0

        # a reset (restart / expiry) drops the engine's entries
        with fleet.lock:
            fleet._reset(link)
        assert fleet.plan(first, ["a"])["a"].predicted_cached_tokens == 0
    finally:
        fleet.stop()
        pub.close(linger=0)


def test_a_silent_engine_expires_and_a_restart_is_a_new_epoch():
    link = EngineLink(EngineSpec("a", "http://127.0.0.1:1"),
                      parse_contract("a", "http://127.0.0.1:1", contract_body()))
    fleet = Fleet([link], TokenizerCache(), FleetConfig(stale_after_s=10.0))
    tokens = list(range(1, 22))
    fleet.apply(link, 0, 0, KVEventBatch(ts=0.0, events=[stored(tokens)]))
    assert fleet.plan(tokens, ["a"])["a"].predicted_cached_tokens == 20
    fleet.mark_unhealthy(link, "test")
    assert fleet.views(fleet.plan(tokens, ["a"]), set()) == []  # out of rotation
    fleet.expire_stale(now=link.unhealthy_since + 9.0)
    assert fleet.plan(tokens, ["a"])["a"].predicted_cached_tokens == 20  # not yet
    fleet.expire_stale(now=link.unhealthy_since + 10.0)
    assert link.expired and fleet.plan(tokens, ["a"])["a"].predicted_cached_tokens == 0
    # back with the same epoch: in rotation, and its thread replays from 0 (new generation)
    generation = link.generation
    fleet.engine_healthy(link, contract_body(), {"running": 2, "waiting": 1})
    assert link.in_rotation and not link.expired and link.generation == generation + 1
    assert link.load_requests == 3
    fleet.apply(link, generation, 1, KVEventBatch(ts=0.0, events=[stored(tokens)]))
    assert fleet.plan(tokens, ["a"])["a"].predicted_cached_tokens == 0  # stale generation
    # a restart: a new epoch drops the entries; a contract it cannot reproduce is refused
    fleet.apply(link, link.generation, 0, KVEventBatch(ts=0.0, events=[stored(tokens)]))
    assert fleet.plan(tokens, ["a"])["a"].predicted_cached_tokens == 20
    fleet.engine_healthy(link, contract_body(engine_epoch="e2"), {})
    assert link.epochs_seen == 2 and fleet.plan(tokens, ["a"])["a"].predicted_cached_tokens == 0
    fleet.engine_healthy(link, contract_body(engine_epoch="e3", hash_seed=None), {})
    assert not link.in_rotation and "hash_seed" in link.refused


def test_divergent_block_reuse_is_predicted():
    """A prompt diverging right after block 1 of a cached chain: lookahead hashes match block
    0 only; with reuse the engine copies block 1 (cached under another successor) and
    recomputes its last L positions: 4 + 4 - 1 tokens."""
    cached = list(range(1, 22))
    prompt = cached[:8] + list(range(200, 213))
    for reuse, expected in ((False, 4), (True, 7)):
        body = contract_body(divergent_block_reuse=reuse)
        link = EngineLink(EngineSpec("a", "http://127.0.0.1:1"),
                          parse_contract("a", "http://127.0.0.1:1", body))
        fleet = Fleet([link], TokenizerCache())
        fleet.apply(link, 0, 0, KVEventBatch(ts=0.0, events=[stored(cached)]))
        assert fleet.plan(prompt, ["a"])["a"].predicted_cached_tokens == expected
        assert fleet.plan(cached, ["a"])["a"].predicted_cached_tokens == 20  # a plain hit


def test_an_engine_down_at_start_joins_when_its_health_passes():
    """A router started while engine b does not answer: b is out of rotation, without a
    contract or index entries; its first passing poll reads the contract and adds it."""
    up = EngineLink(EngineSpec("a", "http://127.0.0.1:1"),
                    parse_contract("a", "http://127.0.0.1:1", contract_body()))
    down = EngineLink(EngineSpec("b", "http://127.0.0.1:2"), None)
    fleet = Fleet([up, down], TokenizerCache())
    assert up.in_rotation and not down.in_rotation
    state = fleet.state()["b"]
    assert (state["reached"], state["epoch"], state["index"]["cached_blocks"]) == (False, None, 0)
    fleet.expire_stale(now=1e12)  # an engine never reached has nothing to expire
    fleet.engine_healthy(down, contract_body(engine_epoch="e7"), {"running": 1})
    assert down.in_rotation and down.contract is not None and down.epochs_seen == 1
    prompt = list(range(1, 22))
    fleet.apply(down, down.generation, 0, KVEventBatch(ts=0.0, events=[stored(prompt)]))
    plans = fleet.plan(prompt, ["a", "b"])
    assert (plans["a"].predicted_cached_tokens, plans["b"].predicted_cached_tokens) == (0, 20)
    late = EngineLink(EngineSpec("c", "http://127.0.0.1:3"), None)
    fleet = Fleet([up, late], TokenizerCache())
    fleet.engine_healthy(late, contract_body(served_model_name="other"), {})
    assert not late.in_rotation and "served_model_name" in late.refused
