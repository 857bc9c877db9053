"""A seeded random workload through the tiers, in the engine's call order, with the copy thread
running concurrently: requests sharing prefixes arrive, hit the tier, decode a few tokens,
finish; blocks are freed and reused at once; the tiers are small (evictions) and the copy
queue short (dropped stores).

After every step: each block a load served holds exactly the KV a cold run writes for its
content (keyed by the lookahead hash, so the draft KV's successor is part of the content), and
failures are reported as a suffix of the load, which the "engine" recomputes.
"""

from __future__ import annotations

import random

import pytest
import torch

from speckv.connectors import (
    ConnectorConfig,
    MultiConnector,
    RequestBlocks,
    TierIdentity,
    make_connector,
)
from tests.connectors.connector_helpers import (
    BLOCK_SIZE,
    Driver,
    KVWorld,
    Req,
    tier_gib,
)
from tests.patience import WATCHDOG_S

B = BLOCK_SIZE


def _cold_kv(world: KVWorld, block_hash: bytes) -> tuple[torch.Tensor, ...]:
    """The KV a cold run writes for a block: a function of its content only."""
    generator = torch.Generator().manual_seed(int.from_bytes(block_hash[:8], "little"))
    return tuple(
        torch.randn(cache.storage[:, :, 0].shape, generator=generator).to(cache.dtype)
        for cache in world.caches
    )


def _write(world: KVWorld, block_id: int, kv: tuple[torch.Tensor, ...]) -> None:
    for cache, data in zip(world.caches, kv):
        cache.storage[:, :, block_id] = data


def _holds(world: KVWorld, block_id: int, kv: tuple[torch.Tensor, ...]) -> bool:
    return all(torch.equal(cache.storage[:, :, block_id], data)
               for cache, data in zip(world.caches, kv))


class _Running:
    def __init__(self, request: Req, block_ids: list[int], num_written_blocks: int,
                 max_new: int) -> None:
        self.request = request
        self.block_ids = block_ids
        self.num_written_blocks = num_written_blocks  # blocks whose KV is in the device
        self.remaining = max_new


def _run(driver: Driver, seed: int, steps: int) -> None:
    rng = random.Random(seed)
    world = driver.world
    prefixes = [[rng.randrange(50) for _ in range(rng.choice([2, 3, 4]) * B)]
                for _ in range(4)]
    running: list[_Running] = []
    served = 0
    for _ in range(steps):
        new: list[tuple[_Running, int]] = []
        if len(running) < 4 and rng.random() < 0.7:
            prompt = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(6))]
            request = Req(prompt)
            capacity = -(-(len(prompt) + 4) // B)
            hit, ids = driver.admit(request, block_ids=world.allocate(capacity))
            item = _Running(request, ids, hit // B, rng.randrange(1, 4))
            running.append(item)
            new.append((item, hit // B))
        # as the engine will: a new request counts its hit as computed (item.start), a
        # running one every token but the last real one
        new_items = [item for item, _ in new]
        scheduled = [RequestBlocks(r.request, r.block_ids, r.num_written_blocks * B
                                   if r in new_items else r.request.num_tokens - 1)
                     for r in running]
        _, output = driver.step(scheduled)
        failures = {f.request_id: f for f in output.load_failures}
        for item, loaded in new:
            hashes = item.request.get_block_hashes(1)
            failure = failures.get(item.request.request_id)
            ok = loaded if failure is None else failure.first_failed_token // B
            if failure is not None:
                assert failure.block_ids == tuple(item.block_ids[ok:loaded])
            for index in range(ok):
                assert _holds(world, item.block_ids[index], _cold_kv(world, hashes[index]))
            served += ok
            item.num_written_blocks = ok  # the engine recomputes from the failure
        # the "forward": compute the prompt, sample a token, the drafter writes draft KV
        for item in running:
            item.request.append([rng.randrange(50)])
            item.remaining -= 1
            hashes = item.request.get_block_hashes(1)
            for index in range(item.num_written_blocks, len(hashes)):
                _write(world, item.block_ids[index], _cold_kv(world, hashes[index]))
            item.num_written_blocks = len(hashes)
        for item in [r for r in running if r.remaining == 0]:
            running.remove(item)
            driver.finish(item.request, item.block_ids, item.request.num_tokens - 1)
            world.free(item.block_ids)
    assert served > 0
    assert driver.connector.flush(timeout_s=WATCHDOG_S)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_soak_offload(seed):
    world = KVWorld(num_blocks=256)
    config = ConnectorConfig(("offload",), offload_gib=tier_gib(world, 10), max_pending_blocks=3)
    driver = Driver(make_connector(config), world)
    _run(driver, seed, steps=80)
    stats = driver.connector.stats()["offload"]
    assert stats.loaded_blocks > 0
    # more blocks landed than the tier holds: it evicted. (How many land depends on the copy
    # thread keeping up with a 3-block queue; on a loaded machine most stores are dropped.)
    assert stats.saved_blocks <= 10 or stats.evicted_blocks > 0
    assert stats.saved_blocks > 10 or stats.save_dropped_queue_full > 0
    assert stats.resident_blocks <= 10
    driver.close()


@pytest.mark.parametrize("seed", [3, 4])
def test_soak_offload_disk(seed, tmp_path):
    world = KVWorld(num_blocks=256)
    config = ConnectorConfig(("offload", "disk"), offload_gib=tier_gib(world, 6),
                             offload_dir=str(tmp_path), disk_gib=tier_gib(world, 30) * 1.5,
                             max_pending_blocks=4)
    connector = make_connector(config, TierIdentity("m", "sha256", "0"))
    assert isinstance(connector, MultiConnector)
    driver = Driver(connector, world)
    _run(driver, seed, steps=80)
    stats = driver.connector.stats()
    assert stats["offload"].evicted_blocks > 0 and stats["disk"].saved_blocks > 0
    driver.close()
