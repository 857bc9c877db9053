"""The block codec: exact round trips, and every kind of bad bytes is a typed miss."""

from __future__ import annotations

import pickle
import struct
from dataclasses import replace

import msgspec
import pytest
import torch

from speckv.connectors.codec import (
    MAGIC,
    BlockHeader,
    CodecMiss,
    DecodedBlock,
    MissReason,
    decode_block,
    encode_block,
)
from speckv.connectors.layout import BlockLayout
from speckv.connectors.rules import ConnectorMode, describe_block
from speckv.hashing.extra_keys import HashInputs, LoRARef
from tests.connectors.connector_helpers import KVWorld, Req

NS = "ns-test"


def _block_and_tensors(dtype=torch.float32, lookahead=1, hash_inputs=None):
    world = KVWorld(dtype=dtype)
    request = Req(list(range(10)), hash_inputs=hash_inputs or HashInputs())
    mode = ConnectorMode(lookahead, False, world.block_size)
    block = describe_block(request, request.get_block_hashes(lookahead), 1, mode)
    world.write_cold_kv([3])
    tensors = tuple(t[0] for t in world.kv.read_blocks([3]))
    return world.kv.layout, block, tensors


def _encode(layout, block, tensors) -> bytearray:
    return bytearray(b"".join(bytes(c) for c in encode_block(NS, block, layout, tensors)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_bit_exact(dtype):
    layout, block, tensors = _block_and_tensors(dtype)
    data = _encode(layout, block, tensors)
    decoded = decode_block(data, NS, block, layout)
    assert isinstance(decoded, DecodedBlock)
    assert decoded.header.token_ids == list(block.token_ids)
    assert decoded.header.lookahead_token_ids == list(block.lookahead_token_ids) == [8]
    assert [s.name for s in decoded.header.segments] == ["target", "draft"]
    for got, want in zip(decoded.tensors, tensors, strict=True):
        assert got.dtype == want.dtype
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_the_header_is_plain_msgpack_and_pickle_bytes_are_refused():
    layout, block, tensors = _block_and_tensors()
    data = _encode(layout, block, tensors)
    header_len = struct.unpack_from("<I", data, 10)[0]
    header = msgspec.msgpack.decode(bytes(data[14:14 + header_len]))
    assert isinstance(header, dict) and header["block_hash"] == block.block_hash
    pickled = bytearray(pickle.dumps({"block": block.block_hash}))
    assert decode_block(pickled, NS, block, layout).reason is MissReason.BAD_MAGIC


def _miss(data, block, layout, namespace=NS) -> MissReason:
    result = decode_block(data, namespace, block, layout)
    assert isinstance(result, CodecMiss)
    return result.reason


def test_damage_and_mismatches_are_typed_misses():
    layout, block, tensors = _block_and_tensors()
    good = _encode(layout, block, tensors)
    header_len = struct.unpack_from("<I", good, 10)[0]

    assert _miss(bytearray(), block, layout) is MissReason.TRUNCATED
    assert _miss(good[:12], block, layout) is MissReason.TRUNCATED
    assert _miss(good[: 14 + header_len // 2], block, layout) is MissReason.TRUNCATED
    assert _miss(good[:-1], block, layout) is MissReason.TRUNCATED
    assert _miss(good + b"\x00", block, layout) is MissReason.TRUNCATED

    flipped = bytearray(good)
    flipped[-3] ^= 0x01
    assert _miss(flipped, block, layout) is MissReason.CHECKSUM_MISMATCH

    bad_magic = bytearray(good)
    bad_magic[:8] = b"NOTAKVBL"
    assert _miss(bad_magic, block, layout) is MissReason.BAD_MAGIC

    bad_version = bytearray(good)
    struct.pack_into("<H", bad_version, 8, 99)
    assert _miss(bad_version, block, layout) is MissReason.BAD_VERSION

    huge = bytearray(good)
    struct.pack_into("<I", huge, 10, 1 << 30)
    assert _miss(huge, block, layout) is MissReason.BAD_HEADER

    garbage = bytearray(good)
    garbage[14:14 + header_len] = b"\xc1" * header_len
    assert _miss(garbage, block, layout) is MissReason.BAD_HEADER

    wrong_type = msgspec.msgpack.encode({"namespace": 5})
    prefix = struct.pack("<8sHI", MAGIC, 1, len(wrong_type))
    assert _miss(bytearray(prefix + wrong_type), block, layout) is MissReason.BAD_HEADER

    assert _miss(good, block, layout, namespace="ns-other") is MissReason.NAMESPACE_MISMATCH


@pytest.mark.parametrize("field", ["block_hash", "parent_hash", "group_id", "token_ids",
                                   "lookahead_token_ids", "extra_keys"])
def test_a_block_is_served_only_to_the_request_that_names_it(field):
    layout, block, tensors = _block_and_tensors()
    data = _encode(layout, block, tensors)
    other = {
        "block_hash": b"\x01" * 32, "parent_hash": b"\x02" * 32, "group_id": 1,
        "token_ids": (0, 0, 0, 0), "lookahead_token_ids": (99,),
        "extra_keys": (("lora", "a", "/a"),),
    }[field]
    assert _miss(data, replace(block, **{field: other}), layout) is MissReason.BLOCK_MISMATCH


def test_extra_keys_are_part_of_the_header():
    inputs = HashInputs(lora=LoRARef("adapter", "/adapters/a"))
    layout, block, tensors = _block_and_tensors(hash_inputs=inputs)
    assert block.extra_keys == (("lora", "adapter", "/adapters/a"),)
    data = _encode(layout, block, tensors)
    assert isinstance(decode_block(data, NS, block, layout), DecodedBlock)
    assert _miss(data, replace(block, extra_keys=None), layout) is MissReason.BLOCK_MISMATCH


def test_a_block_of_another_layout_is_refused():
    layout, block, tensors = _block_and_tensors()
    data = _encode(layout, block, tensors)
    no_draft = BlockLayout(layout.segments[:1])
    assert _miss(data, block, no_draft) is MissReason.LAYOUT_MISMATCH
    bf16 = BlockLayout(tuple(replace(s, dtype="bfloat16") for s in layout.segments))
    assert _miss(data, block, bf16) is MissReason.LAYOUT_MISMATCH


def test_the_header_type_rejects_unknown_fields():
    layout, block, tensors = _block_and_tensors()
    data = _encode(layout, block, tensors)
    header_len = struct.unpack_from("<I", data, 10)[0]
    fields = msgspec.msgpack.decode(bytes(data[14:14 + header_len]))
    fields["surprise"] = 1
    header = msgspec.msgpack.encode(fields)
    forged = bytearray(struct.pack("<8sHI", MAGIC, 1, len(header)) + header
                       + data[14 + header_len:])
    assert _miss(forged, block, layout) is MissReason.BAD_HEADER
    assert {f for f in BlockHeader.__struct_fields__} == set(fields) - {"surprise"}
