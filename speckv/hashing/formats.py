"""Block-hash formats: which Python object is hashed for the block `[s, e)`.

Owns the hashed layouts. `LegacyFormat` and `LookaheadFormat` are the production formats;
`NestedFormat` and `ExpandedWindowFormat` exist only so `speckv bench hash` can compare the
alternatives a hash layout could take (nested tuples, one expanded window) on cost.

    tokens:   ... | t[s] ... t[e-1] | t[e] ... t[e+L-1] | ...
                    \\__ block ___/   \\__ lookahead __/

    legacy     (parent, (t[s..e-1]), E(s, e))
    lookahead  (parent, (t[s..e-1]), (E(s, e+L), t[e], ..., t[e+L-1]))
    nested     (parent, (t[s..e-1]), (E(s, e), t[e], E(e, e+1)))       L = 1 only
    expanded   (parent, (t[s..e]), E(s, e+1))                            L = 1 only

The lookahead shape `(E, *tokens)` keeps lookahead hashes apart from legacy hashes of block size
`B + L` (which is what `expanded` collides with), and different `L` give different tuple lengths.

Each format also describes its pickle byte layout (`PickleLayout`) for the fast encoder in
`pickle_fast.py`, which must produce exactly `pickle.dumps(key(...))` for extra-key-free blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from speckv.hashing.extra_keys import HashInputs

# pickle opcodes (protocol 5) used by the layouts
MARK = b"("
TUPLE = b"t"
TUPLE_BY_LEN = {1: b"\x85", 2: b"\x86", 3: b"\x87"}
MEMOIZE = b"\x94"
NONE = b"N"


def tuple_open_close(num_items: int) -> tuple[bytes, bytes]:
    """Bytes around the items of a memoized non-empty tuple, as CPython's pickler writes them."""
    if num_items <= 0:
        raise ValueError("empty tuples are never hashed")
    if num_items <= 3:
        return b"", TUPLE_BY_LEN[num_items] + MEMOIZE
    return MARK, TUPLE + MEMOIZE


@dataclass(frozen=True)
class PickleLayout:
    """Token section of an extra-key-free block: `open + block + mid + lookahead + close`."""

    open: bytes
    mid: bytes
    close: bytes


class BlockHashFormat(Protocol):
    name: str
    lookahead_tokens: int  # L: tokens after the block that must exist before it is hashed

    def key(
        self, parent: bytes, token_ids: Sequence[int], start: int, end: int, inputs: HashInputs
    ) -> tuple[Any, ...]:
        """The object hashed for block `[start, end)`; `token_ids` reaches `end + L`."""
        ...

    def pickle_layout(self, block_size: int) -> PickleLayout: ...


@dataclass(frozen=True)
class LegacyFormat:
    name: str = "legacy"
    lookahead_tokens: int = 0

    def key(self, parent, token_ids, start, end, inputs):
        return (parent, tuple(token_ids[start:end]), inputs.extra_keys(start, end))

    def pickle_layout(self, block_size: int) -> PickleLayout:
        open_, close = tuple_open_close(block_size)
        return PickleLayout(open_, close + NONE, b"")


@dataclass(frozen=True)
class LookaheadFormat:
    lookahead_tokens: int = 1
    name: str = "lookahead"

    def __post_init__(self) -> None:
        if self.lookahead_tokens < 1:
            raise ValueError(
                f"LookaheadFormat.lookahead_tokens must be >= 1, got {self.lookahead_tokens}"
            )

    def key(self, parent, token_ids, start, end, inputs):
        lookahead_end = end + self.lookahead_tokens
        extra = inputs.extra_keys(start, lookahead_end)
        if self.lookahead_tokens == 1:  # index, don't slice: same tuple, cheaper
            tail = (extra, token_ids[end])
        else:
            tail = (extra, *token_ids[end:lookahead_end])
        return (parent, tuple(token_ids[start:end]), tail)

    def pickle_layout(self, block_size: int) -> PickleLayout:
        block_open, block_close = tuple_open_close(block_size)
        tail_open, tail_close = tuple_open_close(1 + self.lookahead_tokens)
        return PickleLayout(block_open, block_close + tail_open + NONE, tail_close)


@dataclass(frozen=True)
class NestedFormat:
    name: str = "nested"
    lookahead_tokens: int = 1

    def key(self, parent, token_ids, start, end, inputs):
        tail = (inputs.extra_keys(start, end), token_ids[end], inputs.extra_keys(end, end + 1))
        return (parent, tuple(token_ids[start:end]), tail)

    def pickle_layout(self, block_size: int) -> PickleLayout:
        block_open, block_close = tuple_open_close(block_size)
        tail_open, tail_close = tuple_open_close(3)
        return PickleLayout(block_open, block_close + tail_open + NONE, NONE + tail_close)


@dataclass(frozen=True)
class ExpandedWindowFormat:
    name: str = "expanded"
    lookahead_tokens: int = 1

    def key(self, parent, token_ids, start, end, inputs):
        return (parent, tuple(token_ids[start : end + 1]), inputs.extra_keys(start, end + 1))

    def pickle_layout(self, block_size: int) -> PickleLayout:
        open_, close = tuple_open_close(block_size + 1)
        return PickleLayout(open_, b"", close + NONE)


def format_for(lookahead_tokens: int) -> BlockHashFormat:
    """The production format for `L` lookahead tokens (legacy when `L == 0`)."""
    if lookahead_tokens < 0:
        raise ValueError(f"lookahead_tokens must be >= 0, got {lookahead_tokens}")
    if lookahead_tokens == 0:
        return LegacyFormat()
    return LookaheadFormat(lookahead_tokens)
