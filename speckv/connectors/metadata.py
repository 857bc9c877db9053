"""The typed messages between a connector's scheduler side and its worker side.

Owns the plain, frozen data the engine carries from the scheduler to the model runner each step
(`ConnectorMetadata`: which tier blocks to load into which device blocks, which device blocks to
save) and back (`ConnectorOutput`: finished loads and saves, failed loads). Nothing here holds a
live request, a tensor or a lock, so a message can be logged, compared or sent to another
process.

A `BlockDescriptor` is what a tier block *is*, as the request that names it computes it: the
block hash and everything the hash covers. A tier keeps it beside the KV as the block's header
and compares it on every load, so a block is served only to a request whose own descriptor is
equal (the content check that makes fast non-cryptographic hashes safe, and a second guard
against a stale successor).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import cbor2

from speckv.cache.block import CacheKey, make_cache_key
from speckv.hashing.extra_keys import ExtraKeys


@dataclass(frozen=True)
class BlockDescriptor:
    """One block `[s, e)` of a request's hash chain: its hash and what the hash covers.

    `parent_hash` is the previous block's hash, `b""` for block 0 (the chain's seed is already
    inside `block_hash`). `lookahead_token_ids` is `tokens[e:e + L]` (empty when `L == 0`);
    `extra_keys` is `E(s, e + L)`, tagged, as the hash saw it.
    """

    block_hash: bytes
    parent_hash: bytes
    group_id: int
    token_ids: tuple[int, ...]
    lookahead_token_ids: tuple[int, ...]
    extra_keys: ExtraKeys = None

    @property
    def key(self) -> CacheKey:
        """Content address in every tier: block hash + group, as in the local block pool."""
        return make_cache_key(self.block_hash, self.group_id)

    @cached_property
    def extra_keys_digest(self) -> bytes:
        """SHA-256 of the canonical CBOR of `extra_keys` (what a serialized header keeps)."""
        return hashlib.sha256(cbor2.dumps(self.extra_keys, canonical=True)).digest()


@dataclass(frozen=True)
class RequestLoad:
    """Tier blocks to copy into one request's newly allocated device blocks, before the forward.

    `blocks[i]` goes to device block `device_block_ids[i]`; together they cover the token range
    `[first_token, first_token + len(blocks) * block_size)`, right after the local hit.
    """

    request_id: str
    first_token: int
    block_size: int
    blocks: tuple[BlockDescriptor, ...]
    device_block_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.blocks) != len(self.device_block_ids):
            raise ValueError(
                f"request {self.request_id}: {len(self.blocks)} blocks to load into "
                f"{len(self.device_block_ids)} device blocks"
            )

    @property
    def num_tokens(self) -> int:
        return len(self.blocks) * self.block_size


@dataclass(frozen=True)
class RequestSave:
    """Device blocks of one request whose target and draft KV are complete, to copy to a tier.

    `lora_name` rides along for the KV events a tier publishes when the block lands.
    """

    request_id: str
    blocks: tuple[BlockDescriptor, ...]
    device_block_ids: tuple[int, ...]
    lora_name: str | None = None

    def __post_init__(self) -> None:
        if len(self.blocks) != len(self.device_block_ids):
            raise ValueError(
                f"request {self.request_id}: {len(self.blocks)} blocks to save from "
                f"{len(self.device_block_ids)} device blocks"
            )


@dataclass(frozen=True)
class ConnectorMetadata:
    """One connector's work for one engine step (built by `build_connector_meta`)."""

    step: int
    loads: tuple[RequestLoad, ...] = ()
    saves: tuple[RequestSave, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.loads and not self.saves


@dataclass(frozen=True)
class MultiConnectorMetadata:
    """A multi-connector's step: one message per child, in child order."""

    step: int
    children: tuple[ConnectorMetadata | MultiConnectorMetadata, ...]

    @property
    def is_empty(self) -> bool:
        return all(child.is_empty for child in self.children)


StepMetadata = ConnectorMetadata | MultiConnectorMetadata


@dataclass(frozen=True)
class LoadFailure:
    """A load that stopped at a block it could not serve.

    The device blocks in `block_ids` (the failed block and every later one of the load) hold no
    valid KV: the engine recomputes the request from `first_failed_token`. Blocks before it were
    loaded and are valid.
    """

    request_id: str
    first_failed_token: int
    block_ids: tuple[int, ...]
    reason: str


@dataclass(frozen=True)
class ConnectorOutput:
    """What the worker side reports after a step (see `KVConnector.get_finished`)."""

    finished_loads: frozenset[str] = frozenset()  # loads done (fully or up to a failure)
    finished_saves: frozenset[str] = frozenset()  # finished requests whose saves all settled
    load_failures: tuple[LoadFailure, ...] = ()
    # asynchronous loads (`ExternalHit.load_async`) done since the last report, fully or up to
    # a failure (then also in `load_failures`); every one started is reported exactly once,
    # also for a request that finished (was aborted) while its load ran
    finished_recving: frozenset[str] = frozenset()
    # finished requests whose blocks were kept (`FinishDecision.delay_free`) and may be freed
    finished_sending: frozenset[str] = frozenset()

    @property
    def failed_block_ids(self) -> frozenset[int]:
        return frozenset(block_id for failure in self.load_failures for block_id in
                         failure.block_ids)


@dataclass(frozen=True)
class ConnectorStats:
    """Counters of one connector since it started. Counts are in blocks unless they say bytes."""

    name: str
    medium: str
    lookups: int = 0  # get_num_new_matched_tokens calls
    hit_blocks: int = 0  # blocks reported loadable beyond the local hit
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_failed_blocks: int = 0  # blocks reported failed (recomputed by the engine)
    saved_blocks: int = 0  # blocks that landed in the tier
    saved_bytes: int = 0
    save_skipped_blocks: int = 0  # already in the tier (or on the way): not copied again
    save_dropped_queue_full: int = 0  # the copy queue was full: the store was dropped
    save_dropped_no_room: int = 0  # the tier was full of blocks in use: the store was dropped
    save_errors: int = 0  # the tier raised while storing (stats.extra["last_save_error"])
    evicted_blocks: int = 0
    corrupt_blocks: int = 0  # stored blocks that failed a check on load (deleted)
    resident_blocks: int = 0
    resident_bytes: int = 0
    capacity_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)  # tier-specific details
