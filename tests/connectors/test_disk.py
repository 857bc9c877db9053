"""The disk tier: files, restart persistence, namespaces, checks on load, the size bound."""

from __future__ import annotations

import os
import time

import pytest
import torch

from speckv.cache.events import BlockStored
from speckv.connectors import MEDIUM_DISK, DiskConnector, RequestBlocks
from speckv.connectors.codec import MissReason
from speckv.connectors.disk import NAMESPACE_FILE, SUFFIX, block_path
from tests.connectors.connector_helpers import (
    BLOCK_SIZE,
    DEVICES,
    Driver,
    KVWorld,
    Req,
    bit_equal,
    block_of,
    store_request,
)

B = BLOCK_SIZE


def _connector(directory, size_gib=1.0, fingerprint="model-a", seed="0", **kw):
    return DiskConnector(directory, size_gib, model_fingerprint=fingerprint,
                         hash_algo="sha256", hash_seed=seed, **kw)


def _files(driver: Driver) -> list:
    return sorted(driver.connector.store.directory.glob(f"*/*{SUFFIX}"))


def _block_file(driver: Driver, request: Req, index: int):
    return block_path(driver.connector.store.directory, block_of(driver, request, index).key)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_new_connector_over_the_same_directory_hits_bit_exact(tmp_path, dtype, device):
    world = KVWorld(dtype=dtype, device=device)
    first = Driver(_connector(tmp_path), world)
    prompt = list(range(3 * B + 1))
    _, ids, cold = store_request(first, prompt)
    assert len(_files(first)) == 3
    assert (first.connector.store.directory / NAMESPACE_FILE).exists()
    events = first.connector.take_events()
    assert all(isinstance(e, BlockStored) and e.medium == MEDIUM_DISK for e in events)
    first.close()

    restarted = KVWorld(dtype=dtype, device=device)  # a fresh process: empty device caches
    second = Driver(_connector(tmp_path), restarted)
    reader = Req(prompt)
    hit, ids = second.admit(reader)
    assert hit == 3 * B
    _, output = second.step([RequestBlocks(reader, ids, 0)])
    assert not output.load_failures
    assert bit_equal(restarted.blocks(ids[:3]), cold[:3])
    assert second.connector.stats()["disk"].loaded_blocks == 3
    second.close()


@pytest.mark.parametrize("change", ["fingerprint", "seed", "lookahead", "dtype", "no_draft"])
def test_another_setup_never_meets_these_blocks(tmp_path, change):
    world = KVWorld()
    writer = Driver(_connector(tmp_path), world)
    prompt = list(range(3 * B + 1))
    store_request(writer, prompt)
    writer.close()

    kwargs = {"fingerprint": "model-b"} if change == "fingerprint" else {}
    if change == "seed":
        kwargs = {"seed": "1"}
    other_world = KVWorld(dtype=torch.bfloat16 if change == "dtype" else torch.float32,
                          with_draft=change != "no_draft")
    lookahead = 2 if change == "lookahead" else 1
    reader = Driver(_connector(tmp_path, **kwargs), other_world, lookahead_tokens=lookahead)
    assert reader.connector.store.directory != writer.connector.store.directory
    # the same seed gives the same hashes: only the namespace keeps the blocks apart
    hit, _ = reader.admit(Req(prompt, seed=kwargs.get("seed", "0")))
    assert hit == 0
    reader.close()


def test_a_random_hash_seed_is_refused_with_the_fix(tmp_path, monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ValueError, match=r"PYTHONHASHSEED.*hash_seed"):
        _connector(tmp_path, seed=None)
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert _connector(tmp_path, seed=None).hash_seed == "7"


def _corrupt_flip(path):
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))


def _corrupt_truncate(path):
    path.write_bytes(path.read_bytes()[:-7])


def _corrupt_header(path):
    data = bytearray(path.read_bytes())
    data[20:40] = b"\xc1" * 20  # 0xc1 is never valid msgpack
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("damage", "reason"), [
    (_corrupt_flip, MissReason.CHECKSUM_MISMATCH),
    (_corrupt_truncate, MissReason.TRUNCATED),
    (_corrupt_header, MissReason.BAD_HEADER),
])
def test_a_damaged_file_is_a_counted_miss_and_is_deleted(tmp_path, damage, reason):
    world = KVWorld()
    driver = Driver(_connector(tmp_path), world)
    prompt = list(range(4 * B + 1))
    _, _, cold = store_request(driver, prompt)
    reader = Req(prompt)
    damaged = _block_file(driver, reader, 2)
    damage(damaged)

    hit, ids = driver.admit(reader)
    assert hit == 4 * B  # the index cannot know; the load finds out
    world.zero(ids)
    _, output = driver.step([RequestBlocks(reader, ids, 0)])
    (failure,) = output.load_failures
    assert reason.value in failure.reason
    assert failure.first_failed_token == 2 * B and failure.block_ids == tuple(ids[2:4])
    assert bit_equal(world.blocks(ids[:2]), cold[:2])  # the blocks before it were loaded
    assert torch.count_nonzero(world.target.storage[:, :, ids[2:4]]) == 0
    assert torch.count_nonzero(world.draft.storage[:, :, ids[2:4]]) == 0
    assert not damaged.exists()
    stats = driver.connector.stats()["disk"]
    assert stats.corrupt_blocks == 1 and stats.load_failed_blocks == 2
    assert driver.connector.get_num_new_matched_tokens(Req(prompt), 0).num_tokens == 2 * B
    driver.close()


