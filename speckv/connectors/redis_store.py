"""A `BlockStore` over any Redis-protocol server (Valkey, Redis, Redis Cluster), via redis-py.

Owns the store URL rules (`StoreEndpoint`), the key names, the value checks and the store's
health (`StoreHealth`: a counted outage, a log line, reconnection with backoff). One key per
block:

    speckv:<namespace id>:<group>:<block hash hex>   the `codec.py` bytes: prefix, msgpack
                                                      header, raw target + draft KV
    speckv:<namespace id>:namespace                  what the id stands for (JSON, for people)

(No braces in the key: `{...}` is a Redis Cluster hash tag and would put a whole namespace
in one slot.)

How each call meets the server:
- writes are `SET key value NX`: the first writer wins; another engine's value for the same
  key is the same bytes by construction (same namespace, same hash);
- the prefix scan asks `EXISTS` for a batch of the chain's keys in one pipelined round trip
  per batch, stopping at the first batch with a miss;
- a load plan is fetched with one `MGET` per batch; a key gone since the lookup (LRU evicted)
  arrives as nothing and the load stops there (the engine recomputes the rest);
- a value that fails any check (magic, version, namespace, hash, parent, tokens, lookahead
  tokens, extra keys, layout, length, checksum) is a miss, deleted, never loaded.

Faults never fail a request: a connection error or a per-call timeout makes the call a miss
(a lookup of 0, a failed load, a dropped save), marks the store down with one warning, and
later calls skip the network until a backoff delay passes; the first call after it tries again
and, if it works, logs that the store is back.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from speckv.cache.block import CacheKey, make_cache_key, split_cache_key
from speckv.connectors.codec import (
    CodecMiss,
    DecodedBlock,
    MissReason,
    decode_block,
    encode_block,
    encoded_nbytes,
)
from speckv.connectors.layout import BlockLayout, BlockTensors
from speckv.connectors.metadata import BlockDescriptor
from speckv.connectors.namespace import DiskNamespace
from speckv.connectors.store import PutOutcome, PutResult, StoreUsage

logger = logging.getLogger("speckv.connectors.store")

KEY_PREFIX = "speckv"
DEFAULT_TIMEOUT_S = 1.0
DEFAULT_BATCH_BLOCKS = 32  # keys per EXISTS pipeline, and at most per MGET
# bytes per MGET reply: a reply of tens of MB parses slower than a GET loop (measured with
# redis-py + hiredis on loopback: 3.8 MB replies at half the speed of 1.5 MB ones); 2 MiB keeps
# one round trip per batch at the GET loop's speed
MGET_BATCH_BYTES = 2 << 20
USAGE_MAX_AGE_S = 1.0  # stats() may run every step: ask the server at most once a second
BACKOFF_START_S = 0.25
BACKOFF_MAX_S = 5.0
PLAIN_SCHEMES = ("redis", "rediss", "unix")
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}

# A server that cannot be reached, or answers too late, is an outage, not a bad request.
_OUTAGE_ERRORS = (redis.ConnectionError, redis.TimeoutError, OSError)


class StoreUnavailable(ConnectionError):
    """The store is down (or in its backoff delay): the call did not reach it."""


@dataclass(frozen=True)
class StoreEndpoint:
    """Where the store is: a redis-py URL (password and database in it), cluster or not."""

    url: str
    cluster: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        scheme = parts.scheme.lower()
        if scheme in CLUSTER_SCHEMES:
            object.__setattr__(self, "cluster", True)
            object.__setattr__(self, "url", urlunsplit(parts._replace(
                scheme=CLUSTER_SCHEMES[scheme])))
        elif scheme not in PLAIN_SCHEMES:
            raise ValueError(
                f"--kv-store-url {self.redacted_url!r}: use redis://[:password@]host:port[/db], "
                "rediss:// (TLS), unix:///path, redis+cluster://host:port, or 'embedded'"
            )
        if self.cluster and scheme == "unix":
            raise ValueError("--kv-store-cluster needs a redis:// or rediss:// URL, not unix://")
        if self.cluster and parts.path not in ("", "/", "/0"):
            raise ValueError(f"--kv-store-url {self.redacted_url!r}: Redis Cluster has only "
                             "database 0")
        if not self.timeout_s > 0:
            raise ValueError(f"--kv-store-timeout must be > 0 seconds, got {self.timeout_s}")

    @property
    def redacted_url(self) -> str:
        """The URL without its password, for messages and logs."""
        parts = urlsplit(self.url)
        if parts.password is None:
            return self.url
        user = parts.username or ""
        host = parts.hostname or ""
        netloc = f"{user}:***@{host}" + (f":{parts.port}" if parts.port else "")
        return urlunsplit(parts._replace(netloc=netloc))

    def connect(self) -> redis.Redis | RedisCluster:
        """A client whose every call fails within `timeout_s` and is never retried here (the
        store's health decides when to try again)."""
        options = dict(socket_timeout=self.timeout_s, socket_connect_timeout=self.timeout_s,
                       retry=Retry(NoBackoff(), 0), health_check_interval=0)
        if self.cluster:
            return RedisCluster.from_url(self.url, **options)
        return redis.Redis.from_url(self.url, **options)


class StoreHealth:
    """Up or down, with backoff; counts outages, timeouts and reconnections. Thread-safe."""

    def __init__(self, endpoint_text: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._text = endpoint_text
        self._clock = clock
        self._lock = threading.Lock()
        self.up = True
        self._backoff_s = 0.0
        self._next_try = 0.0
        self.outages = 0  # times the store went from up to down
        self.errors = 0  # calls that failed on a connection error or a timeout
        self.timeouts = 0  # of which timeouts
        self.skipped_calls = 0  # calls answered as a miss without the network (backoff)
        self.reconnects = 0
        self.last_error = ""

    def allow(self) -> bool:
        """Whether a call may use the network now; counts a skipped call if not."""
        with self._lock:
            if self.up or self._clock() >= self._next_try:
                return True
            self.skipped_calls += 1
            return False

    def succeeded(self) -> None:
        with self._lock:
            if self.up:
                return
            self.up = True
            self._backoff_s = 0.0
            self.reconnects += 1
        logger.warning("KV store %s is reachable again; lookups and saves resume", self._text)

    def failed(self, error: BaseException) -> None:
        with self._lock:
            self.errors += 1
            if isinstance(error, redis.TimeoutError):
                self.timeouts += 1
            self.last_error = f"{type(error).__name__}: {error}"
            self._backoff_s = min(BACKOFF_MAX_S, max(BACKOFF_START_S, self._backoff_s * 2))
            self._next_try = self._clock() + self._backoff_s
            went_down = self.up
            self.up = False
            if went_down:
                self.outages += 1
        if went_down:
            logger.warning("KV store %s failed (%s): serving without it (lookups miss, saves are "
                           "dropped); retrying with backoff", self._text, self.last_error)

    def counters(self) -> dict[str, object]:
        with self._lock:
            return {"store_up": self.up, "store_outages": self.outages,
                    "store_errors": self.errors, "store_timeouts": self.timeouts,
                    "store_skipped_calls": self.skipped_calls,
                    "store_reconnects": self.reconnects, "store_last_error": self.last_error}


def block_key(namespace_id: str, key: CacheKey) -> bytes:
    block_hash, group_id = split_cache_key(key)
    return f"{KEY_PREFIX}:{namespace_id}:{group_id}:{block_hash.hex()}".encode()


def cache_key_of(namespace_id: str, name: bytes) -> CacheKey | None:
    """The cache key a block key stands for; None for anything else."""
    prefix = f"{KEY_PREFIX}:{namespace_id}:".encode()
    if not name.startswith(prefix):
        return None
    group, _, hash_hex = name[len(prefix):].decode(errors="replace").partition(":")
    try:
        return make_cache_key(bytes.fromhex(hash_hex), int(group))
    except ValueError:
        return None


class RedisBlockStore:
    """The `BlockStore` of the store tier. Shared by every engine that uses the server, so:
    no pins (another engine's writes may evict a block at any time; a load that finds it
    gone fails from there), and `usage()` describes the whole server."""

    medium = "STORE"

    def __init__(self, client: redis.Redis | RedisCluster, endpoint: StoreEndpoint,
                 namespace: DiskNamespace, batch_blocks: int = DEFAULT_BATCH_BLOCKS) -> None:
        if batch_blocks < 1:
            raise ValueError(f"batch_blocks must be >= 1, got {batch_blocks}")
        self.client = client
        self.endpoint = endpoint
        self.namespace = namespace
        self.layout: BlockLayout = namespace.layout
        self.batch_blocks = batch_blocks
        self.mget_blocks = max(1, min(batch_blocks, MGET_BATCH_BYTES // max(1, self.layout.nbytes)))
        self.health = StoreHealth(endpoint.redacted_url)
        self._ns = namespace.ident
        self._lock = threading.Lock()
        self._invalid = 0  # values that failed a check (deleted)
        self._usage = StoreUsage(0, 0, 0)
        self._usage_at = -float("inf")
        # engine thread only: the keys the connector is about to ask `contains` about, already
        # answered by one pipelined round trip, and the current load plan with its MGET buffer
        self._primed: dict[CacheKey, bool] = {}
        self._plan: dict[CacheKey, int] = {}
        self._plan_keys: list[CacheKey] = []
        self._fetched: dict[CacheKey, bytes | None] = {}

    # ---- health ------------------------------------------------------------------------------
    def _call(self, fn: Callable[[], object]) -> object:
        """Run one server call under the health rules; StoreUnavailable if it did not work."""
        if not self.health.allow():
            raise StoreUnavailable(f"KV store {self.endpoint.redacted_url} is down")
        try:
            result = fn()
        except _OUTAGE_ERRORS as error:
            self.health.failed(error)
            raise StoreUnavailable(str(error)) from error
        self.health.succeeded()
        return result

    def ping(self) -> None:
        """Raise StoreUnavailable unless the server answers now (start-up check)."""
        self._call(self.client.ping)

    def publish_namespace(self) -> None:
        """Write what the namespace id stands for beside the blocks (first writer wins)."""
        name = f"{KEY_PREFIX}:{self._ns}:namespace"
        self._call(lambda: self.client.set(name, json.dumps(self.namespace.fields()), nx=True))

    # ---- lookups -----------------------------------------------------------------------------
    def _exists(self, keys: Sequence[CacheKey]) -> list[bool]:
        """One pipelined round trip: whether each key is in the store."""
        def run() -> list[object]:
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                pipe.exists(block_key(self._ns, key))
            return pipe.execute()
        return [bool(n) for n in self._call(run)]

    def count_present_prefix(self, keys: Sequence[CacheKey],
                             present_locally: Callable[[CacheKey], bool]) -> int:
        """How many of `keys`, from the first, are present (locally or in the store): one
        round trip per batch of `batch_blocks`, stopping at the first miss. An outage ends
        the run where it happens."""
        run = 0
        for begin in range(0, len(keys), self.batch_blocks):
            batch = keys[begin:begin + self.batch_blocks]
            remote = [key for key in batch if not present_locally(key)]
            try:
                answers = dict(zip(remote, self._exists(remote))) if remote else {}
            except StoreUnavailable:
                answers = dict.fromkeys(remote, False)
            for key in batch:
                if not answers.get(key, True):  # a local key has no answer: present
                    return run
                run += 1
        return run

    def prime(self, keys: Sequence[CacheKey]) -> None:
        """Answer the coming `contains` calls about `keys` in one round trip per batch (the
        saves check each candidate block; one EXISTS each would cost a round trip per block)."""
        self._primed = {}
        for begin in range(0, len(keys), self.batch_blocks):
            batch = keys[begin:begin + self.batch_blocks]
            try:
                self._primed.update(zip(batch, self._exists(batch)))
            except StoreUnavailable:
                self._primed.update(dict.fromkeys(keys[begin:], False))
                return

    def unprime(self) -> None:
        self._primed = {}

    def contains(self, key: CacheKey) -> bool:
        primed = self._primed.get(key)
        if primed is not None:
            return primed
        try:
            return self._exists([key])[0]
        except StoreUnavailable:
            return False

    # ---- loads -------------------------------------------------------------------------------
    def plan_loads(self, blocks: Sequence[BlockDescriptor]) -> None:
        """The blocks the next `get` calls will ask for, in order: fetched one MGET per batch
        as the calls reach them. An empty plan ends the previous one."""
        self._plan_keys = [block.key for block in blocks]
        self._plan = {key: index for index, key in enumerate(self._plan_keys)}
        self._fetched = {}

    def _mget(self, keys: Sequence[CacheKey]) -> list[bytes | None]:
        names = [block_key(self._ns, key) for key in keys]
        if isinstance(self.client, RedisCluster):
            return self._call(lambda: self.client.mget_nonatomic(names))
        return self._call(lambda: self.client.mget(names))

    def _raw(self, key: CacheKey) -> bytes | None:
        if key in self._fetched:
            return self._fetched.pop(key)
        index = self._plan.get(key)
        if index is None:
            return self._mget([key])[0]
        batch = self._plan_keys[index:index + self.mget_blocks]
        values = self._mget(batch)
        self._fetched = dict(zip(batch[1:], values[1:]))
        return values[0]

    def get(self, block: BlockDescriptor) -> BlockTensors | CodecMiss:
        try:
            value = self._raw(block.key)
        except StoreUnavailable as error:
            return CodecMiss(MissReason.IO_ERROR, str(error))
        if value is None:
            return CodecMiss(MissReason.NOT_FOUND, "evicted from the store")
        with warnings.catch_warnings():
            # The tensors view the reply's immutable bytes (no copy of ~1 MB per block): the
            # tier only reads them, copying into the paged caches before the next `get`.
            warnings.filterwarnings("ignore", "The given buffer is not writable")
            decoded = decode_block(memoryview(value), self._ns, block, self.layout)
        if isinstance(decoded, DecodedBlock):
            return decoded.tensors
        # never loaded; deleted so no engine trips on it again (a correct block replaces it)
        with self._lock:
            self._invalid += 1
        logger.warning("KV store: deleted an invalid value for block %s (%s: %s)",
                       block.block_hash.hex()[:16], decoded.reason.value, decoded.detail)
        with contextlib.suppress(StoreUnavailable):
            self._call(lambda: self.client.delete(block_key(self._ns, block.key)))
        return decoded

    # ---- writes ------------------------------------------------------------------------------
    def pin(self, key: CacheKey) -> None:
        """Nothing to do: a shared server cannot pin for one engine (see the class docstring)."""

    def unpin(self, key: CacheKey) -> None:
        """Nothing to do (no pins)."""

    def put(self, block: BlockDescriptor, tensors: BlockTensors) -> PutResult:
        """SET NX. Raises StoreUnavailable during an outage (the tier counts a save error)."""
        chunks = encode_block(self._ns, block, self.layout, tensors)
        value = b"".join(chunks)
        name = block_key(self._ns, block.key)
        try:
            stored = self._call(lambda: self.client.set(name, value, nx=True))
        except redis.ResponseError as error:  # OOM with a policy that cannot evict
            if "OOM" in str(error):
                return PutResult(PutOutcome.NO_ROOM)
            raise
        if stored:
            return PutResult(PutOutcome.STORED, encoded_nbytes(chunks))
        return PutResult(PutOutcome.PRESENT)

    def clear(self) -> list[CacheKey]:
        """Delete this namespace's blocks (other namespaces are untouched)."""
        pattern = f"{KEY_PREFIX}:{self._ns}:*"
        removed: list[CacheKey] = []

        def run() -> None:
            names = list(self.client.scan_iter(match=pattern, count=1000))
            for begin in range(0, len(names), 256):
                batch = names[begin:begin + 256]
                pipe = self.client.pipeline(transaction=False)
                for name in batch:
                    pipe.unlink(name)
                pipe.execute()
            removed.extend(key for key in (cache_key_of(self._ns, n) for n in names)
                           if key is not None)
        try:
            self._call(run)
        except StoreUnavailable:
            return []
        return removed

    def usage(self) -> StoreUsage:
        """The server's keys and memory (all namespaces: the server is shared), at most a
        second old; zeros while the store is down."""
        now = time.monotonic()
        with self._lock:
            if now - self._usage_at < USAGE_MAX_AGE_S:
                return self._usage
        usage = self._read_usage()
        with self._lock:
            self._usage, self._usage_at = usage, now
        return usage

    def _read_usage(self) -> StoreUsage:
        def run() -> tuple[int, int, int]:
            if isinstance(self.client, RedisCluster):
                primaries = RedisCluster.PRIMARIES
                raw = self.client.info("memory", target_nodes=primaries)
                memory = (list(raw.values()) if raw and all(isinstance(v, dict)
                                                            for v in raw.values()) else [raw])
                count = self.client.dbsize(target_nodes=primaries)
                keys = sum(count.values()) if isinstance(count, dict) else int(count)
            else:
                memory = [self.client.info("memory")]
                keys = int(self.client.dbsize())
            used = sum(int(m.get("used_memory", 0)) for m in memory)
            cap = sum(int(m.get("maxmemory", 0)) for m in memory)
            return keys, used, cap
        try:
            keys, used, cap = self._call(run)
        except (StoreUnavailable, redis.RedisError):
            return StoreUsage(0, 0, 0)
        return StoreUsage(keys, used, cap)

    def counters(self) -> dict[str, object]:
        with self._lock:
            invalid = self._invalid
        return {**self.health.counters(), "store_invalid_values": invalid}

    def close(self) -> None:
        self.client.close()
