"""The serialized form of one tier block: a fixed prefix, a msgpack header, raw tensor bytes.

Owns the byte layout that persistent and shared tiers write, and the decoder that checks
everything before a single byte can reach a KV cache. No pickle: the header is a msgspec
struct decoded with a typed decoder, the payload is raw little-endian tensor bytes.

    offset 0   magic  b"SPKVBLK\\0"                         8 bytes
           8   version                                       u16 little-endian
          10   header length H                               u32 little-endian
          14   header (msgpack BlockHeader)                  H bytes
      14 + H   payload: every segment's block, in header order, C-contiguous
                 target [layers, 2, block_size, kv_heads, head_dim], then draft [...]

The header names the block (namespace, block hash, parent hash, group, token ids, lookahead
token ids, extra-keys digest), the payload's layout (byte order, per-segment name, dtype and
shape), its length and its xxh3-128 checksum. `decode_block` returns a `DecodedBlock` only if
every field equals what the caller expects; anything else is a `CodecMiss` with a reason.
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass
from enum import Enum

import msgspec
import torch
import xxhash

from speckv.connectors.layout import BlockLayout, BlockTensors
from speckv.connectors.metadata import BlockDescriptor

MAGIC = b"SPKVBLK\x00"
VERSION = 1
_PREFIX = struct.Struct("<8sHI")
MAX_HEADER_BYTES = 1 << 20  # a header is ~100 bytes + 5 per token; more means garbage


class SegmentHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    name: str
    dtype: str
    shape: list[int]


class BlockHeader(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    namespace: str
    block_hash: bytes
    parent_hash: bytes
    group_id: int
    token_ids: list[int]
    lookahead_token_ids: list[int]
    extra_keys_digest: bytes
    byteorder: str
    segments: list[SegmentHeader]
    payload_nbytes: int
    payload_checksum: bytes


_HEADER_ENCODER = msgspec.msgpack.Encoder()
_HEADER_DECODER = msgspec.msgpack.Decoder(BlockHeader)


class MissReason(Enum):
    NOT_FOUND = "not_found"
    TRUNCATED = "truncated"
    BAD_MAGIC = "bad_magic"
    BAD_VERSION = "bad_version"
    BAD_HEADER = "bad_header"
    NAMESPACE_MISMATCH = "namespace_mismatch"
    BLOCK_MISMATCH = "block_mismatch"  # hash, parent, tokens, lookahead tokens or extra keys
    LAYOUT_MISMATCH = "layout_mismatch"
    CHECKSUM_MISMATCH = "checksum_mismatch"
    IO_ERROR = "io_error"

    @property
    def is_corruption(self) -> bool:
        """The stored bytes are unusable (delete them), as opposed to simply absent."""
        return self not in (MissReason.NOT_FOUND, MissReason.IO_ERROR)


@dataclass(frozen=True)
class CodecMiss:
    reason: MissReason
    detail: str = ""


@dataclass(frozen=True)
class DecodedBlock:
    header: BlockHeader
    tensors: BlockTensors  # one block per segment, views into the decoded buffer


def _segment_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.contiguous().view(torch.uint8).numpy()).cast("B")


def encode_block(namespace: str, block: BlockDescriptor, layout: BlockLayout,
                 tensors: BlockTensors) -> list[bytes | memoryview]:
    """The block's bytes as chunks to write in order (prefix + header, then each segment).
    `tensors` is one block per segment, on the CPU."""
    layout.check_block(tensors)
    payload = [_segment_bytes(tensor) for tensor in tensors]
    checksum = xxhash.xxh3_128()
    for chunk in payload:
        checksum.update(chunk)
    header = BlockHeader(
        namespace=namespace,
        block_hash=block.block_hash,
        parent_hash=block.parent_hash,
        group_id=block.group_id,
        token_ids=list(block.token_ids),
        lookahead_token_ids=list(block.lookahead_token_ids),
        extra_keys_digest=block.extra_keys_digest,
        byteorder=sys.byteorder,
        segments=[SegmentHeader(s.name, s.dtype, list(s.block_shape)) for s in layout.segments],
        payload_nbytes=sum(len(chunk) for chunk in payload),
        payload_checksum=checksum.digest(),
    )
    header_bytes = _HEADER_ENCODER.encode(header)
    return [_PREFIX.pack(MAGIC, VERSION, len(header_bytes)) + header_bytes, *payload]


def encoded_nbytes(chunks: list[bytes | memoryview]) -> int:
    return sum(len(chunk) for chunk in chunks)


def decode_block(data: bytearray | memoryview, namespace: str, expected: BlockDescriptor,
                 layout: BlockLayout) -> DecodedBlock | CodecMiss:
    """Check and decode one block. `data` must be writable: the tensors view it. Pure."""
    view = memoryview(data)
    if len(view) < _PREFIX.size:
        return CodecMiss(MissReason.TRUNCATED, f"{len(view)} bytes, shorter than the prefix")
    magic, version, header_len = _PREFIX.unpack_from(view, 0)
    if magic != MAGIC:
        return CodecMiss(MissReason.BAD_MAGIC, f"magic {bytes(magic)!r}")
    if version != VERSION:
        return CodecMiss(MissReason.BAD_VERSION, f"version {version}, this reader knows {VERSION}")
    if header_len > MAX_HEADER_BYTES:
        return CodecMiss(MissReason.BAD_HEADER, f"header length {header_len}")
    payload_start = _PREFIX.size + header_len
    if len(view) < payload_start:
        return CodecMiss(MissReason.TRUNCATED, "the header is cut short")
    try:
        header = _HEADER_DECODER.decode(view[_PREFIX.size:payload_start])
    except (msgspec.DecodeError, msgspec.ValidationError) as error:
        return CodecMiss(MissReason.BAD_HEADER, str(error))
    if header.namespace != namespace:
        return CodecMiss(MissReason.NAMESPACE_MISMATCH,
                         f"namespace {header.namespace!r}, expected {namespace!r}")
    mismatch = _block_mismatch(header, expected)
    if mismatch:
        return CodecMiss(MissReason.BLOCK_MISMATCH, mismatch)
    if header.byteorder != sys.byteorder:
        return CodecMiss(MissReason.LAYOUT_MISMATCH, f"byte order {header.byteorder!r}")
    want = [SegmentHeader(s.name, s.dtype, list(s.block_shape)) for s in layout.segments]
    if header.segments != want:
        return CodecMiss(MissReason.LAYOUT_MISMATCH, f"segments {header.segments}")
    nbytes = layout.nbytes
    if header.payload_nbytes != nbytes:
        return CodecMiss(MissReason.LAYOUT_MISMATCH, f"payload of {header.payload_nbytes} bytes")
    if len(view) - payload_start != nbytes:
        return CodecMiss(MissReason.TRUNCATED,
                         f"payload of {len(view) - payload_start} bytes, header says {nbytes}")
    payload = view[payload_start:]
    if xxhash.xxh3_128_digest(payload) != header.payload_checksum:
        return CodecMiss(MissReason.CHECKSUM_MISMATCH, "payload checksum differs")
    tensors = []
    offset = payload_start
    for segment in layout.segments:
        raw = torch.frombuffer(view, dtype=torch.uint8, count=segment.nbytes, offset=offset)
        tensors.append(raw.view(segment.torch_dtype).reshape(segment.block_shape))
        offset += segment.nbytes
    return DecodedBlock(header, tuple(tensors))


def _block_mismatch(header: BlockHeader, expected: BlockDescriptor) -> str:
    """The first field where the stored block differs from the requested one ("" if none)."""
    checks = (
        ("block hash", header.block_hash, expected.block_hash),
        ("parent hash", header.parent_hash, expected.parent_hash),
        ("group", header.group_id, expected.group_id),
        ("token ids", tuple(header.token_ids), expected.token_ids),
        ("lookahead token ids", tuple(header.lookahead_token_ids),
         expected.lookahead_token_ids),
        ("extra keys", header.extra_keys_digest, expected.extra_keys_digest),
    )
    for name, stored, wanted in checks:
        if stored != wanted:
            return f"{name} differ"
    return ""