def test_a_file_from_a_foreign_namespace_is_a_counted_miss(tmp_path):
    world = KVWorld()
    prompt = list(range(2 * B + 1))
    foreign = Driver(_connector(tmp_path, fingerprint="model-b"), world)
    store_request(foreign, prompt)
    foreign.close()
    ours = Driver(_connector(tmp_path), KVWorld())
    # a copied file lands under our namespace with the name our lookup will ask for
    request = Req(prompt)
    source = _block_file(foreign, request, 0)
    target = _block_file(ours, request, 0)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(source.read_bytes())
    hit, ids = ours.admit(request)
    assert hit == B
    _, output = ours.step([RequestBlocks(request, ids, 0)])
    (failure,) = output.load_failures
    assert MissReason.NAMESPACE_MISMATCH.value in failure.reason
    assert not target.exists() and source.exists()
    assert ours.connector.stats()["disk"].corrupt_blocks == 1
    ours.close()


def test_the_size_bound_evicts_the_oldest_files_first(tmp_path):
    world = KVWorld()
    probe = Driver(_connector(tmp_path / "probe"), KVWorld())
    store_request(probe, list(range(B + 1)))
    file_bytes = _files(probe)[0].stat().st_size
    probe.close()

    size_gib = (3 * file_bytes + file_bytes // 2) / (1 << 30)  # room for three files
    driver = Driver(_connector(tmp_path / "bounded", size_gib), world)
    old = list(range(2 * B + 1))
    store_request(driver, old)
    time.sleep(0.01)
    new = list(range(1000, 1000 + 2 * B + 1))
    store_request(driver, new)
    assert len(_files(driver)) == 3
    assert driver.admit(Req(old))[0] == 0  # its first block went first: nothing to chain
    assert driver.admit(Req(new))[0] == 2 * B
    assert driver.connector.stats()["disk"].evicted_blocks == 1
    driver.close()

    # a restart with a smaller bound trims the oldest files at start
    smaller = (1 * file_bytes + file_bytes // 2) / (1 << 30)
    trimmed = Driver(_connector(tmp_path / "bounded", smaller), KVWorld())
    assert len(_files(trimmed)) == 1
    trimmed.close()


def test_a_crashed_writers_temp_files_are_cleaned_at_start(tmp_path):
    world = KVWorld()
    driver = Driver(_connector(tmp_path), world)
    store_request(driver, list(range(B + 1)))
    block_file = _files(driver)[0]
    leftover = block_file.with_name(f".{block_file.name}.1.2.tmp")
    leftover.write_bytes(b"partial")
    fresh = block_file.with_name(f".{block_file.name}.3.4.tmp")
    fresh.write_bytes(b"being written")
    old = time.time() - 7200
    os.utime(leftover, (old, old))
    driver.close()
    restarted = Driver(_connector(tmp_path), KVWorld())
    assert not leftover.exists() and fresh.exists()
    assert restarted.admit(Req(list(range(B + 1))))[0] == B
    restarted.close()


def test_a_damaged_namespace_file_is_refused(tmp_path):
    driver = Driver(_connector(tmp_path), KVWorld())
    namespace_file = driver.connector.store.directory / NAMESPACE_FILE
    driver.close()
    namespace_file.write_text('{"model_fingerprint": "something else"}')
    with pytest.raises(ValueError, match="another setup"):
        Driver(_connector(tmp_path), KVWorld())


def test_bad_settings_name_the_flag(tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(ValueError, match="--kv-offload-dir"):
        _connector(a_file)
    with pytest.raises(ValueError, match="--kv-offload-disk-gib"):
        _connector(tmp_path, size_gib=0)
    with pytest.raises(ValueError, match="--kv-offload-disk-gib"):
        Driver(_connector(tmp_path, size_gib=1e-9), KVWorld())


def test_a_lookup_while_a_store_evicts_does_not_resurrect_the_evicted_file(tmp_path,
                                                                           monkeypatch):
    """The copy thread drops an evicted key from the index, then unlinks its file. A lookup on
    the engine thread in between must miss it: taking the file for another process's block
    put the key back in the index after the file was gone (a phantom entry, wrong size
    accounting, and a hit that fails to load)."""
    from speckv.connectors.disk import DiskBlockStore
    from tests.connectors.connector_helpers import tier_gib

    world = KVWorld()
    # two block files (a file is its header + the raw KV: a little over one layout block)
    driver = Driver(_connector(tmp_path, size_gib=tier_gib(world, 3)), world)
    try:
        first, _, _ = store_request(driver, list(range(2 * B + 1)))
        victims = [block_of(driver, first, index).key for index in range(2)]
        store = driver.connector.store
        seen_in_window: list[bool] = []
        unlink = DiskBlockStore._drop_files

        def lookup_then_drop(self, keys):
            seen_in_window.extend(self.contains(key) for key in keys)  # the engine thread
            unlink(self, keys)

        monkeypatch.setattr(DiskBlockStore, "_drop_files", lookup_then_drop)
        store_request(driver, [50 + t for t in range(2 * B + 1)])  # evicts both
        assert seen_in_window == [False, False]
        assert not any(store.contains(key) for key in victims)
        files = sorted(store.directory.glob(f"*/*{SUFFIX}"))
        usage = store.usage()
        assert usage.resident_blocks == len(files) == 2
        assert usage.resident_bytes == sum(os.path.getsize(path) for path in files)
    finally:
        driver.close()
