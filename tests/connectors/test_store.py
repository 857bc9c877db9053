"""The store tier against a real valkey-server (the embedded one, started here): sharing between
two connectors, keys and values, namespaces, checks on load, and the store's faults."""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from pathlib import Path

import pytest
import redis
import torch

from speckv.connectors import MEDIUM_STORE, RequestBlocks, StoreConnector
from speckv.connectors.codec import MAGIC
from speckv.connectors.embedded_valkey import EmbeddedValkey, free_loopback_port
from speckv.connectors.redis_store import BACKOFF_MAX_S, block_key
from tests import patience
from tests.connectors.connector_helpers import (
    BLOCK_SIZE,
    Driver,
    KVWorld,
    Req,
    bit_equal,
    block_of,
    store_request,
)

B = BLOCK_SIZE
MIB = 1 << 20


@pytest.fixture(scope="module")
def server():
    with EmbeddedValkey(256 * MIB) as valkey:
        yield valkey


@pytest.fixture
def url(server):
    admin = redis.Redis.from_url(server.url)
    admin.flushall()
    admin.close()
    return server.url


def _connector(url, fingerprint="model-a", seed="0", **kw):
    return StoreConnector(url, model_fingerprint=fingerprint, hash_algo="sha256",
                          hash_seed=seed, **kw)


def _block_name(driver: Driver, request: Req, index: int) -> bytes:
    return block_key(driver.connector.namespace.ident, block_of(driver, request, index).key)


