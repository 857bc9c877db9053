"""Which blocks of a request a content-addressed tier may serve and may store. Pure.

Owns `ConnectorMode` (the engine's hash mode as a connector needs it), the `ConnectorRequest`
protocol (what a connector reads of a request) and the two length rules:

lookup, from the end of the local hit `h` (a whole number of blocks):

    candidates   blocks  [h / B, min(len(block_hashes), (N - 1) // B))
    run          the consecutive candidates the tier holds, from the first
    lookahead    serve the whole run: each block's hash already proves its successor token(s)
    legacy+drop  serve run - 1 (not below 0): the last block of the run is the unverified one,
                 exactly the unit the local cache drops (`KVCacheManager.get_computed_blocks`)

store, with `W` = tokens whose target and draft KV are in the request's blocks:

    blocks [0, min(len(block_hashes), W // B)): only blocks covered by the request's block
    hashes (the offloadable range is capped at `len(block_hashes) * B` tokens)
    lookahead    a block's hash exists only once its successor token(s) are real, and the
                 drafter writes the draft KV they feed before the hash appears
    legacy+drop  a legacy hash exists as soon as the block's own tokens do; the block whose
                 successor is not yet a real token (its last draft KV is unwritten) is the
                 unverified last block, and is left out: also at most (N - 1) // B blocks.
                 `W` never counts the last real token, so this holds already; the cap says it.
                 As in the local cache, what is stored is then served one block short.

`W` never counts the last real token (it is computed in the step that samples the next one), so
at request finish the store reaches the block that the last sampled token completed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from speckv.cache.kv_cache_manager import StridedHashes
from speckv.cache.retention import RetentionPolicy
from speckv.connectors.metadata import BlockDescriptor
from speckv.hashing.extra_keys import HashInputs


class ConnectorRequest(Protocol):
    """What a connector reads of a request (see `speckv.engine.request.Request`)."""

    request_id: str
    all_token_ids: Sequence[int]  # real tokens only: prompt + sampled
    hash_inputs: HashInputs

    @property
    def num_tokens(self) -> int: ...

    @property
    def lora_name(self) -> str | None: ...

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        """What the API request carried for a connector (its `kv_transfer_params` field)."""
        ...

    def get_block_hashes(self, lookahead_tokens: int) -> Sequence[bytes]: ...


class HashModeLike(Protocol):
    """What a connector reads of `speckv.cache.hash_mode.HashMode`."""

    @property
    def lookahead_tokens(self) -> int: ...

    @property
    def drops_last_unit(self) -> bool: ...


FULL_ATTENTION = "full_attention"


@dataclass(frozen=True)
class GroupMode:
    """One KV cache group as a tier carries it (a hybrid model has several).

    Blocks of `block_size` tokens are named by every `hash_stride`-th hash of the request's
    chain of `lookahead_tokens` (the local cache's rule: attention groups use the mode's
    lookahead, Mamba groups legacy hashes). A hit at h reads `num_needed_blocks` blocks
    before h (0: every block, full attention; a sliding window's tail; 1: the Mamba state at
    h); a save keeps `num_tail_blocks` blocks before each boundary `retention` keeps.
    """

    group_id: int
    kind: str  # "full_attention", "sliding_window", "mamba"
    block_size: int
    lookahead_tokens: int
    hash_stride: int = 1
    num_needed_blocks: int = 0
    num_tail_blocks: int = 0
    retention: RetentionPolicy | None = None  # None: every block (full attention)

    @property
    def is_full(self) -> bool:
        return self.kind == FULL_ATTENTION


@dataclass(frozen=True)
class ConnectorMode:
    """The engine's hash mode, as a connector keys, looks up and stores blocks.

    `lookahead_tokens` is the `L` of the hash chain the connector keys blocks by (0: legacy);
    `drops_last_block` is the legacy drop (exclusive with lookahead); `block_size` is the hash
    unit, which is the block size of the one attention group the tier copies (`group_id`).
    """

    lookahead_tokens: int
    drops_last_block: bool
    block_size: int
    group_id: int = 0
    # a hybrid model: every KV cache group (group order) and the hit alignment unit U;
    # () for one group
    groups: tuple[GroupMode, ...] = ()
    alignment_tokens: int = 0
    # a single-group tier of one group of a hybrid model (`lane`): its group, and how many
    # hash units one of its blocks spans
    group: GroupMode | None = None
    hash_stride: int = 1

    def __post_init__(self) -> None:
        if self.lookahead_tokens < 0:
            raise ValueError(f"lookahead_tokens must be >= 0, got {self.lookahead_tokens}")
        if self.lookahead_tokens and self.drops_last_block:
            raise ValueError("lookahead hashes and the legacy block drop are exclusive")
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        if self.group_id < 0:
            raise ValueError(f"group_id must be >= 0, got {self.group_id}")

    @classmethod
    def from_hash_mode(cls, hash_mode: HashModeLike, block_size: int,
                       group_id: int = 0, groups: Sequence[GroupMode] = (),
                       alignment_tokens: int = 0) -> ConnectorMode:
        groups = tuple(groups) if len(groups) > 1 else ()
        return cls(hash_mode.lookahead_tokens, hash_mode.drops_last_unit, block_size, group_id,
                   groups, alignment_tokens if groups else 0)

    @property
    def is_grouped(self) -> bool:
        """Several KV cache groups (a hybrid model): the tier runs one lane per group."""
        return len(self.groups) > 1

    def lane(self, index: int) -> ConnectorMode:
        """The mode of the single-group tier that carries group `index`."""
        group = self.groups[index]
        return ConnectorMode(group.lookahead_tokens,
                             self.drops_last_block and not group.lookahead_tokens,
                             group.block_size, group.group_id, group=group,
                             hash_stride=group.hash_stride)

    @property
    def label(self) -> str:
        if self.lookahead_tokens:
            return f"lookahead L={self.lookahead_tokens}"
        return "legacy+drop" if self.drops_last_block else "legacy"


def block_hashes(request: ConnectorRequest, mode: ConnectorMode) -> Sequence[bytes]:
    """The hashes naming `mode`'s blocks: the request's chain of `mode.lookahead_tokens`,
    every `hash_stride`-th one for a group whose blocks span several hash units."""
    chain = request.get_block_hashes(mode.lookahead_tokens)
    return chain if mode.hash_stride == 1 else StridedHashes(chain, mode.hash_stride)


def num_lookup_candidates(num_tokens: int, num_hashes: int, block_size: int) -> int:
    """Blocks a hit may cover at all: hashed, and at most N - 1 tokens (the last prompt token
    is always recomputed for its logits)."""
    return max(0, min(num_hashes, (num_tokens - 1) // block_size))


def num_servable_blocks(run_blocks: int, mode: ConnectorMode) -> int:
    """Of a run of consecutive tier blocks after the local hit, how many may be served."""
    if run_blocks < 0:
        raise ValueError(f"run_blocks must be >= 0, got {run_blocks}")
    return max(0, run_blocks - 1) if mode.drops_last_block else run_blocks


def num_storable_blocks(num_hashes: int, num_written_tokens: int, num_tokens: int,
                        mode: ConnectorMode) -> int:
    """Blocks `[0, n)` of a request whose KV (target and draft) is complete and provable."""
    if num_written_tokens < 0:
        raise ValueError(f"num_written_tokens must be >= 0, got {num_written_tokens}")
    limit = min(num_hashes, num_written_tokens // mode.block_size)
    if mode.drops_last_block:
        limit = min(limit, (num_tokens - 1) // mode.block_size)
    return max(0, limit)


def describe_block(request: ConnectorRequest, block_hashes: Sequence[bytes], index: int,
                   mode: ConnectorMode) -> BlockDescriptor:
    """The descriptor of block `index` of `request`'s chain under `mode`. Pure."""
    if not 0 <= index < len(block_hashes):
        raise IndexError(f"block {index} is not hashed ({len(block_hashes)} hashes)")
    size, lookahead = mode.block_size, mode.lookahead_tokens
    start, end = index * size, index * size + size
    tokens = request.all_token_ids
    return BlockDescriptor(
        block_hash=block_hashes[index],
        parent_hash=block_hashes[index - 1] if index > 0 else b"",
        group_id=mode.group_id,
        token_ids=tuple(tokens[start:end]),
        lookahead_token_ids=tuple(tokens[end:end + lookahead]),
        extra_keys=request.hash_inputs.extra_keys(start, end + lookahead),
    )
