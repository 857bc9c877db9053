"""The store tier: KV blocks (target + draft) shared by engines through a Valkey/Redis server.

Owns `StoreConnector` (`--kv-connector store`): the tier connector (`tier.py`) over a
`RedisBlockStore` (`redis_store.py`), with the lookups, save checks and loads batched into one
round trip per batch of blocks, the embedded server (`--kv-store-url embedded`,
`embedded_valkey.py`) started at `initialize` and stopped at `shutdown`, and the start-up rule
for an unreachable store (an error naming the flag, or `--kv-store-optional`: start without it
and connect when it appears).

Engines meet in the store only under the same namespace (`namespace.DiskNamespace`: model
weights fingerprint, dtype and shapes of target and draft KV, block size, hash algorithm, hash
seed, lookahead tokens L, codec version), so a random hash seed is refused.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import replace

from speckv.cache.block import CacheKey, make_cache_key
from speckv.connectors.base import ExternalHit, RequestBlocks
from speckv.connectors.embedded_valkey import GIB, EmbeddedValkey
from speckv.connectors.layout import DeviceKV
from speckv.connectors.metadata import ConnectorStats, LoadFailure, RequestSave, StepMetadata
from speckv.connectors.namespace import DiskNamespace, lane_label, persistent_hash_seed
from speckv.connectors.redis_store import (
    DEFAULT_BATCH_BLOCKS,
    DEFAULT_TIMEOUT_S,
    RedisBlockStore,
    StoreEndpoint,
    StoreUnavailable,
)
from speckv.connectors.rules import (
    ConnectorMode,
    ConnectorRequest,
    block_hashes,
    num_lookup_candidates,
    num_servable_blocks,
)
from speckv.connectors.store import BlockStore
from speckv.connectors.tier import DEFAULT_MAX_PENDING_BLOCKS, TierConnector
from speckv.connectors.tier_scheduler import TierSchedulerSide, first_block
from speckv.connectors.tier_worker import TierWorkerSide

logger = logging.getLogger("speckv.connectors.store")

MEDIUM_STORE = "STORE"
EMBEDDED = "embedded"
DEFAULT_STORE_GIB = 4.0  # maxmemory of the embedded server


def _redis(store: BlockStore) -> RedisBlockStore:
    assert isinstance(store, RedisBlockStore)
    return store


class StoreSchedulerSide(TierSchedulerSide):
    """Lookups and save checks in one round trip per batch, not per block."""

    def _present_locally(self, key: CacheKey) -> bool:
        if key in self.pending:
            return True
        with self.copier.cond:
            return key in self.copier.in_flight

    def peek_num_matched_tokens(self, request: ConnectorRequest,
                                num_local_hit_tokens: int) -> ExternalHit:
        mode = self.mode
        start = first_block(num_local_hit_tokens, mode)
        hashes = block_hashes(request, mode)
        end = num_lookup_candidates(request.num_tokens, len(hashes), mode.block_size)
        keys = [make_cache_key(hashes[i], mode.group_id) for i in range(start, end)]
        run = _redis(self.store).count_present_prefix(keys, self._present_locally)
        servable = num_servable_blocks(run, mode)
        if servable == 0:
            return ExternalHit(0)
        return ExternalHit(servable * mode.block_size, self.medium)

    def collect_saves(self, blocks: RequestBlocks) -> RequestSave | None:
        # The base asks `contains` once per candidate block; answer them all in one round trip
        # per batch first (a superset of the candidates: the blocks not yet considered).
        mode = self.mode
        tracked = self.tracked.get(blocks.request.request_id)
        first = tracked.num_considered_blocks if tracked is not None else 0
        hashes = block_hashes(blocks.request, mode)
        last = min(len(hashes), len(blocks.block_ids))
        store = _redis(self.store)
        store.prime([make_cache_key(hashes[i], mode.group_id) for i in range(first, last)])
        try:
            return super().collect_saves(blocks)
        finally:
            store.unprime()


class StoreWorkerSide(TierWorkerSide):
    """Loads in one MGET per batch."""

    def load_blocks(self, meta: StepMetadata) -> list[LoadFailure]:
        meta = self.own(meta)
        with self.copier.cond:
            local = set(self.copier.in_flight)
        local.update(self.step_snapshots)
        plan = [block for load in meta.loads for block in load.blocks if block.key not in local]
        store = _redis(self.store)
        store.plan_loads(plan)
        try:
            return super().load_blocks(meta)
        finally:
            store.plan_loads(())


class StoreConnector(TierConnector):
    medium = MEDIUM_STORE
    scheduler_side_type = StoreSchedulerSide
    worker_side_type = StoreWorkerSide

    def __init__(self, url: str = EMBEDDED, size_gib: float = DEFAULT_STORE_GIB, *,
                 model_fingerprint: str, hash_algo: str, hash_seed: str | None,
                 cluster: bool = False, optional: bool = False,
                 timeout_s: float = DEFAULT_TIMEOUT_S, name: str = "store",
                 batch_blocks: int = DEFAULT_BATCH_BLOCKS,
                 max_pending_blocks: int = DEFAULT_MAX_PENDING_BLOCKS) -> None:
        if not url:
            raise ValueError("--kv-store-url must be a redis:// URL or 'embedded'")
        if not size_gib > 0:
            raise ValueError(f"--kv-store-gib must be > 0, got {size_gib}")
        if not model_fingerprint:
            raise ValueError("the store KV tier needs a model fingerprint")
        self.embedded = url == EMBEDDED
        if self.embedded and cluster:
            raise ValueError("--kv-store-cluster needs --kv-store-url redis+cluster://... "
                             "(the embedded server is a single node)")
        # validates the URL now, so a typo fails before any model loads
        self.endpoint = (StoreEndpoint("redis://127.0.0.1:1/0", False, timeout_s)
                         if self.embedded else StoreEndpoint(url, cluster, timeout_s))
        super().__init__(name, max_pending_blocks)
        self.size_gib = size_gib
        self.optional = optional
        self.batch_blocks = batch_blocks
        self.model_fingerprint = model_fingerprint
        self.hash_algo = hash_algo
        self.hash_seed = persistent_hash_seed(
            hash_seed, "the store KV tier (--kv-connector store)")
        self.namespace: DiskNamespace | None = None
        self.server: EmbeddedValkey | None = None

    @property
    def redis_store(self) -> RedisBlockStore:
        store = self.store
        assert isinstance(store, RedisBlockStore)
        return store

    # ---- set-up ------------------------------------------------------------------------------
    def _make_lane(self, index: int, share: float) -> TierConnector:
        """A lane of a hybrid model: the same server (the embedded one started once, here),
        its own namespace (the group's layout). The server's memory is shared, not split."""
        if self.embedded and self.server is None:
            self._start_embedded(self.size_gib)
        lane = StoreConnector(
            self.endpoint.url if not self.embedded else self.server.url,  # type: ignore[union-attr]
            self.size_gib, model_fingerprint=self.model_fingerprint, hash_algo=self.hash_algo,
            hash_seed=self.hash_seed, cluster=self.endpoint.cluster, optional=self.optional,
            timeout_s=self.endpoint.timeout_s, name=f"{self.name}/g{index}",
            batch_blocks=self.batch_blocks, max_pending_blocks=self.max_pending_blocks)
        return lane

    def _start_embedded(self, size_gib: float) -> None:
        self.server = EmbeddedValkey(int(size_gib * GIB)).start()
        self.endpoint = replace(self.endpoint, url=self.server.url)

    def _open_store(self, kv: DeviceKV, mode: ConnectorMode) -> BlockStore:
        self.namespace = DiskNamespace(self.model_fingerprint, self.hash_algo, self.hash_seed,
                                       mode.lookahead_tokens, kv.layout, lane_label(mode))
        if self.embedded:
            maxmemory = int(self.size_gib * GIB)
            if maxmemory < 2 * kv.layout.nbytes:
                raise ValueError(f"--kv-store-gib {self.size_gib} GiB holds no KV block of "
                                 f"{kv.layout.nbytes} bytes")
            self._start_embedded(self.size_gib)
        endpoint = self.endpoint
        store = RedisBlockStore(endpoint.connect(), endpoint, self.namespace, self.batch_blocks)
        try:
            store.ping()
            store.publish_namespace()
        except StoreUnavailable as error:
            if not self.optional:
                store.close()
                self._stop_server()
                raise ConnectionError(
                    f"--kv-store-url {endpoint.redacted_url}: the KV store is unreachable "
                    f"({error}); start it, fix the URL, or pass --kv-store-optional to start "
                    "without it"
                ) from error
            logger.warning("KV store %s is unreachable at start (--kv-store-optional): "
                           "starting without it, retrying with backoff", endpoint.redacted_url)
        return store

    def _stop_server(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.server = None

    def shutdown(self) -> None:
        """Stop the copy thread, close the client and stop the embedded server."""
        super().shutdown()
        if self._store is not None:
            self.redis_store.close()
        self._stop_server()

    # ---- both --------------------------------------------------------------------------------
    def reset_cache(self) -> bool:
        """Delete this namespace's blocks from the store (other namespaces, other engines'
        models, stay). False (nothing dropped) while a load is planned."""
        if self.lanes:
            super().reset_cache()
            return True
        if self.scheduler.planned_loads:
            return False
        super().reset_cache()  # its count compares against the whole server's keys: ignore
        return True

    def stats(self) -> dict[str, ConnectorStats]:
        stats = super().stats()
        if self._store is not None:
            mine = stats[self.name]
            stats[self.name] = replace(mine, extra={**mine.extra,
                                                    **self.redis_store.counters()})
        return stats


def describe_endpoint(connector: StoreConnector) -> str:
    """One line for logs and benches: where the store is."""
    where = "embedded" if connector.embedded else connector.endpoint.redacted_url
    return f"{where}{' (cluster)' if connector.endpoint.cluster else ''}"


__all__: Sequence[str] = ("EMBEDDED", "MEDIUM_STORE", "StoreConnector", "describe_endpoint")