def _wait_until(predicate, timeout_s=4 * BACKOFF_MAX_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _lookup(driver: Driver, tokens) -> int:
    return driver.connector.get_num_new_matched_tokens(Req(tokens), 0).num_tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_second_connector_gets_bit_exact_target_and_draft_blocks(url, dtype):
    first_world = KVWorld(dtype=dtype)
    first = Driver(_connector(url), first_world)
    prompt = list(range(5 * B + 1))
    _, _, cold = store_request(first, prompt)
    stats = first.connector.stats()["store"]
    assert stats.saved_blocks == 5 and stats.medium == MEDIUM_STORE

    second_world = KVWorld(dtype=dtype)  # another engine: its own, empty caches
    second = Driver(_connector(url), second_world)
    reader = Req(prompt)
    hit, ids = second.admit(reader)
    assert hit == 5 * B
    _, output = second.step([RequestBlocks(reader, ids, 0)])
    assert not output.load_failures
    assert bit_equal(second_world.blocks(ids[:5]), cold[:5])  # target and draft caches
    assert second.connector.stats()["store"].loaded_blocks == 5
    first.close()
    second.close()


def test_keys_name_namespace_group_and_hash_and_values_are_codec_bytes(url):
    driver = Driver(_connector(url), KVWorld())
    request, _, _ = store_request(driver, list(range(2 * B + 1)))
    admin = redis.Redis.from_url(url)
    ident = driver.connector.namespace.ident
    hashes = request.get_block_hashes(driver.mode.lookahead_tokens)
    expected = {f"speckv:{ident}:0:{h.hex()}".encode() for h in hashes[:2]}
    assert set(admin.keys("speckv:*")) == expected | {f"speckv:{ident}:namespace".encode()}
    for name in expected:
        assert admin.get(name).startswith(MAGIC)
    # the second write of a block is refused by SET NX, not a second copy
    again = Driver(_connector(url), KVWorld())
    store_request(again, list(range(2 * B + 1)))
    assert again.connector.stats()["store"].saved_blocks == 0
    admin.close()
    driver.close()
    again.close()


@pytest.mark.parametrize("change", ["fingerprint", "seed", "lookahead", "dtype", "no_draft"])
def test_different_namespaces_never_meet(url, change):
    writer = Driver(_connector(url), KVWorld())
    prompt = list(range(3 * B + 1))
    store_request(writer, prompt)
    kwargs = {"fingerprint": "model-b"} if change == "fingerprint" else {}
    if change == "seed":
        kwargs = {"seed": "1"}
    world = KVWorld(dtype=torch.bfloat16 if change == "dtype" else torch.float32,
                    with_draft=change != "no_draft")
    other = Driver(_connector(url, **kwargs), world,
                   lookahead_tokens=2 if change == "lookahead" else 1)
    assert other.connector.namespace.ident != writer.connector.namespace.ident
    assert _lookup(other, prompt) == 0
    writer.close()
    other.close()


def test_a_random_hash_seed_is_refused(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        StoreConnector("embedded", model_fingerprint="m", hash_algo="sha256", hash_seed=None)
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    connector = StoreConnector("embedded", model_fingerprint="m", hash_algo="sha256",
                               hash_seed=None)
    assert connector.hash_seed == "0"


@pytest.mark.parametrize("damage", ["flip_payload", "truncate", "garbage", "other_block"])
def test_a_damaged_value_is_a_counted_miss_deleted_and_never_loaded(url, damage):
    writer = Driver(_connector(url), KVWorld())
    prompt = list(range(3 * B + 1))
    request, _, cold = store_request(writer, prompt)
    admin = redis.Redis.from_url(url)
    name = _block_name(writer, request, 1)
    value = bytearray(admin.get(name))
    if damage == "flip_payload":
        value[-1] ^= 0xFF
    elif damage == "truncate":
        value = value[: len(value) // 2]
    elif damage == "garbage":
        value = bytearray(b"not a block at all")
    else:
        value = bytearray(admin.get(_block_name(writer, request, 2)))
    admin.set(name, bytes(value))

    reader_world = KVWorld()
    reader = Driver(_connector(url), reader_world)
    again = Req(prompt)
    hit, ids = reader.admit(again)
    assert hit == 3 * B  # EXISTS cannot see damage; the load checks every byte
    reader_world.zero(ids)
    _, output = reader.step([RequestBlocks(again, ids, 0)])
    (failure,) = output.load_failures
    assert failure.first_failed_token == B
    assert set(failure.block_ids) == set(ids[1:3])
    assert bit_equal(reader_world.blocks(ids[:1]), cold[:1])
    (block_1,) = reader_world.blocks([ids[1]])  # never written from the bad value
    assert all(not tensor.any() for tensor in block_1)
    stats = reader.connector.stats()["store"]
    assert stats.corrupt_blocks == 1 and stats.extra["store_invalid_values"] == 1
    assert admin.exists(name) == 0  # deleted: a correct block can take its place
    assert _lookup(reader, prompt) == B
    admin.close()
    writer.close()
    reader.close()


def test_a_block_evicted_between_lookup_and_load_shortens_the_hit(url):
    writer = Driver(_connector(url), KVWorld())
    prompt = list(range(4 * B + 1))
    request, _, cold = store_request(writer, prompt)
    reader_world = KVWorld()
    reader = Driver(_connector(url), reader_world)
    again = Req(prompt)
    hit, ids = reader.admit(again)
    assert hit == 4 * B
    admin = redis.Redis.from_url(url)
    admin.delete(_block_name(writer, request, 2))  # as an LRU eviction would
    _, output = reader.step([RequestBlocks(again, ids, 0)])
    (failure,) = output.load_failures
    assert failure.first_failed_token == 2 * B
    assert bit_equal(reader_world.blocks(ids[:2]), cold[:2])
    stats = reader.connector.stats()["store"]
    assert stats.loaded_blocks == 2 and stats.corrupt_blocks == 0
    admin.close()
    writer.close()
    reader.close()


def test_loads_use_one_mget_per_batch(url):
    writer = Driver(_connector(url), KVWorld(num_blocks=64))
    prompt = list(range(10 * B + 1))
    _, _, cold = store_request(writer, prompt)
    reader_world = KVWorld(num_blocks=64)
    connector = _connector(url, batch_blocks=4)
    reader = Driver(connector, reader_world)
    calls = []
    original = connector.redis_store._mget
    connector.redis_store._mget = lambda keys: calls.append(len(keys)) or original(keys)
    again = Req(prompt)
    hit, ids = reader.admit(again)
    assert hit == 10 * B
    _, output = reader.step([RequestBlocks(again, ids, 0)])
    assert not output.load_failures
    assert calls == [4, 4, 2]
    assert bit_equal(reader_world.blocks(ids[:10]), cold[:10])
    writer.close()
    reader.close()


def test_the_embedded_server_starts_with_the_connector_and_stops_with_it():
    connector = StoreConnector("embedded", 0.05, model_fingerprint="m", hash_algo="sha256",
                               hash_seed="0")
    driver = Driver(connector, KVWorld())
    server = connector.server
    assert server is not None and server.running
    admin = redis.Redis.from_url(server.url)
    config = admin.config_get("maxmemory*")
    assert int(config["maxmemory"]) == int(0.05 * (1 << 30))
    assert config["maxmemory-policy"] == "allkeys-lru"
    _, _, _ = store_request(driver, list(range(2 * B + 1)))
    assert _lookup(driver, list(range(2 * B + 1))) == 2 * B
    admin.close()
    driver.close()
    assert not server.running and connector.server is None
    # a stopped server refuses the connection at once; the timeout only bounds a hang, and a
    # timeout is what a dead store may raise too (the connector treats both as down)
    with pytest.raises((redis.ConnectionError, redis.TimeoutError)):
        redis.Redis.from_url(server.url, socket_connect_timeout=patience.WATCHDOG_S).ping()


def test_a_password_in_the_url_is_used_and_kept_out_of_messages():
    with EmbeddedValkey(64 * MIB, extra_args=("--requirepass", "s3cret")) as valkey:
        good = f"redis://:s3cret@127.0.0.1:{valkey.port}/0"
        driver = Driver(_connector(good), KVWorld())
        store_request(driver, list(range(2 * B + 1)))
        assert driver.connector.stats()["store"].saved_blocks == 2
        driver.close()
        bad = _connector(f"redis://:wrong@127.0.0.1:{valkey.port}/0")
        with pytest.raises(ConnectionError, match="--kv-store-url") as raised:
            Driver(bad, KVWorld())
        assert "wrong" not in str(raised.value) and "***" in str(raised.value)


# ---- faults --------------------------------------------------------------------------------
def test_an_unreachable_store_at_start_is_a_clear_error():
    port = free_loopback_port()
    connector = _connector(f"redis://127.0.0.1:{port}/0")
    with pytest.raises(ConnectionError, match="--kv-store-optional"):
        Driver(connector, KVWorld())


def test_a_store_that_never_answers_at_start_is_the_same_clear_error():
    # a socket that listens but never reads: the connection opens, the PING times out
    with socket.create_server(("127.0.0.1", 0)) as silent:
        url = f"redis://127.0.0.1:{silent.getsockname()[1]}/0"
        connector = _connector(url, timeout_s=0.2)  # not a wall limit: the timeout under test
        with pytest.raises(ConnectionError, match="--kv-store-optional") as raised:
            Driver(connector, KVWorld())
        assert isinstance(raised.value.__cause__.__cause__, redis.TimeoutError)
        optional = Driver(_connector(url, timeout_s=0.2, optional=True),  # not a wall limit
                          KVWorld())
        counters = optional.connector.stats()["store"].extra
        assert counters["store_up"] is False and counters["store_timeouts"] == 1
        optional.close()


def test_an_optional_store_starts_without_the_server_and_joins_when_it_appears(caplog):
    port = free_loopback_port()
    caplog.set_level(logging.WARNING, "speckv.connectors.store")
    driver = Driver(_connector(f"redis://127.0.0.1:{port}/0", optional=True), KVWorld())
    prompt = list(range(3 * B + 1))
    assert _lookup(driver, prompt) == 0
    store_request(driver, prompt)  # its saves fail quietly: counted, not raised
    assert "unreachable at start" in caplog.text
    stats = driver.connector.stats()["store"]
    assert stats.extra["store_up"] is False and stats.saved_blocks == 0
    with EmbeddedValkey(64 * MIB, port=port):
        assert _wait_until(lambda: _lookup(driver, [7, *prompt]) == 0
                           and driver.connector.stats()["store"].extra["store_up"])
        store_request(driver, [7, *prompt])
        assert _lookup(driver, [7, *prompt]) == 3 * B
        assert driver.connector.stats()["store"].extra["store_reconnects"] == 1
        assert "reachable again" in caplog.text
        driver.close()


def test_a_store_killed_mid_run_is_served_as_misses_then_reconnected(caplog):
    caplog.set_level(logging.WARNING, "speckv.connectors.store")
    valkey = EmbeddedValkey(64 * MIB).start()
    try:
        world = KVWorld()
        driver = Driver(_connector(valkey.url), world)
        prompt = list(range(3 * B + 1))
        _, ids, _ = store_request(driver, prompt)
        world.free(ids)
        assert _lookup(driver, prompt) == 3 * B

        valkey.kill()
        assert _lookup(driver, prompt) == 0  # a miss, not an exception
        other = [9, *prompt]
        _, ids, _ = store_request(driver, other)  # requests keep going; saves dropped
        world.free(ids)
        stats = driver.connector.stats()["store"]
        assert stats.extra["store_up"] is False
        assert stats.extra["store_outages"] == 1 and stats.extra["store_errors"] >= 1
        assert stats.save_errors >= 1
        assert "serving without it" in caplog.text

        valkey.start()  # the same port, empty (no persistence)
        assert _wait_until(lambda: (_lookup(driver, prompt), driver.connector.stats()[
            "store"].extra["store_up"])[1])
        _, ids, _ = store_request(driver, prompt)
        world.free(ids)
        assert _lookup(driver, prompt) == 3 * B
        stats = driver.connector.stats()["store"]
        assert stats.extra["store_reconnects"] == 1 and stats.extra["store_outages"] == 1
        assert "reachable again" in caplog.text
        driver.close()
    finally:
        valkey.stop()


def test_a_slow_store_times_out_per_call_and_misses(url):
    writer = Driver(_connector(url), KVWorld())
    prompt = list(range(3 * B + 1))
    store_request(writer, prompt)
    reader = Driver(_connector(url, timeout_s=0.2), KVWorld())  # not a wall limit: made to fire
    admin = redis.Redis.from_url(url)
    admin.client_pause(1500, all=True)  # every client's commands wait 1.5 s
    try:
        assert _lookup(reader, prompt) == 0
        stats = reader.connector.stats()["store"]
        assert stats.extra["store_timeouts"] >= 1
    finally:
        admin.client_unpause()
    assert _wait_until(lambda: _lookup(reader, prompt) == 3 * B)
    admin.close()
    writer.close()
    reader.close()


def test_a_full_store_evicts_least_recently_used_blocks_and_lookups_miss_them():
    # 72 KiB blocks, 8 MiB of memory, ~17 MiB stored: early prompts are evicted, no error
    with EmbeddedValkey(8 * MIB) as valkey:
        world = KVWorld(target_layers=8, num_kv_heads=4, head_dim=64)
        driver = Driver(_connector(valkey.url), world)
        prompts = [[p, *range(100, 100 + 4 * B)] for p in range(60)]
        for prompt in prompts:
            _, ids, _ = store_request(driver, prompt)
            world.free(ids)
        stats = driver.connector.stats()["store"]
        assert stats.save_errors == 0 and stats.saved_blocks == 60 * 4
        assert _lookup(driver, prompts[-1]) == 4 * B
        # Valkey's LRU is approximate (it evicts the oldest of a few sampled keys), so a single
        # early block may survive; the oldest sixth of the prompts must be mostly gone
        early_tokens = sum(_lookup(driver, prompt) for prompt in prompts[:10])
        assert early_tokens <= 10 * 4 * B // 4
        admin = redis.Redis.from_url(valkey.url)
        assert int(admin.info("stats")["evicted_keys"]) > 0
        admin.close()
        driver.close()


def test_reset_cache_deletes_this_namespace_only(url):
    mine = Driver(_connector(url), KVWorld())
    other = Driver(_connector(url, fingerprint="model-b"), KVWorld())
    prompt = list(range(3 * B + 1))
    store_request(mine, prompt)
    store_request(other, prompt)
    assert mine.connector.reset_cache()
    assert _lookup(mine, prompt) == 0
    assert _lookup(other, prompt) == 3 * B
    mine.close()
    other.close()


_CHILD = """
import sys
from tests.connectors.connector_helpers import Driver, KVWorld, store_request
from speckv.connectors import StoreConnector
connector = StoreConnector(sys.argv[1], model_fingerprint="model-a", hash_algo="sha256",
                           hash_seed=None)  # from PYTHONHASHSEED, as an engine would
driver = Driver(connector, KVWorld())
store_request(driver, list(range(int(sys.argv[2]))))
assert connector.stats()["store"].saved_blocks == int(sys.argv[3])
driver.close()
"""


def test_an_engine_in_another_process_gets_what_this_one_stored(url):
    """Two processes, as two engines: the child stores, this process loads bit-exact."""
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(root)}
    prompt = list(range(4 * B + 1))
    child = patience.run([sys.executable, "-c", _CHILD, url, str(len(prompt)), "4"],
                         cpu_budget_s=120, env=env, cwd=root)
    assert child.returncode == 0, child.stderr
    expected = KVWorld()  # the child's cold KV: the same seeded values into the same blocks
    expected_ids = expected.allocate(-(-len(prompt) // B))
    expected.write_cold_kv(expected_ids)
    reader_world = KVWorld()
    reader = Driver(_connector(url), reader_world)
    again = Req(prompt)
    hit, ids = reader.admit(again)
    assert hit == 4 * B
    _, output = reader.step([RequestBlocks(again, ids, 0)])
    assert not output.load_failures
    assert bit_equal(reader_world.blocks(ids[:4]), expected.blocks(expected_ids[:4]))
    reader.close()
