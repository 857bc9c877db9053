"""Fast, bit-exact pickle encoding and chain-hashing of whole runs of blocks (numpy path).

Requests hash through the optional native chain (`_chainhash.c`, same bytes, built by
setup.py) when it is built; this module is the fallback without a compiler, and the reference
the native chain's layout constants come from.

Owns the trick that makes `sha256` / `xxhash` block hashing cheap. For an extra-key-free block,
`pickle.dumps((parent, tokens, tail), protocol=5)` is always

    PROTO 5 | FRAME len | SHORT_BINBYTES len(parent) | parent | piece

    piece = MEMOIZE | layout.open | block tokens | layout.mid | lookahead tokens | layout.close
            | TUPLE3 MEMOIZE STOP

where each token id is BININT1 (`K` + 1 byte), BININT2 (`M` + 2 bytes) or BININT (`J` + 4
bytes). Only `parent` depends on the previous hash, so the pieces of many blocks are encoded at
once with numpy and the per-block Python loop is just `digest(head[len(piece)] + parent + piece)`.

Encoding a chunk of `k` blocks (k * B + L token ids):

1. `array('I', ids)`: the cheapest list-of-int conversion measured (~7 ns an id; rejects
   negative ids with OverflowError; ids >= 2**31 are rejected next, as pickle would write them
   as LONG1). Note: an int subclass (bool, IntEnum) or a numpy integer would pickle differently
   from the int this writes; token ids are plain ints.
2. A `[k, cells, 5]` uint8 table, one 5-byte cell per item of a block's piece: constants
   (opcodes, split into <= 5-byte cells, written once per encoder) or a token (opcode, then the
   id's 4 little-endian bytes), and a same-shaped mask of the real bytes (a constant's length;
   2, 3 or 5 for a token), so `np.compress(mask, table)` (one pass) is all pieces back to back.
3. Each row ends in a 4-byte separator `FF FF FF FF`, which can never occur inside a piece (a
   BININT of an id below 2**31 holds at most three 0xFF bytes in a row, between opcodes, and no
   constant holds 0xFF), so one `bytes.split` cuts the buffer into per-block pieces.

Where the time goes (sha256, B=16, 128K+1 ids, this project's 2-core VM): ~3.0 ms encoding
(conversion, compaction, split: ~20 ns an id) and ~3.9 ms hashing, of which ~3.0 ms is 8,192
`hashlib.sha256(...).digest()` calls themselves. Measured and rejected: one pickled tuple of all
keys (pickle's memo costs ~100 ns a tuple), bytearray/memoryview holes for the parent (slower
than two bytes concatenations), 8-byte cells (more to compact), whole-prompt conversion (fresh
memory: page faults).

Every large array lives in per-thread buffers reused across calls, and runs are encoded in
chunks of about `CHUNK_TOKENS` ids: fresh memory costs a page fault per 4 KiB, which on virtual
machines is slower than the encoding itself. Tests check bit-exactness against `pickle.dumps`
with hypothesis. Blocks with extra keys and inputs outside the fast path's range go through the
plain `pickle.dumps` path (the caller's job; `encode_pieces` raises OverflowError).
"""

from __future__ import annotations

import hashlib
import threading
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from speckv.hashing import functions as _functions
from speckv.hashing.formats import PickleLayout

_PROTO_FRAME = b"\x80\x05\x95"
_SHORT_BINBYTES = b"C"
_MEMOIZE = b"\x94"
_TUPLE3_MEMO_STOP = b"\x87\x94."
_SEPARATOR = b"\xff\xff\xff\xff"
MEMOIZE_BYTES = _MEMOIZE  # before a piece's layout.open
TUPLE3_MEMO_STOP_BYTES = _TUPLE3_MEMO_STOP  # after a piece's layout.close
# Stay well below pickle's 64 KiB frame target, past which CPython splits frames.
MAX_FAST_PAYLOAD_BYTES = 60_000
# Worst-case bytes of a piece beyond its token encodings (opcodes, tuple marks): generous.
_MAX_CONST_BYTES = 64
_BININT_LIMIT = 2**31
# Token ids per encoded chunk: large enough that numpy's per-call overhead (~40 us per chunk)
# is small, small enough that the reused buffers stay below ~1 MiB and in cache.
CHUNK_TOKENS = 32_768

