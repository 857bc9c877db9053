"""The store tier's configuration (flags, URL rules, errors naming the flag), its composition
with the CPU tier (`offload,store`), and Redis Cluster (three real valkey-server nodes)."""

from __future__ import annotations

import argparse
import socket

import pytest
import redis

from speckv.connectors import (
    ConnectorConfig,
    MultiConnector,
    OffloadConnector,
    RequestBlocks,
    StoreConnector,
    TierIdentity,
    add_connector_arguments,
    connector_config_from_args,
    make_connector,
)
from speckv.connectors.embedded_valkey import EmbeddedValkey, free_loopback_port
from speckv.connectors.redis_store import StoreEndpoint
from tests.connectors.connector_helpers import (
    BLOCK_SIZE,
    Driver,
    KVWorld,
    Req,
    bit_equal,
    store_request,
)
from tests.patience import wait_until

B = BLOCK_SIZE
MIB = 1 << 20
IDENTITY = TierIdentity("model-a", "sha256", "0")


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_connector_arguments(parser)
    return connector_config_from_args(parser.parse_args(argv))


def test_the_store_flags():
    config = _parse(["--kv-connector", "offload,store", "--kv-store-url",
                     "redis://:pw@10.0.0.5:6380/2", "--kv-store-optional",
                     "--kv-store-timeout", "0.5"])
    assert config.names == ("offload", "store")
    assert config.store_url == "redis://:pw@10.0.0.5:6380/2"
    assert config.store_optional and config.store_timeout_s == 0.5
    embedded = _parse(["--kv-connector", "store", "--kv-store-gib", "2"])
    assert embedded.store_url == "embedded" and embedded.store_gib == 2.0
    cluster = _parse(["--kv-connector", "store", "--kv-store-url", "redis://n1:7000",
                      "--kv-store-cluster"])
    assert cluster.store_cluster


@pytest.mark.parametrize(("argv", "message"), [
    (["--kv-store-url", "redis://h:1"], "--kv-connector store"),
    (["--kv-connector", "offload", "--kv-store-optional"], "store in --kv-connector"),
    (["--kv-connector", "store", "--kv-store-gib", "0"], "--kv-store-gib"),
    (["--kv-connector", "store", "--kv-store-timeout", "-1"], "--kv-store-timeout"),
    (["--kv-connector", "store", "--kv-store-cluster"], "--kv-store-cluster"),
    (["--kv-connector", "stor"], "unknown connector 'stor'"),
])
def test_bad_store_flags_name_the_flag(argv, message):
    with pytest.raises(ValueError, match=message):
        _parse(argv)


@pytest.mark.parametrize("url", ["http://h:1", "valkey//h", "h:6379"])
def test_a_bad_url_names_the_flag_at_construction(url):
    config = ConnectorConfig(("store",), store_url=url)
    with pytest.raises(ValueError, match="--kv-store-url"):
        make_connector(config, IDENTITY)


def test_url_forms():
    assert StoreEndpoint("redis+cluster://n1:7000").cluster
    assert StoreEndpoint("redis+cluster://n1:7000").url == "redis://n1:7000"
    assert StoreEndpoint("rediss+cluster://n1:7000").url == "rediss://n1:7000"
    assert not StoreEndpoint("rediss://n1:7000/1").cluster
    assert StoreEndpoint("redis://:pw@h:1/0").redacted_url == "redis://:***@h:1/0"
    assert StoreEndpoint("redis://user:pw@h/0").redacted_url == "redis://user:***@h/0"
    with pytest.raises(ValueError, match="database 0"):
        StoreEndpoint("redis://h:1/3", cluster=True)


def test_the_store_needs_the_engine_identity():
    with pytest.raises(ValueError, match="TierIdentity"):
        make_connector(ConnectorConfig(("store",)))
    built = make_connector(ConnectorConfig(("offload", "store"), store_url="redis://h:1"),
                           IDENTITY)
    assert isinstance(built, MultiConnector)
    assert [type(c) for c in built.children] == [OffloadConnector, StoreConnector]
    assert built.supports_lookahead_block_hashes


