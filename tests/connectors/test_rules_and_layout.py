"""The pure length rules, block descriptors, and the device copies of whole blocks."""

from __future__ import annotations

import pytest
import torch

from speckv.attention import PagedKVCache
from speckv.connectors import DeviceKV
from speckv.connectors.layout import BlockLayout
from speckv.connectors.rules import (
    ConnectorMode,
    describe_block,
    num_lookup_candidates,
    num_servable_blocks,
    num_storable_blocks,
)
from speckv.hashing.extra_keys import HashInputs, MultiModalItem
from tests.connectors.connector_helpers import DEVICES, KVWorld, Req, bit_equal

LOOKAHEAD = ConnectorMode(1, False, 4)
LEGACY_DROP = ConnectorMode(0, True, 4)
LEGACY = ConnectorMode(0, False, 4)


@pytest.mark.parametrize(("num_tokens", "num_hashes", "expected"), [
    (17, 4, 4),  # the hashes bound it
    (16, 4, 3),  # N - 1 bounds it: the last prompt token is always recomputed
    (17, 2, 2),
    (1, 0, 0),
    (4, 1, 0),
])
def test_lookup_candidates(num_tokens, num_hashes, expected):
    assert num_lookup_candidates(num_tokens, num_hashes, 4) == expected


def test_servable_blocks_drop_one_under_legacy_only():
    assert [num_servable_blocks(run, LOOKAHEAD) for run in range(4)] == [0, 1, 2, 3]
    assert [num_servable_blocks(run, LEGACY_DROP) for run in range(4)] == [0, 0, 1, 2]
    assert [num_servable_blocks(run, LEGACY) for run in range(4)] == [0, 1, 2, 3]


@pytest.mark.parametrize(("mode", "num_hashes", "written", "num_tokens", "expected"), [
    (LOOKAHEAD, 3, 16, 17, 3),  # capped by the hashes: len(block_hashes) * B tokens
    (LOOKAHEAD, 5, 11, 17, 2),  # capped by what is written
    (LEGACY_DROP, 4, 16, 17, 4),  # every block has its successor token
    (LEGACY_DROP, 4, 16, 16, 3),  # block 3 has none yet: the unverified last block
    (LEGACY, 4, 16, 16, 4),
])
def test_storable_blocks(mode, num_hashes, written, num_tokens, expected):
    assert num_storable_blocks(num_hashes, written, num_tokens, mode) == expected


def test_a_descriptor_covers_what_the_hash_covers():
    inputs = HashInputs(mm_items=(MultiModalItem("img", 8, 2),))
    request = Req(list(range(12)), hash_inputs=inputs)
    hashes = request.get_block_hashes(1)
    block = describe_block(request, hashes, 1, LOOKAHEAD)
    assert block.token_ids == (4, 5, 6, 7)
    assert block.lookahead_token_ids == (8,)
    assert block.parent_hash == hashes[0]
    assert block.extra_keys == (("mm", "img", 4),)  # the item starts in the lookahead token
    first = describe_block(request, hashes, 0, LOOKAHEAD)
    assert first.parent_hash == b"" and first.extra_keys is None
    with pytest.raises(IndexError):
        describe_block(request, hashes, len(hashes), LOOKAHEAD)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_copies_out_and_in_are_exact(device, dtype):
    world = KVWorld(dtype=dtype, device=device)
    ids = [7, 3, 11]
    world.write_cold_kv(ids)
    cold = world.blocks(ids)
    snapshot = world.kv.read_blocks(ids)
    assert [tuple(t.shape) for t in snapshot] == [(3, 2, 2, 4, 2, 8), (3, 1, 2, 4, 2, 8)]
    assert all(t.device.type == "cpu" for t in snapshot)
    world.write_cold_kv(ids)  # a later write to the device blocks...
    assert not bit_equal(world.blocks(ids), cold)
    per_block = [tuple(t[row] for t in snapshot) for row in range(3)]
    world.kv.write_blocks([20, 21, 22], per_block)  # ...leaves the snapshot as it was
    assert bit_equal(world.blocks([20, 21, 22]), cold)


def test_the_drafter_cache_must_share_the_block_table():
    target = PagedKVCache(2, 16, 4, 2, 8)
    with pytest.raises(ValueError, match="block table"):
        DeviceKV(target, PagedKVCache(1, 8, 4, 2, 8))
    kv = DeviceKV(target, PagedKVCache(1, 16, 4, 1, 16))  # its own heads and head size
    assert kv.layout.nbytes == BlockLayout.of(target).nbytes + 2 * 4 * 1 * 16 * 4
    with pytest.raises(IndexError):
        kv.read_blocks([16])
    with pytest.raises(ValueError, match="segment"):
        kv.write_blocks([1], [(torch.zeros(2, 2, 4, 2, 8), torch.zeros(1, 2, 4, 2, 8))])
    with pytest.raises(ValueError, match="2 blocks for 1"):
        kv.write_blocks([1], [(), ()])
