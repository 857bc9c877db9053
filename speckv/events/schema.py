"""The KV-event wire schema (msgspec / msgpack) and the conversion from cache records.

Owns the bytes that leave the engine. The layout is vLLM's (`vllm/distributed/kv_events.py`),
so existing consumers decode our batches unchanged:

    batch  = [ts, [event, ...], data_parallel_rank]      msgpack array; the rank is omitted
                                                          when unset (array_like, omit_defaults)
    event  = {"type": "BlockStored", field: value, ...}   msgpack map tagged with the class name

Events are maps, so the field *names* are the contract; optional fields default to None and are
omitted. Our one addition is `BlockStored.lookahead_token_ids` (appended last, omitted when
`L = 0`): a consumer that does not know it ignores it (msgspec skips unknown map keys).

Per BlockStored of `n` blocks with block size `B` and `L` lookahead tokens:

    token_ids            exactly n * B tokens (never a lookahead token)
    lookahead_token_ids  n lists of L tokens: tokens[e:e+L] after each block
    extra_keys           n entries, each the *untagged* E(s, e + L) of its block, or None

Hashes travel as raw bytes, or (`HashEncoding.INT`) as the low 64 bits of the big-endian
integer, as vLLM's `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` does. Full bytes are needed by a
consumer that wants to recompute hashes without having seen the parent block's event.

Re-tagging `extra_keys` (what a consumer does to recompute a hash) is `retag_extra_keys`; the
LoRA adapter *path*, which the hash covers but the event does not carry, comes from the
consumer's configuration (`lora_paths`: adapter name -> path, the same table the engines load
adapters from).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from enum import Enum
from typing import Any

import msgspec

from speckv.cache import events as records

ExternalBlockHash = bytes | int
_LOW64 = (1 << 64) - 1


class HashEncoding(Enum):
    BYTES = "bytes"
    INT = "int"  # low 64 bits of int.from_bytes(hash, "big")


def external_hash(
    block_hash: bytes, encoding: HashEncoding = HashEncoding.BYTES
) -> ExternalBlockHash:
    """A block hash as it goes on the wire. Pure."""
    if encoding is HashEncoding.BYTES:
        return block_hash
    return int.from_bytes(block_hash, "big") & _LOW64


def low64(block_hash: ExternalBlockHash) -> int:
    """The 64-bit key of a wire hash, whichever encoding it came in. Pure."""
    if isinstance(block_hash, int):
        return block_hash & _LOW64
    return int.from_bytes(block_hash[-8:], "big")


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the tagged event maps (`{"type": <class name>, ...}`)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # deprecated in vLLM, kept for the layout; we always send None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    # speckv: tokens[e:e+L] after each block; omitted (None) when L = 0
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


WireEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# ---- conversion ------------------------------------------------------------------------------
def _wire_extra_keys(extra: list[list[Any] | None] | None) -> list[tuple[Any, ...] | None] | None:
    if extra is None:
        return None
    return [tuple(entry) if entry is not None else None for entry in extra]


def to_wire_event(
    record: records.KVCacheEvent, encoding: HashEncoding = HashEncoding.BYTES
) -> WireEvent:
    """One cache record as its wire event. Pure."""
    if isinstance(record, records.BlockStored):
        parent = record.parent_block_hash
        return BlockStored(
            block_hashes=[external_hash(h, encoding) for h in record.block_hashes],
            parent_block_hash=external_hash(parent, encoding) if parent is not None else None,
            token_ids=list(record.token_ids),
            block_size=record.block_size,
            lora_id=None,
            medium=record.medium,
            lora_name=record.lora_name,
            extra_keys=_wire_extra_keys(record.extra_keys),
            group_idx=record.group_idx,
            kv_cache_spec_kind=record.kv_cache_spec_kind,
            kv_cache_spec_sliding_window=record.kv_cache_spec_sliding_window,
            # an empty list would survive omit_defaults; L = 0 must omit the field
            lookahead_token_ids=(
                [list(ids) for ids in record.lookahead_token_ids]
                if record.lookahead_token_ids and any(record.lookahead_token_ids)
                else None
            ),
        )
    if isinstance(record, records.BlockRemoved):
        return BlockRemoved(
            block_hashes=[external_hash(h, encoding) for h in record.block_hashes],
            medium=record.medium,
            group_idx=record.group_idx,
        )
    if isinstance(record, records.AllBlocksCleared):
        return AllBlocksCleared()
    raise TypeError(f"not a KV cache record: {record!r}")


def to_wire_batch(
    events: Iterable[records.KVCacheEvent],
    *,
    ts: float | None = None,
    data_parallel_rank: int | None = None,
    encoding: HashEncoding = HashEncoding.BYTES,
) -> KVEventBatch:
    """A step's cache records as one wire batch. Pure (except reading the clock)."""
    return KVEventBatch(
        ts=time.time() if ts is None else ts,
        events=[to_wire_event(record, encoding) for record in events],
        data_parallel_rank=data_parallel_rank,
    )


_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """msgpack bytes of a batch: `[ts, events, rank]`, or `[ts, events]` without a rank.

    msgspec's `omit_defaults` does not shorten array-like structs, so the rank-less form is
    written by hand; array-like decoders (ours, vLLM's) fill the missing trailing default.
    """
    if batch.data_parallel_rank is None:
        return _ENCODER.encode([batch.ts, batch.events])
    return _ENCODER.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one payload; raises `msgspec.DecodeError` (or ValidationError) if malformed."""
    return _DECODER.decode(payload)


# ---- consumers: re-tagging extra keys -------------------------------------------------------
class ExtraKeysError(ValueError):
    """An event's extra keys cannot be turned back into the tagged form the hash covers."""


def retag_extra_keys(
    untagged: Sequence[Any] | None,
    lora_name: str | None,
    lora_paths: Mapping[str, str],
) -> tuple[tuple[Any, ...], ...] | None:
    """The tagged `E` a block hash covers, from an event's untagged per-block entry. Pure.

    The untagged order is the tagged order (`speckv.hashing.extra_keys`): the LoRA name first
    when the event has `lora_name`, then `(identifier, offset)` pairs, then the salt string (the
    only other string), then prompt-embedding digests (bytes). The adapter path comes from
    `lora_paths`; an unknown adapter raises `ExtraKeysError`.
    """
    if untagged is None:
        return None
    entries = list(untagged)
    tagged: list[tuple[Any, ...]] = []
    if lora_name is not None:
        if not entries or entries[0] != lora_name:
            raise ExtraKeysError(f"extra keys {untagged!r} do not start with LoRA {lora_name!r}")
        path = lora_paths.get(lora_name)
        if path is None:
            raise ExtraKeysError(f"no path configured for LoRA adapter {lora_name!r}")
        tagged.append(("lora", lora_name, path))
        entries = entries[1:]
    for entry in entries:
        if isinstance(entry, (list, tuple)) and len(entry) == 2:
            tagged.append(("mm", entry[0], entry[1]))
        elif isinstance(entry, str):
            tagged.append(("cache_salt", entry))
        elif isinstance(entry, (bytes, bytearray, memoryview)):
            tagged.append(("prompt_embeds", bytes(entry)))
        else:
            raise ExtraKeysError(f"unrecognised extra key {entry!r}")
    return tuple(tagged) if tagged else None
