"""Real KV tiers under the toy runner: content checks on every store and load, injected faults.

Owns `CheckedStore`, a `BlockStore` wrapper put in front of a real tier's storage (CPU pool or
disk directory) through `TierConnector.wrap_store`. Over a `PagedSymbolicKV` every block's
bytes say which tokens its KV was computed from, so the wrapper checks, on the copy thread and
on loads, that each block a tier stores or serves holds exactly the KV its header (block hash,
tokens, lookahead tokens) names: target KV at every position, and draft KV wherever the header
proves the tokens it was computed from (all of it with lookahead hashes; with legacy hashes,
positions whose successors lie inside the block). It also fails loads on demand (a seeded rate,
or a predicate), as a vanished or unreadable block would, so the engine's recompute path runs.

`instrument_tiers` wraps every tier of a connector (a multi-connector's children included) and,
with `copy_seed`, puts each tier's stores on a seeded schedule instead of its copy thread
(`speckv.connectors.copy_schedule`), so the run replays exactly from its seeds.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Callable

from speckv.cache.block import CacheKey
from speckv.connectors import KVConnector
from speckv.connectors.codec import CodecMiss, MissReason
from speckv.connectors.copy_schedule import SeededCopySchedule
from speckv.connectors.layout import BlockLayout, BlockTensors
from speckv.connectors.metadata import BlockDescriptor
from speckv.connectors.store import BlockStore, PutResult, StoreUsage
from speckv.connectors.tier import TierConnector
from speckv.simulation.paged_kv import decode_draft, decode_target
from speckv.simulation.tier_groups import group_block_violation

FailLoad = Callable[[BlockDescriptor], bool]


def block_violation(block: BlockDescriptor, tensors: BlockTensors, draft_depth: int,
                    check_draft: bool = True) -> str | None:
    """Why `tensors` (a block of a `PagedSymbolicKV`: target, draft) is not the KV its header
    names; None when it is. A block of a hybrid layout's sliding-window or state group (one
    segment): `tier_groups.group_block_violation`."""
    if len(tensors) == 1:
        return group_block_violation(block, tensors)
    target, draft = tensors  # [1, 2, B, 1, 1], [1, 2, B, 1, 1 + depth]
    known = (*block.token_ids, *block.lookahead_token_ids)
    for offset, token in enumerate(block.token_ids):
        got = decode_target(target[0, :, offset, 0, 0])
        if got != token:
            return f"position {offset}: target KV of {got!r}, its header says {token}"
        if not check_draft or offset + draft_depth >= len(known):
            continue  # the header does not prove what the draft KV here was computed from
        want = tuple(known[offset + 1 : offset + 1 + draft_depth])
        got_draft = decode_draft(draft[0, :, offset, 0])
        if got_draft != want:
            return f"position {offset}: draft KV of {got_draft!r}, its header says {want}"
    return None


class CheckedStore:
    """A tier's storage with content checks and injected load failures (see module doc)."""

    def __init__(self, inner: BlockStore, draft_depth: int, check_draft: bool = True,
                 fault_rate: float = 0.0, seed: int = 0, fail_load: FailLoad | None = None,
                 check_content: bool = True) -> None:
        self.inner = inner
        self.check_content = check_content  # False over a real model's KV: faults only
        self.medium = inner.medium
        self.layout: BlockLayout = inner.layout
        self.draft_depth = draft_depth
        self.check_draft = check_draft
        self.fault_rate = fault_rate
        self.fail_load = fail_load
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.violations: list[str] = []  # appended by the copy thread and loads
        self.num_injected_faults = 0
        self.num_checked_stores = 0
        self.num_checked_loads = 0

    def _check(self, what: str, block: BlockDescriptor, tensors: BlockTensors) -> None:
        if not self.check_content:
            return
        violation = block_violation(block, tensors, self.draft_depth, self.check_draft)
        with self._lock:
            if what == "store":
                self.num_checked_stores += 1
            else:
                self.num_checked_loads += 1
            if violation is not None:
                self.violations.append(f"{self.medium} {what} of block "
                                       f"{block.block_hash.hex()[:12]} (group "
                                       f"{block.group_id}): {violation}")

    # ---- BlockStore ----------------------------------------------------------------------------
    def contains(self, key: CacheKey) -> bool:
        return self.inner.contains(key)

    def pin(self, key: CacheKey) -> None:
        self.inner.pin(key)

    def unpin(self, key: CacheKey) -> None:
        self.inner.unpin(key)

    def get(self, block: BlockDescriptor) -> BlockTensors | CodecMiss:
        injected = self.fail_load is not None and self.fail_load(block)
        if not injected and self.fault_rate:
            injected = self._rng.random() < self.fault_rate
        if injected:
            self.num_injected_faults += 1
            return CodecMiss(MissReason.IO_ERROR, "injected fault")
        found = self.inner.get(block)
        if not isinstance(found, CodecMiss):
            self._check("load", block, found)
        return found

    def put(self, block: BlockDescriptor, tensors: BlockTensors) -> PutResult:
        self._check("store", block, tensors)
        return self.inner.put(block, tensors)

    def clear(self) -> list[CacheKey]:
        return self.inner.clear()

    def usage(self) -> StoreUsage:
        return self.inner.usage()


def seeded_copy_schedule(seed: int) -> SeededCopySchedule:
    """A schedule whose eagerness (lazy: long queues, full staging; eager: stores settled
    between two saves of one step) is drawn from `seed` as well."""
    eagerness = random.Random(seed).choice((0.05, 0.2, 0.5, 0.8, 0.95))
    return SeededCopySchedule(seed, eagerness)


def tiers_of(connector: KVConnector) -> list[TierConnector]:
    """The tier connectors inside `connector` (itself, or a multi-connector's children)."""
    children = getattr(connector, "children", None)
    if children is not None:
        return [tier for child in children for tier in tiers_of(child)]
    return [connector] if isinstance(connector, TierConnector) else []


def instrument_tiers(connector: KVConnector, draft_depth: int = 0, check_draft: bool = True,
                     fault_rate: float = 0.0, seed: int = 0,
                     fail_load: FailLoad | None = None,
                     check_content: bool = True,
                     copy_seed: int | None = None) -> list[CheckedStore]:
    """Wrap every tier's storage in a `CheckedStore` (before `initialize`); returns the
    wrappers, filled in once the connector is initialized. `check_content=False` over a real
    model's KV (only a `PagedSymbolicKV` can be read back as tokens). `copy_seed`: run each
    tier's stores on `SeededCopySchedule(copy_seed + index)` (replayable) rather than on its
    copy thread; how eagerly it settles stores is drawn from the seed too."""
    stores: list[CheckedStore] = []
    for index, tier in enumerate(tiers_of(connector)):
        if copy_seed is not None:
            tier.run_copies_on(seeded_copy_schedule(copy_seed + index))
        def wrap(inner: BlockStore, index: int = index) -> BlockStore:
            store = CheckedStore(inner, draft_depth, check_draft, fault_rate, seed + index,
                                 fail_load, check_content)
            stores.append(store)
            return store

        tier.wrap_store(wrap)
    return stores
