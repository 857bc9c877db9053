"""Wire schema: every event kind round-trips over real sockets, vLLM-layout consumers decode
our events, the layout is vLLM's (array batch, tagged maps, omitted defaults)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from speckv.cache import events as records
from speckv.events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExtraKeysError,
    HashEncoding,
    KVEventBatch,
    decode_batch,
    encode_batch,
    low64,
    retag_extra_keys,
    to_wire_batch,
    to_wire_event,
)
from speckv.events.subscriber import EventSubscriber, SubscriberConfig
from tests.events.events_helpers import collect, wait_subscribed

H = [bytes([i]) * 32 for i in range(1, 5)]


# A consumer written against vLLM's layout, without our lookahead field.
class VllmEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class VllmEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VllmEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VBlockRemoved(VllmEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class VAllBlocksCleared(VllmEvent, tag="AllBlocksCleared"):
    pass


class VllmKVEventBatch(VllmEventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


def stored_record(lookahead: list[list[int]] | None = ([5], [9])) -> records.BlockStored:
    return records.BlockStored(
        block_hashes=H[:2], parent_block_hash=H[3], token_ids=list(range(1, 9)), block_size=4,
        lora_name="ad", extra_keys=[["ad", "salt"], ["ad", ("img", 1)]], group_idx=0,
        lookahead_token_ids=list(lookahead) if lookahead is not None else None,
    )


ALL_RECORDS = [
    stored_record(),
    records.BlockRemoved(block_hashes=[H[0], H[1]], group_idx=1),
    records.AllBlocksCleared(),
]


def test_every_event_kind_round_trips_over_sockets(endpoints, make_publisher):
    pub_ep, replay_ep = endpoints
    publisher = make_publisher(endpoint=pub_ep, replay_endpoint=replay_ep)
    with EventSubscriber(SubscriberConfig(endpoint=pub_ep, start_seq=None)) as subscriber:
        wait_subscribed()
        seq = publisher.publish(ALL_RECORDS)
        got = collect(subscriber, 1)
    assert [s for s, _ in got] == [seq]
    batch = got[0][1]
    # tuples inside extra keys come back as lists (msgpack has one array type)
    assert batch.events == decode_batch(encode_batch(to_wire_batch(ALL_RECORDS))).events
    assert len(batch.events) == 3
    stored, removed, cleared = batch.events
    assert isinstance(stored, BlockStored) and stored.lookahead_token_ids == [[5], [9]]
    assert stored.extra_keys == [("ad", "salt"), ("ad", ["img", 1])]
    assert stored.token_ids == list(range(1, 9))  # lookahead tokens never in token_ids
    assert isinstance(removed, BlockRemoved) and removed.group_idx == 1
    assert isinstance(cleared, AllBlocksCleared)


def test_layout_is_vllms():
    batch = to_wire_batch(ALL_RECORDS, ts=1.5)
    raw = msgspec.msgpack.decode(encode_batch(batch))
    assert isinstance(raw, list) and len(raw) == 2  # [ts, events]; rank omitted when unset
    assert raw[0] == 1.5
    stored, removed, cleared = raw[1]
    assert list(stored) == [
        "type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
        "medium", "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind",
        "lookahead_token_ids",
    ]
    assert stored["type"] == "BlockStored"
    assert removed == {"type": "BlockRemoved", "block_hashes": H[:2], "medium": "GPU",
                       "group_idx": 1}
    assert cleared == {"type": "AllBlocksCleared"}
    with_rank = msgspec.msgpack.decode(encode_batch(to_wire_batch([], ts=2.0,
                                                                  data_parallel_rank=3)))
    assert with_rank == [2.0, [], 3]


def test_legacy_events_omit_lookahead():
    event = to_wire_event(stored_record(lookahead=None))
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(event))
    assert "lookahead_token_ids" not in raw


@pytest.mark.parametrize("lookahead", [None, [[5], [9]]])
def test_vllm_layout_consumer_decodes_our_events(lookahead):
    ours = to_wire_batch([stored_record(lookahead), *ALL_RECORDS[1:]], data_parallel_rank=0)
    theirs = msgspec.msgpack.decode(encode_batch(ours), type=VllmKVEventBatch)
    stored = theirs.events[0]
    assert isinstance(stored, VBlockStored)
    assert stored.block_hashes == H[:2] and stored.token_ids == list(range(1, 9))
    assert stored.extra_keys == [("ad", "salt"), ("ad", ["img", 1])]
    assert isinstance(theirs.events[1], VBlockRemoved)
    assert isinstance(theirs.events[2], VAllBlocksCleared)
    assert theirs.data_parallel_rank == 0


def test_vllm_producer_batches_decode_with_our_schema():
    theirs = VllmKVEventBatch(ts=1.0, events=[VBlockStored(
        block_hashes=[1, 2], parent_block_hash=None, token_ids=[1, 2], block_size=1,
        lora_id=None, medium="GPU", lora_name=None)])
    ours = msgspec.msgpack.decode(msgspec.msgpack.encode(theirs), type=KVEventBatch)
    assert ours.events[0].block_hashes == [1, 2]
    assert ours.events[0].lookahead_token_ids is None


def test_int_hash_encoding_is_low_64_bits_big_endian():
    event = to_wire_event(stored_record(), HashEncoding.INT)
    assert event.block_hashes == [int.from_bytes(h, "big") & (2**64 - 1) for h in H[:2]]
    assert event.parent_block_hash == low64(H[3])
    assert [low64(h) for h in H[:2]] == event.block_hashes


def test_retag_extra_keys():
    paths = {"ad": "/p/ad"}
    assert retag_extra_keys(None, None, paths) is None
    assert retag_extra_keys(["ad", ["img", 3], "salt", b"\x01"], "ad", paths) == (
        ("lora", "ad", "/p/ad"), ("mm", "img", 3), ("cache_salt", "salt"),
        ("prompt_embeds", b"\x01"),
    )
    with pytest.raises(ExtraKeysError, match="no path"):
        retag_extra_keys(["other"], "other", paths)
    with pytest.raises(ExtraKeysError, match="do not start with LoRA"):
        retag_extra_keys(["salt"], "ad", paths)
    with pytest.raises(ExtraKeysError, match="unrecognised"):
        retag_extra_keys([3], None, paths)
