"""MultiConnector ("offload,disk") and the config, flags and factory that build connectors."""

from __future__ import annotations

import argparse

import pytest
import torch

from speckv.connectors import (
    MEDIUM_CPU,
    MEDIUM_DISK,
    ConnectorConfig,
    DiskConnector,
    MultiConnector,
    MultiConnectorMetadata,
    NoLookaheadOffloadConnector,
    OffloadConnector,
    RequestBlocks,
    TierIdentity,
    add_connector_arguments,
    connector_config_from_args,
    make_connector,
)
from speckv.connectors.rules import describe_block
from tests.connectors.connector_helpers import (
    BLOCK_SIZE,
    Driver,
    KVWorld,
    Req,
    bit_equal,
    store_request,
    tier_gib,
)
from tests.patience import WATCHDOG_S

B = BLOCK_SIZE
IDENTITY = TierIdentity("model-a", "sha256", "0")


def _offload_disk(world, tmp_path, cpu_blocks=64) -> MultiConnector:
    config = ConnectorConfig(("offload", "disk"), offload_gib=tier_gib(world, cpu_blocks),
                             offload_dir=str(tmp_path))
    connector = make_connector(config, IDENTITY)
    assert isinstance(connector, MultiConnector)
    return connector


def test_offload_disk_stores_both_and_the_faster_tier_serves_ties(tmp_path):
    world = KVWorld()
    driver = Driver(_offload_disk(world, tmp_path), world)
    prompt = list(range(3 * B + 1))
    _, _, cold = store_request(driver, prompt)
    stats = driver.connector.stats()
    assert stats["offload"].saved_blocks == 3 and stats["disk"].saved_blocks == 3
    reader = Req(prompt)
    assert driver.connector.get_num_new_matched_tokens(reader, 0).medium == MEDIUM_CPU
    hit, ids = driver.admit(reader)
    assert hit == 3 * B
    meta, output = driver.step([RequestBlocks(reader, ids, 0)])
    assert isinstance(meta, MultiConnectorMetadata)
    assert [len(child.loads) for child in meta.children] == [1, 0]
    assert not output.load_failures
    assert bit_equal(world.blocks(ids[:3]), cold[:3])
    stats = driver.connector.stats()
    assert (stats["offload"].loaded_blocks, stats["disk"].loaded_blocks) == (3, 0)
    # the writer's, the probe above, the reader's admission; asking again at allocation is
    # not a lookup
    assert (stats["offload"].lookups, stats["offload"].hit_blocks) == (3, 6)
    driver.close()


def test_the_disk_tier_recovers_what_the_cpu_tier_evicted(tmp_path):
    world = KVWorld()
    driver = Driver(_offload_disk(world, tmp_path, cpu_blocks=2), world)
    prompt = list(range(4 * B + 1))
    _, _, cold = store_request(driver, prompt)
    assert driver.connector.stats()["offload"].evicted_blocks == 2
    reader = Req(prompt)
    hit = driver.connector.get_num_new_matched_tokens(reader, 0)
    assert (hit.num_tokens, hit.medium) == (4 * B, MEDIUM_DISK)
    _, ids = driver.admit(reader)
    world.zero(ids)
    _, output = driver.step([RequestBlocks(reader, ids, 0)])
    assert not output.load_failures
    assert bit_equal(world.blocks(ids[:4]), cold[:4])
    assert driver.connector.stats()["disk"].loaded_blocks == 4
    driver.close()


def test_a_sibling_never_saves_blocks_that_are_being_loaded_in_the_same_step(tmp_path):
    """The CPU tier loads a request's hit while the disk tier lacks those blocks: the disk
    tier must save them only after the load, not the stale bytes of the reused blocks."""
    world = KVWorld()
    driver = Driver(_offload_disk(world, tmp_path), world)
    prompt = list(range(3 * B + 1))
    _, first_ids, cold = store_request(driver, prompt)
    disk = driver.connector.children[1]
    assert disk.reset_cache()
    world.free(first_ids)
    reader = Req(prompt)
    hit, ids = driver.admit(reader)
    assert hit == 3 * B
    world.write_cold_kv(ids)  # whatever the reused blocks held before: not this prompt's KV
    # the engine counts the hit as computed when it schedules the request
    meta, _ = driver.step([RequestBlocks(reader, ids, 3 * B)])
    assert [len(child.saves) for child in meta.children] == [0, 0]
    assert bit_equal(world.blocks(ids[:3]), cold[:3])
    meta, _ = driver.step([RequestBlocks(reader, ids, 3 * B)])  # next step: now it saves
    assert [sum(len(s.blocks) for s in child.saves) for child in meta.children] == [0, 3]
    assert driver.connector.flush(timeout_s=WATCHDOG_S)
    hashes = reader.get_block_hashes(1)
    for index in range(3):
        block = describe_block(reader, hashes, index, driver.mode)
        stored = disk.store.get(block)
        assert bit_equal([tuple(stored)], [cold[index]])
    driver.close()