def test_offload_store_a_second_engine_hits_what_the_first_stored():
    with EmbeddedValkey(64 * MIB) as valkey:
        config = ConnectorConfig(("offload", "store"), offload_gib=0.01, store_url=valkey.url)
        first = Driver(make_connector(config, IDENTITY), KVWorld())
        prompt = list(range(4 * B + 1))
        _, _, cold = store_request(first, prompt)
        second_world = KVWorld()
        second = Driver(make_connector(config, IDENTITY), second_world)
        reader = Req(prompt)
        hit, ids = second.admit(reader)
        assert hit == 4 * B  # its own CPU tier is empty: the store serves
        _, output = second.step([RequestBlocks(reader, ids, 0)])
        assert not output.load_failures
        assert bit_equal(second_world.blocks(ids[:4]), cold[:4])
        stats = second.connector.stats()
        assert stats["store"].loaded_blocks == 4 and stats["offload"].loaded_blocks == 0
        first.close()
        second.close()


def _port_is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _start_cluster(num_nodes: int = 3) -> list[EmbeddedValkey]:
    """Three primaries sharing the 16384 slots, meeting over loopback."""
    nodes = []
    while len(nodes) < num_nodes:
        port = free_loopback_port()
        if port + 10000 > 65535 or not _port_is_free(port + 10000):  # the cluster bus port
            continue
        nodes.append(EmbeddedValkey(64 * MIB, port=port, extra_args=(
            "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
        )).start())
    clients = [redis.Redis(port=node.port) for node in nodes]
    per_node = 16384 // num_nodes
    for index, client in enumerate(clients):
        first = index * per_node
        last = 16383 if index == num_nodes - 1 else first + per_node - 1
        client.execute_command("CLUSTER", "ADDSLOTSRANGE", first, last)
    for client in clients[1:]:
        client.execute_command("CLUSTER", "MEET", "127.0.0.1", nodes[0].port)
    def cluster_ok() -> bool:
        states = [c.execute_command("CLUSTER", "INFO") for c in clients]
        return all(b"cluster_state:ok" in (s if isinstance(s, bytes) else s.encode())
                   for s in states)

    wait_until(cluster_ok, "the test cluster reaches cluster_state:ok", poll_s=0.1)
    for client in clients:
        client.close()
    return nodes


def test_a_redis_cluster_spreads_blocks_over_nodes_and_serves_them():
    nodes = _start_cluster()
    try:
        url = f"redis+cluster://127.0.0.1:{nodes[0].port}"
        writer = Driver(StoreConnector(url, model_fingerprint="m", hash_algo="sha256",
                                       hash_seed="0"), KVWorld(num_blocks=64))
        prompt = list(range(12 * B + 1))
        _, _, cold = store_request(writer, prompt)
        assert writer.connector.stats()["store"].saved_blocks == 12
        per_node = [redis.Redis(port=n.port).dbsize() for n in nodes]
        assert sum(per_node) == 13 and sum(1 for n in per_node if n) >= 2  # + namespace key
        reader_world = KVWorld(num_blocks=64)
        reader = Driver(StoreConnector(f"redis://127.0.0.1:{nodes[1].port}", cluster=True,
                                       model_fingerprint="m", hash_algo="sha256",
                                       hash_seed="0", batch_blocks=5), reader_world)
        again = Req(prompt)
        hit, ids = reader.admit(again)
        assert hit == 12 * B
        _, output = reader.step([RequestBlocks(again, ids, 0)])
        assert not output.load_failures
        assert bit_equal(reader_world.blocks(ids[:12]), cold[:12])
        assert reader.connector.stats()["store"].resident_blocks == 13
        assert len(reader.connector.store.clear()) == 12
        writer.close()
        reader.close()
    finally:
        for node in nodes:
            node.stop()