# One cell per pickle item: a token id is at most 5 bytes (opcode + 4), constants are split.
_CELL_BYTES = 5
_BININT1_LIMIT = 256
_BININT2_LIMIT = 65536
_OPCODE_BININT1 = ord("K")  # BININT2 is K + 2 ('M'), BININT is K - 1 ('J')

if array("I").itemsize != 4:  # pragma: no cover - every supported platform has 4-byte uint
    raise ImportError("speckv.hashing.pickle_fast needs a 4-byte array('I')")


def max_piece_bytes(block_size: int, lookahead_tokens: int) -> int:
    """Upper bound of one block's whole pickle, in bytes (5 bytes per token id at most)."""
    return 5 * (block_size + lookahead_tokens) + _MAX_CONST_BYTES + 256


def fast_path_fits(block_size: int, lookahead_tokens: int) -> bool:
    """Whether blocks of this shape always pickle as one frame (so the layout above holds)."""
    return max_piece_bytes(block_size, lookahead_tokens) < MAX_FAST_PAYLOAD_BYTES


@dataclass(frozen=True)
class _Segment:
    """A run of cells in a row: constant bytes, or token ids `token_offset`.. of a block."""

    first_cell: int
    num_cells: int
    token_offset: int = -1  # -1: a constant
    data: bytes = b""

    @property
    def cells(self) -> slice:
        return slice(self.first_cell, self.first_cell + self.num_cells)


