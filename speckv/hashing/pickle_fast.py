"""Fast, bit-exact pickle encoding of whole runs of blocks.

Owns the one trick that makes hashing cheap: instead of building a tuple per block and pickling
it, all token ids of a run are encoded once (vectorised with numpy) into one buffer, and each
block's pickle is assembled from slices of that buffer plus constant opcodes:

    PROTO 5 | FRAME len | SHORT_BINBYTES parent | MEMOIZE | layout.open | block tokens
            | layout.mid | lookahead tokens | layout.close | TUPLE3 MEMOIZE STOP

That is byte-for-byte what `pickle.dumps((parent, tokens, tail), protocol=5)` writes for a
block without extra keys (tests check this with hypothesis); blocks with extra keys, and inputs
outside the fast path's range, go through the plain `pickle.dumps` path.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from speckv.hashing.formats import PickleLayout

_PROTO_FRAME = b"\x80\x05\x95"
_SHORT_BINBYTES = b"C"
_TUPLE3_MEMO_STOP = b"\x87\x94."
# Stay well below pickle's 64 KiB frame target, past which CPython splits frames.
MAX_FAST_PAYLOAD_BYTES = 60_000
_INT32_LIMIT = 2**31


class EncodedTokens:
    """Pickle encodings of `token_ids[first:first+len]`, one contiguous buffer.

    Each id becomes BININT1 (`K` + 1 byte), BININT2 (`M` + 2 bytes) or BININT (`J` + 4 bytes),
    as CPython's pickler chooses. `offsets[i]` is where token `first + i` starts.
    """

    __slots__ = ("buffer", "first", "offsets")

    def __init__(self, token_ids: Sequence[int], first: int, end: int) -> None:
        ids = np.asarray(token_ids[first:end], dtype=np.int64)
        if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= _INT32_LIMIT):
            raise OverflowError("token id outside the fast path's BININT range")
        sizes = np.where(ids < 256, 2, np.where(ids < 65536, 3, 5))
        offsets = np.zeros(ids.size + 1, dtype=np.int64)
        np.cumsum(sizes, out=offsets[1:])
        out = np.zeros(int(offsets[-1]), dtype=np.uint8)
        starts = offsets[:-1]
        out[starts] = np.where(sizes == 2, ord("K"), np.where(sizes == 3, ord("M"), ord("J")))
        for byte_index in range(4):
            has_byte = sizes > byte_index + 1
            out[starts[has_byte] + 1 + byte_index] = (ids[has_byte] >> (8 * byte_index)) & 0xFF
        self.buffer = memoryview(out.tobytes())
        self.offsets: list[int] = offsets.tolist()
        self.first = first


def fast_block_payloads_supported(parent: bytes) -> bool:
    return len(parent) < 256


def hash_run(
    digest,
    layout: PickleLayout,
    encoded: EncodedTokens,
    parent: bytes,
    starts: Sequence[int],
    block_size: int,
    lookahead_tokens: int,
) -> list[bytes]:
    """Chain-hash blocks starting at `starts` (consecutive, no extra keys). Pure."""
    offsets = encoded.offsets
    buffer = encoded.buffer
    first = encoded.first
    open_, mid, close = layout.open, layout.mid, layout.close + _TUPLE3_MEMO_STOP
    # everything after the FRAME header except the variable parts
    fixed = 1 + 1 + 1 + len(open_) + len(mid) + len(close)  # C, len byte, MEMOIZE
    join = b"".join
    hashes: list[bytes] = []
    for start in starts:
        local = start - first
        block_begin = offsets[local]
        block_end = offsets[local + block_size]
        lookahead_end = offsets[local + block_size + lookahead_tokens]
        frame_len = fixed + len(parent) + (lookahead_end - block_begin)
        parent = digest(
            join(
                (
                    _PROTO_FRAME,
                    frame_len.to_bytes(8, "little"),
                    _SHORT_BINBYTES,
                    len(parent).to_bytes(1, "little"),
                    parent,
                    b"\x94",
                    open_,
                    buffer[block_begin:block_end],
                    mid,
                    buffer[block_end:lookahead_end],
                    close,
                )
            )
        )
        hashes.append(parent)
    return hashes