def test_a_child_without_the_capability_puts_every_child_on_the_drop(tmp_path):
    world = KVWorld()
    children = [NoLookaheadOffloadConnector(tier_gib(world, 64)),
                DiskConnector(tmp_path, 1.0, model_fingerprint="m", hash_algo="sha256",
                              hash_seed="0")]
    multi = MultiConnector(children)
    assert not multi.supports_lookahead_block_hashes
    driver = Driver(multi, world, lookahead_tokens=0, drops_last_block=True)
    prompt = list(range(4 * B + 1))
    store_request(driver, prompt + [1], written=4 * B + 1)
    reader = Req(prompt)
    for child in children:  # each child leaves out the unverified last block
        assert child.get_num_new_matched_tokens(reader, 0).num_tokens == 3 * B
    assert driver.admit(reader)[0] == 3 * B
    driver.close()


def test_finished_saves_are_reported_once_every_child_settled(tmp_path):
    world = KVWorld()
    driver = Driver(_offload_disk(world, tmp_path), world)
    request = Req(list(range(2 * B + 1)))
    _, ids = driver.admit(request)
    world.write_cold_kv(ids)
    driver.finish(request, ids, 2 * B)
    assert driver.connector.flush(timeout_s=WATCHDOG_S)
    output = driver.connector.get_finished()
    assert output.finished_saves == {request.request_id}
    assert driver.connector.get_finished().finished_saves == frozenset()
    driver.close()


def test_failures_of_the_loading_child_surface(tmp_path):
    world = KVWorld()
    connector = make_connector(ConnectorConfig(("disk",), offload_dir=str(tmp_path)), IDENTITY)
    driver = Driver(MultiConnector([connector]), world)
    prompt = list(range(2 * B + 1))
    store_request(driver, prompt)
    for path in connector.store.directory.glob("*/*.kvb"):
        path.write_bytes(path.read_bytes()[:10])
    reader = Req(prompt)
    hit, ids = driver.admit(reader)
    _, output = driver.step([RequestBlocks(reader, ids, 0)])
    assert hit == 2 * B and output.failed_block_ids == frozenset(ids[:2])
    driver.close()


# ---- config, flags, factory ----------------------------------------------------------------

def test_the_factory_builds_what_the_names_say(tmp_path):
    assert isinstance(make_connector(ConnectorConfig.parse("offload")), OffloadConnector)
    assert isinstance(make_connector(ConnectorConfig.parse(" offload-nolookahead ")),
                      NoLookaheadOffloadConnector)
    disk = make_connector(ConnectorConfig.parse("disk", offload_dir=str(tmp_path)), IDENTITY)
    assert isinstance(disk, DiskConnector) and disk.hash_seed == "0"
    multi = make_connector(ConnectorConfig.parse("offload,disk", offload_dir=str(tmp_path)),
                           IDENTITY)
    assert [child.name for child in multi.children] == ["offload", "disk"]
    assert multi.name == "offload,disk"
    with pytest.raises(ValueError, match="TierIdentity"):
        make_connector(ConnectorConfig.parse("disk", offload_dir=str(tmp_path)))


@pytest.mark.parametrize(("spec", "options", "message"), [
    ("", {}, "at least one"),
    ("offload,lmcache", {}, "unknown connector 'lmcache'"),
    ("offload,offload", {}, "twice"),
    ("offload,offload-nolookahead", {}, "not both"),
    ("disk", {}, "--kv-offload-dir"),
    ("offload", {"offload_gib": 0}, "--kv-offload-gib"),
    ("offload", {"offload_gib": "4"}, "--kv-offload-gib"),
    ("disk", {"offload_dir": "/tmp/x", "disk_gib": -1}, "--kv-offload-disk-gib"),
    ("offload", {"max_pending_blocks": 0}, "max_pending_blocks"),
])
def test_bad_configs_name_the_flag(spec, options, message):
    with pytest.raises(ValueError, match=message):
        ConnectorConfig.parse(spec, **options)


def test_the_config_is_frozen():
    config = ConnectorConfig.parse("offload")
    with pytest.raises(AttributeError):
        config.offload_gib = 1.0  # type: ignore[misc]


def test_the_cli_flags(tmp_path):
    parser = argparse.ArgumentParser()
    add_connector_arguments(parser)
    args = parser.parse_args(["--kv-connector", "offload,disk", "--kv-offload-gib", "2",
                              "--kv-offload-dir", str(tmp_path), "--kv-offload-disk-gib", "8"])
    config = connector_config_from_args(args)
    assert config == ConnectorConfig(("offload", "disk"), 2.0, str(tmp_path), 8.0)
    assert connector_config_from_args(parser.parse_args([])) is None
    with pytest.raises(ValueError, match="needs --kv-connector"):
        connector_config_from_args(parser.parse_args(["--kv-offload-dir", str(tmp_path)]))


def test_initialize_twice_or_use_before_is_an_error():
    connector = OffloadConnector(0.01)
    with pytest.raises(RuntimeError, match="before initialize"):
        connector.get_num_new_matched_tokens(Req([1, 2, 3]), 0)
    world = KVWorld(dtype=torch.float32)
    driver = Driver(connector, world)
    with pytest.raises(RuntimeError, match="already initialized"):
        connector.initialize(world.kv, driver.mode)
    driver.close()
