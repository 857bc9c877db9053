"""The router index: which engine holds the longest cached prefix of a prompt.

Owns a per-engine set of cached block hashes built from KV events, the check that every
BlockStored's hashes are reproducible from the event (recomputed by `speckv.router.verify`),
the engine's divergent-block index as its events show it, and the prefix lookup.

Verification recomputes each stored block from the event alone:

    L = len(lookahead_token_ids[i])   (0 when the field is absent: legacy hashes, or a Mamba group)
    hash_i = H((parent, token_ids[iB:(i+1)B], E_i))                    L = 0
    hash_i = H((parent, token_ids[iB:(i+1)B], (E_i, *lookahead_i)))    L >= 1
    E_i    = retag_extra_keys(extra_keys[i], lora_name, lora_paths)

with the engine's hash algorithm and `NONE_HASH` (from its `PYTHONHASHSEED` string) as the
parent of block 0. A mismatch is counted (the router's hash configuration differs from the
engine's, or the event is wrong); the blocks are indexed as the wire names them either way.
With int (64-bit) wire hashes the parent's full hash is known only if the router recomputed
it from an earlier event; otherwise the event is counted as unverifiable.

Index keys are the low 64 bits of each hash (whatever the wire encoding): a collision can only
misroute a request, never serve wrong KV, since every engine checks its own hits.

Routing hashes the prompt with the engine's algorithm, seed, block size and `L`
(`hash_prompt`: the last block only when its `L` lookahead tokens are in the prompt), then walks
the chain while the engine holds each hash in the routed group. LoRA prompts need the adapter
path as well: the router is configured with `lora_paths` (name -> path), the same table the
engines load adapters from. Not thread-safe: callers serialise (`RouterService` holds a lock).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from speckv.events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVEventBatch,
    low64,
)
from speckv.hashing.block_hash import hash_lookahead_block
from speckv.hashing.extra_keys import HashInputs, LoRARef, MultiModalItem
from speckv.hashing.formats import format_for
from speckv.hashing.functions import HashAlgo, get_hash_algo, make_none_hash
from speckv.hashing.request_hasher import hash_prompt
from speckv.router.verify import VerifyError, at_hash_unit, recompute_block_hashes


@dataclass(frozen=True)
class EngineHashConfig:
    """What a consumer must know to reproduce an engine's block hashes."""

    algo: str = "sha256"
    seed: str = "0"  # the engines' PYTHONHASHSEED string; a random seed cannot be reproduced
    block_size: int = 16
    lookahead_tokens: int = 0  # L
    lora_paths: Mapping[str, str] = field(default_factory=dict)  # adapter name -> path
    route_group: int = 0  # the KV cache group whose hashes decide a prefix match
    verify: bool = True  # recompute every BlockStored's hashes
    # the engine may hold several blocks under one hash (vLLM: two requests computing the same
    # block at once, or EAGLE's dropped last block recomputed), storing and removing each: a
    # hash is held until as many BlockRemoved as BlockStored have come
    counts_copies: bool = False

    def __post_init__(self) -> None:
        get_hash_algo(self.algo)  # raises with the allowed names
        if self.block_size <= 0:
            raise ValueError(f"EngineHashConfig.block_size must be > 0, got {self.block_size}")
        if self.lookahead_tokens < 0:
            raise ValueError(
                f"EngineHashConfig.lookahead_tokens must be >= 0, got {self.lookahead_tokens}"
            )

    @property
    def hash_algo(self) -> HashAlgo:
        return get_hash_algo(self.algo)

    @property
    def none_hash(self) -> bytes:
        return make_none_hash(self.hash_algo, self.seed)


_ROOT = -1  # the successor index's parent key for the first block
# (low64 parent hash or _ROOT, the block's tokens): a block's content, its successors aside
ContentKey = tuple[int, tuple[int, ...]]


def _is_pending(entry: tuple[int, float] | None, now: float) -> bool:
    return entry is not None and (entry[0] > 0 or entry[1] > now)