class PieceEncoder:
    """Encodes the pieces (everything after the parent) of extra-key-free blocks of one shape.

    One instance per (layout, block size, lookahead); immutable, shareable between threads.
    """

    def __init__(self, layout: PickleLayout, block_size: int, lookahead_tokens: int) -> None:
        if not fast_path_fits(block_size, lookahead_tokens):
            raise ValueError(f"block of {block_size}+{lookahead_tokens} tokens is too large")
        self.block_size = block_size
        self.lookahead_tokens = lookahead_tokens
        self.blocks_per_chunk = max(1, CHUNK_TOKENS // block_size)
        items: list[bytes | tuple[int, int]] = [
            _MEMOIZE + layout.open,
            (0, block_size),
            layout.mid,
            (block_size, lookahead_tokens),
            layout.close + _TUPLE3_MEMO_STOP + _SEPARATOR,
        ]
        segments: list[_Segment] = []
        cell = 0
        pending = b""  # adjacent constants merge into fewer cells
        for item in [*items, (0, 0)]:  # no lookahead (L = 0): mid and close merge
            if isinstance(item, bytes):
                pending += item
                continue
            if pending and (item[1] or item == (0, 0)):  # (0, 0): the end of the row
                num = -(-len(pending) // _CELL_BYTES)  # cells the constant spans
                segments.append(_Segment(cell, num, data=pending))
                cell += num
                pending = b""
            offset, count = item
            if count:
                segments.append(_Segment(cell, count, token_offset=offset))
                cell += count
        self._constants = tuple(seg for seg in segments if seg.token_offset < 0)
        self._token_segments = tuple(seg for seg in segments if seg.token_offset >= 0)
        self.cells_per_row = cell
        # longest possible piece: every token id a 5-byte BININT
        const_bytes = sum(len(seg.data) for seg in self._constants) - len(_SEPARATOR)
        self.max_piece_len = const_bytes + 5 * (block_size + lookahead_tokens)

    def encode_pieces(self, token_ids: Sequence[int], first_start: int, num_blocks: int,
                      keep: np.ndarray | None = None) -> Iterator[list[bytes]]:
        """Pieces of blocks `first_start + j * B` for `j < num_blocks`, one list per chunk of
        `blocks_per_chunk` blocks; with `keep` (bool per block), only the kept blocks' pieces.

        Raises OverflowError (before yielding anything for that chunk) when an id is negative
        or >= 2**31; `token_ids` must reach `first_start + num_blocks * B + L`.
        """
        block_size, per_chunk = self.block_size, self.blocks_per_chunk
        for chunk_first in range(0, num_blocks, per_chunk):
            count = min(per_chunk, num_blocks - chunk_first)
            selected = None
            if keep is not None:
                selected = np.flatnonzero(keep[chunk_first : chunk_first + count])
                if len(selected) == count:
                    selected = None
                elif len(selected) == 0:
                    yield []
                    continue
            yield self._encode_chunk(token_ids, first_start + chunk_first * block_size, count,
                                     selected)

    def _init_rows(self, table: np.ndarray, mask: np.ndarray) -> None:
        """Write what is the same in every row: constants, and the always-present lanes of
        token cells (opcode and low byte)."""
        mask[...] = False
        for seg in self._constants:
            padding = seg.num_cells * _CELL_BYTES - len(seg.data)
            cells = (seg.num_cells, _CELL_BYTES)
            table[:, seg.cells] = np.frombuffer(seg.data + b"\0" * padding, np.uint8).reshape(cells)
            lanes = np.array([True] * len(seg.data) + [False] * padding).reshape(cells)
            mask[:, seg.cells] = lanes
        for seg in self._token_segments:
            mask[:, seg.cells, :2] = True

    def _encode_chunk(self, token_ids: Sequence[int], start: int, count: int,
                      selected: np.ndarray | None) -> list[bytes]:
        block_size, lookahead = self.block_size, self.lookahead_tokens
        num_ids = count * block_size + lookahead
        # array('I') raises OverflowError for negative ids, TypeError for non-ints
        try:
            ids = np.frombuffer(array("I", token_ids[start : start + num_ids]), dtype=np.uint32)
        except TypeError as exc:
            raise OverflowError(str(exc)) from exc
        if ids.size != num_ids:
            raise ValueError(f"need {num_ids} token ids from {start}, got {ids.size}")
        if int(ids.max()) >= _BININT_LIMIT:
            raise OverflowError("token id >= 2**31: pickle writes it as LONG1")
        wide = ids >= _BININT1_LIMIT  # lane 2 (second data byte) is real
        wider = ids >= _BININT2_LIMIT  # lanes 3 and 4 are real
        # opcode: K (BININT1), M = K + 2 (BININT2), J = K - 1 (BININT)
        opcodes = np.add(wide.view(np.uint8) << 1, _OPCODE_BININT1, dtype=np.uint8)
        opcodes -= wider.view(np.uint8) * np.uint8(3)

        rows = _scratch(self)
        chunk_rows = count
        if selected is not None:
            count = len(selected)
        table, mask, ids_lanes = rows.table[:count], rows.mask[:count], rows.ids_lanes[:count]
        for seg in self._token_segments:
            # row j, column i of this segment is token `j * B + token_offset + i`: a strided
            # view (no copy), gathered only when some rows are skipped
            cells = seg.cells
            sources = [_block_view(values, seg.token_offset, seg.num_cells, block_size,
                                   chunk_rows, selected)
                       for values in (opcodes, ids, wide, wider)]
            table[:, cells, 0] = sources[0]
            ids_lanes[:, cells] = sources[1]
            mask[:, cells, 2] = sources[2]
            mask[:, cells, 3] = sources[3]
            mask[:, cells, 4] = sources[3]
        lanes = mask.reshape(-1)
        packed = rows.packed[: np.count_nonzero(lanes)]
        np.compress(lanes, table.reshape(-1), out=packed)
        pieces = packed.tobytes().split(_SEPARATOR)
        pieces.pop()  # after the last separator
        if len(pieces) != count:  # pragma: no cover - excluded by the separator argument above
            raise OverflowError("separator found inside a piece")
        return pieces


def _block_view(values: np.ndarray, offset: int, width: int, block_size: int, num_rows: int,
                selected: np.ndarray | None) -> np.ndarray:
    """`[rows, width]` view of `values[j * block_size + offset + i]`, rows `selected` only."""
    if width == block_size:  # the block's own tokens (offset 0) or a window as wide
        view = values[offset : offset + num_rows * block_size].reshape(num_rows, width)
    elif width == 1:  # one lookahead token: a strided slice (as_strided costs ~5 us a call)
        view = values[offset : offset + num_rows * block_size : block_size].reshape(num_rows, 1)
    else:
        item = values.itemsize
        view = np.lib.stride_tricks.as_strided(
            values[offset:], shape=(num_rows, width), strides=(block_size * item, item),
            writeable=False)
    return view if selected is None else view[selected]


class _Rows:
    """One thread's reusable `[rows, cells, 5]` table and mask for one encoder's row shape."""

    def __init__(self, encoder: PieceEncoder) -> None:
        num_rows, cells = encoder.blocks_per_chunk, encoder.cells_per_row
        self.table = np.zeros((num_rows, cells, _CELL_BYTES), dtype=np.uint8)
        self.mask = np.zeros((num_rows, cells, _CELL_BYTES), dtype=bool)
        self.packed = np.empty(self.table.size, dtype=np.uint8)
        # lanes 1..4 of every cell as a little-endian uint32 (unaligned view)
        self.ids_lanes = np.ndarray(
            shape=(num_rows, cells),
            dtype=np.dtype("<u4"),
            buffer=self.table,
            offset=1,
            strides=(cells * _CELL_BYTES, _CELL_BYTES),
        )
        encoder._init_rows(self.table, self.mask)


_local = threading.local()
# Row buffers kept per thread, one set per recently used encoder (a benchmark alternates four
# formats; an engine uses one or two).
_MAX_CACHED_ENCODERS = 6


def _scratch(encoder: PieceEncoder) -> _Rows:
    """This thread's rows for `encoder`, reused across calls (least recently used dropped).

    Reuse matters: fresh memory costs a page fault per 4 KiB touched, which on virtual machines
    costs more than the encoding itself, and the constants are written only once.
    """
    cache: OrderedDict[PieceEncoder, _Rows] | None = getattr(_local, "rows", None)
    if cache is None:
        cache = _local.rows = OrderedDict()
    rows = cache.get(encoder)
    if rows is None:
        if len(cache) >= _MAX_CACHED_ENCODERS:
            cache.popitem(last=False)
        rows = cache[encoder] = _Rows(encoder)
    else:
        cache.move_to_end(encoder)
    return rows


# ---- chain hashing ----------------------------------------------------------------------------

_heads_by_parent_len: dict[int, list[bytes]] = {}


def _heads(parent_len: int, max_piece_len: int) -> list[bytes]:
    """`heads[n]`: the bytes before the parent in a pickle whose piece is `n` bytes long."""
    heads = _heads_by_parent_len.setdefault(parent_len, [])
    if len(heads) <= max_piece_len:
        tag = _SHORT_BINBYTES + bytes((parent_len,))
        fixed = len(tag) + parent_len
        heads.extend(
            _PROTO_FRAME + (fixed + n).to_bytes(8, "little") + tag
            for n in range(len(heads), max_piece_len + 1)
        )
    return heads


def chain_hash(
    digest: Callable[[bytes], bytes],
    parent: bytes,
    pieces: list[bytes],
    out: list[bytes],
    max_piece_len: int,
) -> bytes:
    """Append `digest(pickle of (parent, ...))` for each piece to `out`, chaining parents.

    Returns the last hash (or `parent` when `pieces` is empty). `parent` must be < 256 bytes.
    """
    if not pieces:
        return parent
    # block 0 of a run may have a parent of another length (NONE_HASH vs digests)
    first = pieces[0]
    parent = digest(_heads(len(parent), len(first))[len(first)] + parent + first)
    out.append(parent)
    if len(pieces) == 1:
        return parent
    rest = pieces[1:]
    heads = list(map(_heads(len(parent), max_piece_len).__getitem__, map(len, rest)))
    # The loop is the hot path (one digest per block): a comprehension with `:=` and two
    # bytes concatenations measured fastest (bytearray holes and memoryviews cost more).
    if digest is _functions._sha256_digest:
        sha256 = hashlib.sha256  # a C call instead of the Python wrapper: ~10% of the loop
        out += [parent := sha256(head + parent + piece).digest()
                for head, piece in zip(heads, rest)]
    else:
        out += [parent := digest(head + parent + piece) for head, piece in zip(heads, rest)]
    return parent


__all__ = [
    "CHUNK_TOKENS",
    "MAX_FAST_PAYLOAD_BYTES",
    "PieceEncoder",
    "chain_hash",
    "fast_path_fits",
    "max_piece_bytes",
]
