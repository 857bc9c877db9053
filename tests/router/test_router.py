"""The router index over real sockets: it picks the engine holding the longest prefix, forgets
on BlockRemoved / AllBlocksCleared, verifies hashes, and serves POST /route over real HTTP."""

from __future__ import annotations

import threading

import httpx
import pytest
import uvicorn

from speckv.events.endpoints import free_port, loopback_endpoint
from speckv.events.schema import HashEncoding, decode_batch, encode_batch, to_wire_batch
from speckv.hashing.extra_keys import HashInputs, LoRARef
from speckv.router.index import EngineHashConfig, RouterIndex
from speckv.router.service import EngineEndpoint, RouterService, make_app
from speckv.simulation.event_sample import SampleEngine, SampleEngineConfig
from tests.patience import WATCHDOG_S, wait_until

B = 8
LORA = LoRARef("ad", "/srv/ad")
HASHING = EngineHashConfig(block_size=B, lookahead_tokens=1, lora_paths={LORA.name: LORA.path})
SHARED = list(range(1, 4 * B + 1))
PROMPT_A = [*SHARED, *range(500, 500 + 3 * B)]  # engine a holds 4 + 3 blocks of this
PROMPT_B = [*SHARED[: 2 * B], *range(900, 900 + 2 * B)]  # engine b shares 2 blocks


def engine(num_blocks: int = 64) -> SampleEngine:
    return SampleEngine(SampleEngineConfig(block_size=B, lookahead_tokens=1, num_blocks=num_blocks))


def feed(index: RouterIndex, name: str, eng: SampleEngine, encoding=HashEncoding.BYTES) -> None:
    def publish(records):
        if records:
            wire = decode_batch(encode_batch(to_wire_batch(records, encoding=encoding)))
            index.apply_batch(name, wire)
    for request in eng.requests:
        if not request.is_finished:
            eng.run(request, publish)


def test_longest_prefix_and_forgetting():
    index = RouterIndex({"a": HASHING, "b": HASHING})
    a, b = engine(), engine()
    a.request("a1", PROMPT_A)
    b.request("b1", PROMPT_B)
    feed(index, "a", a)
    feed(index, "b", b)
    query = [*SHARED, *range(500, 500 + 2 * B), 7, 7, 7]
    result = index.route(query)
    # lookahead: block 5 of the query is followed by 7, on engine a by 516 -> 5 blocks;
    # engine b's block 1 is followed by 900, the query's by SHARED[2B] -> 1 block
    assert result.engine == "a" and result.per_engine == {"a": 5 * B, "b": 1 * B}
    result = index.route([*PROMPT_B, 1])  # b's block 3 is followed by a sampled token, not 1
    assert result.engine == "b" and result.per_engine == {"a": 1 * B, "b": 3 * B}
    stats = index.stats()
    assert stats["a"]["verified_blocks"] == stats["a"]["stored_blocks"] > 0
    assert stats["a"]["mismatched_blocks"] == stats["a"]["unverifiable_blocks"] == 0
    # reset engine a's cache: the router forgets it
    assert a.manager.reset_prefix_cache()
    index.apply_batch("a", to_wire_batch(a.manager.take_events()))
    result = index.route(query)
    assert result.per_engine["a"] == 0 and result.engine == "b"


def test_block_removed_shortens_the_match():
    index = RouterIndex({"a": HASHING})
    small = engine(num_blocks=12)  # the second request evicts the first's tail
    small.request("x", PROMPT_A)
    feed(index, "a", small)
    before = index.route(PROMPT_A).per_engine["a"]
    small.request("y", list(range(2000, 2000 + 6 * B)))
    feed(index, "a", small)
    after = index.route(PROMPT_A).per_engine["a"]
    assert index.stats()["a"]["removed_blocks"] > 0
    assert after < before


def test_lora_prompts_need_the_adapter_path():
    index = RouterIndex({"a": HASHING})
    eng = engine()
    eng.request("l", PROMPT_A, inputs=HashInputs(lora=LORA))
    feed(index, "a", eng)
    assert index.route(PROMPT_A).per_engine["a"] == 0  # without the adapter: different hashes
    assert index.route(PROMPT_A, lora_name="ad").per_engine["a"] >= 4 * B
    assert index.stats()["a"]["verified_blocks"] > 0
    with pytest.raises(ValueError, match="no path"):
        index.route(PROMPT_A, lora_name="unknown")


def test_wrong_router_config_counts_mismatches():
    index = RouterIndex({"a": EngineHashConfig(block_size=B, lookahead_tokens=1, seed="other")})
    eng = engine()
    eng.request("x", PROMPT_A)
    feed(index, "a", eng)
    stats = index.stats()["a"]
    # events whose chain starts at NONE_HASH mismatch; later ones carry their (bytes) parent
    assert stats["mismatched_blocks"] > 0
    assert index.route(PROMPT_A).per_engine["a"] == 0


def test_int_hashes_verify_through_known_parents():
    index = RouterIndex({"a": HASHING})
    eng = engine()
    eng.request("x", PROMPT_A)
    feed(index, "a", eng, HashEncoding.INT)
    stats = index.stats()["a"]
    assert stats["verified_blocks"] == stats["stored_blocks"] > 0
    assert index.route(PROMPT_A).per_engine["a"] >= 4 * B


def test_http_route_over_real_sockets(make_publisher):
    endpoints = {name: (loopback_endpoint(), loopback_endpoint()) for name in ("a", "b")}
    engines = {"a": engine(), "b": engine()}
    engines["a"].request("a1", PROMPT_A)
    engines["b"].request("b1", PROMPT_B)
    publishers = {name: make_publisher(endpoint=pub, replay_endpoint=replay)
                  for name, (pub, replay) in endpoints.items()}
    for name, eng in engines.items():
        eng.run(eng.requests[0], publishers[name].publish)
        assert publishers[name].wait_sent(WATCHDOG_S)
    # the router starts after the engines published: it catches up through replay
    service = RouterService([EngineEndpoint(n, p, r, HASHING) for n, (p, r) in endpoints.items()])
    service.start()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(make_app(service), host="127.0.0.1", port=port,
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{port}"

        def routed() -> dict | None:
            try:
                body = httpx.post(f"{url}/route", json={"token_ids": PROMPT_A},
                                  timeout=WATCHDOG_S).json()
            except httpx.TransportError:
                return None
            done = body["per_engine"]["b"] > 0 and body["matched_tokens"] >= 6 * B
            return body if done else None

        body = wait_until(routed, "the router indexed both engines' events", poll_s=0.1)
        assert body is not None and body["engine"] == "a"
        assert body["per_engine"] == {"a": 6 * B, "b": 1 * B}
        stats = httpx.get(f"{url}/stats", timeout=WATCHDOG_S).json()
        assert stats["a"]["index"]["verified_blocks"] > 0
        assert stats["a"]["subscriber"]["lost_batches"] == 0
        bad = httpx.post(f"{url}/route", json={"token_ids": []}, timeout=WATCHDOG_S)
        assert bad.status_code == 422
        bad = httpx.post(f"{url}/route", json={"token_ids": [1], "lora_name": "nope"},
                         timeout=WATCHDOG_S)
        assert bad.status_code == 422
    finally:
        server.should_exit = True
        thread.join(timeout=WATCHDOG_S)
        service.stop()