@dataclass
class EngineState:
    """One engine's cached blocks as its events describe them."""

    # (group_idx, low64 hash) -> media holding it
    blocks: dict[tuple[int, int], set[str]] = field(default_factory=dict)
    # (group_idx, low64 hash, medium) -> blocks holding it, past the first (counts_copies)
    extra_copies: dict[tuple[int, int, str], int] = field(default_factory=dict)
    # low64 -> full hash, for verifying children of int-hash events
    full_hashes: dict[int, bytes] = field(default_factory=dict)
    stored_blocks: int = 0
    removed_blocks: int = 0
    clears: int = 0
    batches: int = 0
    verified_blocks: int = 0
    mismatched_blocks: int = 0
    unverifiable_blocks: int = 0
    last_seq: int | None = None
    # low64 hash -> (routed requests in flight, monotonic expiry once none is): blocks routed
    # here whose BlockStored has not arrived yet
    pending: dict[int, tuple[int, float]] = field(default_factory=dict)
    # (low64 parent hash (-1: the root), the block's tokens) -> (low64 hash, successor
    # tokens) of the latest block stored with that content: the engine's divergent-block
    # index, keyed as the engine keys it (by content, not by parent alone: two blocks after
    # one parent may share their first L tokens and differ later)
    successors: dict[ContentKey, tuple[int, tuple[int, ...]]] = field(default_factory=dict)
    # the same for blocks routed here whose BlockStored has not arrived yet (read while their
    # hash is pending: the engine copies a block an earlier step computed)
    pending_successors: dict[ContentKey, tuple[int, tuple[int, ...]]] = field(
        default_factory=dict)

    def counters(self) -> dict[str, Any]:
        return {
            "cached_blocks": len(self.blocks),
            "stored_blocks": self.stored_blocks,
            "removed_blocks": self.removed_blocks,
            "clears": self.clears,
            "batches": self.batches,
            "verified_blocks": self.verified_blocks,
            "mismatched_blocks": self.mismatched_blocks,
            "unverifiable_blocks": self.unverifiable_blocks,
            "last_seq": self.last_seq,
            "pending_blocks": sum(_is_pending(entry, time.monotonic())
                                  for entry in self.pending.values()),
        }


@dataclass(frozen=True)
class RouteResult:
    engine: str | None  # None: no engines
    matched_tokens: int
    per_engine: dict[str, int]  # engine -> matched tokens
    num_prompt_blocks: int  # hashable blocks of the prompt


class RouterIndex:
    def __init__(self, engines: Mapping[str, EngineHashConfig]) -> None:
        self.configs = dict(engines)
        self.state = {name: EngineState() for name in engines}
        self._algos = {name: cfg.hash_algo for name, cfg in engines.items()}
        self._none_hashes = {name: cfg.none_hash for name, cfg in engines.items()}

    # ---- engines -----------------------------------------------------------------------------
    def reset_engine(self, engine: str, config: EngineHashConfig | None = None) -> None:
        """Forget everything an engine's events said (a restart, an expiry); a new hash
        configuration with it. Mutates."""
        if config is not None:
            self.configs[engine] = config
            self._algos[engine] = config.hash_algo
            self._none_hashes[engine] = config.none_hash
        self.state[engine] = EngineState()

    def add_pending(self, engine: str, hashes: Sequence[bytes],
                    max_pending: int = 65_536,
                    token_ids: Sequence[int] | None = None) -> None:
        """Count `hashes` as held by `engine` from now on, while the routed request that
        brings them is in flight and for a grace period after (`release_pending`), or until
        their BlockStored arrives; with the prompt's `token_ids` (the chain of an engine that
        reuses divergent blocks), the contents of those not cached yet enter the pending
        divergent-block index. Mutates.

        Blocks the events show cached count too: the engine may evict one before it
        schedules the request (another request's allocation takes it first), and the request
        then computes it again, so a request routed after it finds it either way."""
        state = self.state[engine]
        pending = state.pending
        if len(pending) + len(hashes) > max_pending:
            now = time.monotonic()
            for key in [k for k, entry in pending.items() if not _is_pending(entry, now)]:
                del pending[key]
            state.pending_successors = {
                content: entry for content, entry in state.pending_successors.items()
                if entry[0] in pending}
            if len(pending) + len(hashes) > max_pending:
                pending.clear()  # a bound: losing them only costs a burst's routing
                state.pending_successors.clear()
        if len(state.pending_successors) > 2 * len(pending) + 1024:  # failed requests' ones
            state.pending_successors = {
                content: entry for content, entry in state.pending_successors.items()
                if entry[0] in pending}
        config = self.configs[engine]
        group = config.route_group
        size, lookahead = config.block_size, config.lookahead_tokens
        parent = _ROOT
        for index, block_hash in enumerate(hashes):
            key = low64(block_hash)
            count, until = pending.get(key, (0, 0.0))
            pending[key] = (count + 1, until)
            if (group, key) not in state.blocks and token_ids is not None and lookahead:
                end = (index + 1) * size
                content = (parent, tuple(token_ids[end - size:end]))
                state.pending_successors[content] = (key, tuple(token_ids[end:end + lookahead]))
            parent = key

    def release_pending(self, engine: str, hashes: Sequence[bytes], until_s: float) -> None:
        """The routed request that brought `hashes` is answered: those its events show
        cached are held as the events say from now on; the others stay pending until
        `until_s` (monotonic) unless their events arrive first. Mutates."""
        state = self.state[engine]
        pending = state.pending
        group = self.configs[engine].route_group
        for block_hash in hashes:
            key = low64(block_hash)
            entry = pending.get(key)
            if entry is None:
                continue
            if entry[0] <= 1 and (group, key) in state.blocks:
                del pending[key]
            else:
                pending[key] = (max(0, entry[0] - 1), max(entry[1], until_s))

    # ---- events ------------------------------------------------------------------------------
    def apply_batch(self, engine: str, batch: KVEventBatch, seq: int | None = None) -> None:
        """Apply one batch of an engine's events, in order. Mutates."""
        state = self.state[engine]
        state.batches += 1
        if seq is not None:
            state.last_seq = seq
        for event in batch.events:
            self._apply(engine, state, event)

    def _apply(self, engine: str, state: EngineState, event: object) -> None:
        if isinstance(event, BlockStored):
            self._stored(engine, state, event)
        elif isinstance(event, BlockRemoved):
            group = event.group_idx or 0
            medium = event.medium or ""
            for block_hash in event.block_hashes:
                key = (group, low64(block_hash))
                media = state.blocks.get(key)
                if media is None:
                    continue
                copy = (*key, medium)
                extra = state.extra_copies.get(copy)
                if extra:  # another block still holds this hash
                    if extra > 1:
                        state.extra_copies[copy] = extra - 1
                    else:
                        del state.extra_copies[copy]
                    state.removed_blocks += 1
                    continue
                media.discard(medium)
                if not media:
                    del state.blocks[key]
                    state.full_hashes.pop(key[1], None)
                state.removed_blocks += 1
        elif isinstance(event, AllBlocksCleared):
            self.clear_engine(engine)
            state.clears += 1

    def clear_engine(self, engine: str) -> None:
        """Forget every block of the engine (its cache was reset), counters kept. Mutates."""
        state = self.state[engine]
        state.blocks.clear()
        state.extra_copies.clear()
        state.full_hashes.clear()
        state.successors.clear()
        state.pending_successors.clear()

    def _stored(self, engine: str, state: EngineState, event: BlockStored) -> None:
        group = event.group_idx or 0
        medium = event.medium or ""
        keys = [low64(block_hash) for block_hash in event.block_hashes]
        counts_copies = self.configs[engine].counts_copies
        for key in keys:
            media = state.blocks.setdefault((group, key), set())
            if counts_copies and medium in media:
                copy = (group, key, medium)
                state.extra_copies[copy] = state.extra_copies.get(copy, 0) + 1
            media.add(medium)
            state.pending.pop(key, None)
        lookahead = event.lookahead_token_ids
        if lookahead and len(lookahead) == len(keys):
            self._note_successors(state, event, keys, lookahead)
        state.stored_blocks += len(keys)
        config = self.configs[engine]
        if not config.verify:
            return
        parent = self._full_parent(engine, state, event.parent_block_hash)
        if parent is None:
            state.unverifiable_blocks += len(keys)
            return
        try:
            expected = recompute_block_hashes(
                at_hash_unit(event, config.block_size), self._algos[engine], parent,
                config.lora_paths,
            )
            stride = event.block_size // config.block_size
            if stride > 1:  # the group's block is named by the last hash-unit hash in it
                expected = expected[stride - 1::stride]
        except VerifyError:
            state.unverifiable_blocks += len(keys)
            return
        for key, wire, full in zip(keys, event.block_hashes, expected):
            matched = wire == full if isinstance(wire, bytes) else low64(full) == wire
            if matched:  # then low64(full) == key
                state.verified_blocks += 1
                state.full_hashes[key] = full
            else:
                state.mismatched_blocks += 1

    def _note_successors(self, state: EngineState, event: BlockStored, keys: list[int],
                         lookahead: Sequence[Sequence[int]]) -> None:
        """Enter the event's blocks into the divergent-block index by content, the latest
        over earlier ones (as the engine's index); entries of evicted blocks are dropped once
        the index outgrows the cached blocks twice over. Mutates."""
        parent = event.parent_block_hash
        previous = low64(parent) if parent is not None else _ROOT
        size, tokens = event.block_size, event.token_ids
        successors = state.successors
        for index, (key, successor) in enumerate(zip(keys, lookahead)):
            content = (previous, tuple(tokens[index * size:(index + 1) * size]))
            successors[content] = (key, tuple(successor))
            routed = state.pending_successors.get(content)
            if routed is not None and routed[0] == key:  # arrived: the entry above is it
                del state.pending_successors[content]
            previous = key
        if len(successors) > 2 * len(state.blocks) + 1024:
            group = event.group_idx or 0
            state.successors = {content: entry for content, entry in successors.items()
                                if (group, entry[0]) in state.blocks}

    def _full_parent(
        self, engine: str, state: EngineState, parent: ExternalBlockHash | None
    ) -> bytes | None:
        if parent is None:
            return self._none_hashes[engine]
        if isinstance(parent, bytes):
            return parent
        return state.full_hashes.get(low64(parent))

    # ---- routing -----------------------------------------------------------------------------
    def prompt_hashes(
        self, engine: str, token_ids: Sequence[int], inputs: HashInputs,
        lookahead_tokens: int | None = None,
    ) -> list[bytes]:
        """The prompt's chain at the engine's hash unit, with its L (or `lookahead_tokens`:
        a hybrid engine's Mamba groups hash with L = 0)."""
        config = self.configs[engine]
        lookahead = config.lookahead_tokens if lookahead_tokens is None else lookahead_tokens
        return hash_prompt(
            self._algos[engine], self._none_hashes[engine], config.block_size,
            format_for(lookahead), token_ids, inputs,
        )

    def holds(self, engine: str, group: int, block_hash: bytes,
              pending_at_s: float | None = None) -> bool:
        """Whether the engine's events say it holds `block_hash` in `group`; with
        `pending_at_s`, a block routed to it and still pending then counts too. Pure."""
        state = self.state[engine]
        key = low64(block_hash)
        if (group, key) in state.blocks:
            return True
        return pending_at_s is not None and _is_pending(state.pending.get(key), pending_at_s)

    def matched_blocks(self, engine: str, hashes: Sequence[bytes],
                       pending_at_s: float | None = None) -> int:
        """Leading blocks of the chain that the engine holds in its routed group; with
        `pending_at_s`, blocks routed to it and still pending at that time count too. Pure."""
        state = self.state[engine]
        blocks = state.blocks
        pending = state.pending if pending_at_s is not None else {}
        now = pending_at_s if pending_at_s is not None else 0.0
        group = self.configs[engine].route_group
        matched = 0
        for block_hash in hashes:
            key = low64(block_hash)
            if (group, key) not in blocks and not _is_pending(pending.get(key), now):
                break
            matched += 1
        return matched

    def divergent_block_cached(self, engine: str, hashes: Sequence[bytes],
                               token_ids: Sequence[int], index: int,
                               pending_at_s: float | None = None) -> bool:
        """Whether the engine holds block `index` of the prompt under another successor
        (`divergent_block`). Pure."""
        return self.divergent_block(engine, hashes, token_ids, index, pending_at_s) is not None

    def divergent_block(self, engine: str, hashes: Sequence[bytes], token_ids: Sequence[int],
                        index: int, pending_at_s: float | None = None,
                        holds: Callable[[int], bool] | None = None) -> int | None:
        """The key of the block the engine holds as block `index` of the prompt (its tokens
        after the same chain) under another successor: the latest block its events stored
        with that content (parent and tokens), still cached, whose hash the prompt's tokens
        reproduce with that block's own successors; None if there is none. With
        `pending_at_s`, a block routed there and still pending then, with that content, comes
        first (it is the latest). With `holds` (a pool mirror's), whether a block is still
        cached, routed ones included, is its answer. Pure."""
        state = self.state[engine]
        config = self.configs[engine]
        size = config.block_size
        block = tuple(token_ids[index * size:(index + 1) * size])
        if len(block) < size or index > len(hashes):
            return None
        content = (low64(hashes[index - 1]) if index else _ROOT, block)
        entry = None
        if holds is not None:
            for table in (state.pending_successors, state.successors):
                entry = table.get(content)
                if entry is not None and holds(entry[0]):
                    break
                entry = None
            if entry is None:
                return None
        if entry is None and pending_at_s is not None:
            entry = state.pending_successors.get(content)
            if entry is not None and not _is_pending(state.pending.get(entry[0]),
                                                     pending_at_s):
                entry = None
        if entry is None:
            entry = state.successors.get(content)
            if entry is None or (config.route_group, entry[0]) not in state.blocks:
                return None
        parent = hashes[index - 1] if index else self._none_hashes[engine]
        recomputed = hash_lookahead_block(self._algos[engine], parent, list(block),
                                          list(entry[1]), None)
        return entry[0] if low64(recomputed) == entry[0] else None

    def route(
        self,
        token_ids: Sequence[int],
        *,
        lora_name: str | None = None,
        cache_salt: str | None = None,
        mm_items: Sequence[MultiModalItem] = (),
    ) -> RouteResult:
        """The engine holding the longest prefix (ties: the first configured). Pure.

        Raises ValueError for a LoRA adapter whose path no engine config knows.
        """
        if not self.configs:
            return RouteResult(None, 0, {}, 0)
        per_engine: dict[str, int] = {}
        hashes_by_key: dict[tuple, list[bytes]] = {}
        num_prompt_blocks = 0
        for name, config in self.configs.items():
            lora = None
            if lora_name is not None:
                path = config.lora_paths.get(lora_name)
                if path is None:
                    raise ValueError(f"engine {name!r}: no path configured for LoRA {lora_name!r}")
                lora = LoRARef(lora_name, path)
            # engines with the same hash config share one hashing of the prompt
            key = (config.algo, config.seed, config.block_size, config.lookahead_tokens, lora)
            hashes = hashes_by_key.get(key)
            if hashes is None:
                inputs = HashInputs(lora=lora, mm_items=tuple(mm_items), cache_salt=cache_salt)
                hashes = self.prompt_hashes(name, token_ids, inputs)
                hashes_by_key[key] = hashes
            num_prompt_blocks = max(num_prompt_blocks, len(hashes))
            per_engine[name] = self.matched_blocks(name, hashes) * config.block_size
        best = max(per_engine, key=lambda name: per_engine[name])
        return RouteResult(best, per_engine[best], per_engine, num_prompt_blocks)

    # ---- stats -------------------------------------------------------------------------------
    def stats(self) -> dict[str, dict[str, Any]]:
        return {name: state.counters() for name, state in self.state.items()}
