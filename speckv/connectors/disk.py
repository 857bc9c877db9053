"""The disk tier: one file per block under a namespace directory; survives a restart.

Owns `DiskBlockStore` (the files, their index and the size bound) and `DiskConnector` (the
tier connector over it). Layout on disk:

    <root>/ns-<namespace id>/namespace.json            what the id stands for (`namespace.py`)
    <root>/ns-<namespace id>/<h[:2]>/<h>.g<group>.kvb  one block: `codec.py` prefix, header,
                                                        raw target + draft KV bytes

A block is written to a temporary name in the same directory and renamed into place, so a
reader sees a whole file or none. Every load checks the whole file (magic, version, namespace,
the block's hash, parent, tokens, lookahead tokens and extra keys, layout, length, payload
checksum); a file that fails is deleted, counted as corrupt, and reported as a failed load, so
its bytes never reach a KV cache. The size bound (`--kv-offload-disk-gib`) evicts the least
recently used files first (loads refresh a file's mtime, so the order survives a restart).

A new process over the same directory and namespace hits what an earlier one stored: the
index is rebuilt from the directory at start, and a lookup that misses the index checks the
file system (another process may have written the block). Several processes may share a
directory; each keeps its own size accounting.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path

from speckv.cache.block import CacheKey, make_cache_key, split_cache_key
from speckv.connectors.base import MEDIUM_DISK
from speckv.connectors.codec import (
    CodecMiss,
    DecodedBlock,
    MissReason,
    decode_block,
    encode_block,
    encoded_nbytes,
)
from speckv.connectors.host_pool import GIB
from speckv.connectors.layout import BlockLayout, BlockTensors, DeviceKV
from speckv.connectors.lru import PinnedLru
from speckv.connectors.metadata import BlockDescriptor
from speckv.connectors.namespace import DiskNamespace, lane_label, persistent_hash_seed
from speckv.connectors.rules import ConnectorMode
from speckv.connectors.store import BlockStore, PutOutcome, PutResult, StoreUsage
from speckv.connectors.tier import DEFAULT_MAX_PENDING_BLOCKS, TierConnector

DEFAULT_DISK_GIB = 16.0
SUFFIX = ".kvb"
NAMESPACE_FILE = "namespace.json"
STALE_TEMP_S = 3600.0  # temp files older than this are leftovers of a crashed writer


def block_path(directory: Path, key: CacheKey) -> Path:
    block_hash, group_id = split_cache_key(key)
    name = block_hash.hex()
    return directory / name[:2] / f"{name}.g{group_id}{SUFFIX}"


def key_of(path: Path) -> CacheKey | None:
    """The key a block file name stands for; None for anything else."""
    stem = path.name.removesuffix(SUFFIX)
    hash_hex, _, group = stem.rpartition(".g")
    try:
        return make_cache_key(bytes.fromhex(hash_hex), int(group))
    except ValueError:
        return None


def _write_atomically(path: Path, chunks) -> None:
    temp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        with open(temp, "wb") as file:
            for chunk in chunks:
                file.write(chunk)
        os.replace(temp, path)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


class DiskBlockStore:
    medium = MEDIUM_DISK

    def __init__(self, root: Path, namespace: DiskNamespace, capacity_bytes: int) -> None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        self.namespace = namespace
        self.layout: BlockLayout = namespace.layout
        self.capacity_bytes = capacity_bytes
        self.directory = Path(root) / namespace.dirname
        self.directory.mkdir(parents=True, exist_ok=True)
        self._check_namespace_file()
        self._lock = threading.Lock()
        self._index: PinnedLru[int] = PinnedLru()  # key -> file bytes
        self._total_bytes = 0
        self._writing: set[CacheKey] = set()
        # evicted from the index, file not yet unlinked: a lookup must not take the file
        # for another process's block and put the key back in the index
        self._deleting: set[CacheKey] = set()
        self._read_buffer = bytearray()  # loads only (engine thread)
        self._scan()

    # ---- set-up ------------------------------------------------------------------------------
    def _check_namespace_file(self) -> None:
        path = self.directory / NAMESPACE_FILE
        fields = self.namespace.fields()
        if path.exists():
            try:
                stored = json.loads(path.read_text())
            except (OSError, ValueError) as error:
                raise ValueError(f"{path}: unreadable namespace file ({error})") from None
            if stored != fields:
                raise ValueError(
                    f"{path} describes another setup than this engine's; the directory "
                    "is damaged: remove it"
                )
            return
        _write_atomically(path, [json.dumps(fields, indent=1, sort_keys=True).encode()])

    def _scan(self) -> None:
        found: list[tuple[float, CacheKey, int]] = []
        now = time.time()
        for path in self.directory.glob("*/*"):
            try:
                stat = path.stat()
            except OSError:
                continue
            if path.name.endswith(".tmp"):
                if now - stat.st_mtime > STALE_TEMP_S:
                    path.unlink(missing_ok=True)
                continue
            key = key_of(path) if path.name.endswith(SUFFIX) else None
            if key is not None:
                found.append((stat.st_mtime, key, stat.st_size))
        for _, key, size in sorted(found, key=lambda item: item[0]):
            self._index.add(key, size)
            self._total_bytes += size
        victims = self._pick_victims(0)
        if victims:
            self._drop_files(self._remove(victims))

    # ---- reads -------------------------------------------------------------------------------
    def contains(self, key: CacheKey) -> bool:
        with self._lock:
            if key in self._index:
                return True
            if key in self._writing or key in self._deleting:
                return False
        try:  # another process (or an earlier life of this one) may have written it
            size = block_path(self.directory, key).stat().st_size
        except OSError:
            return False
        with self._lock:
            if key in self._writing or key in self._deleting:
                return False  # evicted (or being written) while we looked
            if key not in self._index:
                self._index.add(key, size)
                self._total_bytes += size
        return True

    def get(self, block: BlockDescriptor) -> BlockTensors | CodecMiss:
        key = block.key
        path = block_path(self.directory, key)
        try:
            with open(path, "rb") as file:
                size = os.fstat(file.fileno()).st_size
                if len(self._read_buffer) < size:
                    # reused across loads: fresh memory per block costs more than the read
                    self._read_buffer = bytearray(size)
                data = memoryview(self._read_buffer)[:size]
                num_read = file.readinto(data)
        except FileNotFoundError:
            self._forget(key)
            return CodecMiss(MissReason.NOT_FOUND)
        except OSError as error:
            return CodecMiss(MissReason.IO_ERROR, str(error))
        if num_read != size:
            decoded: DecodedBlock | CodecMiss = CodecMiss(MissReason.TRUNCATED, "short read")
        else:
            decoded = decode_block(data, self.namespace.ident, block, self.layout)
        if isinstance(decoded, CodecMiss):
            if decoded.reason.is_corruption:
                self._forget(key)
                path.unlink(missing_ok=True)
            return decoded
        with self._lock:
            self._index.touch(key)
        with contextlib.suppress(OSError):  # a file deleted meanwhile: nothing to keep
            os.utime(path)  # keeps the LRU order across restarts
        return decoded.tensors

    def usage(self) -> StoreUsage:
        with self._lock:
            return StoreUsage(len(self._index), self._total_bytes, self.capacity_bytes)

    # ---- writes ------------------------------------------------------------------------------
    def pin(self, key: CacheKey) -> None:
        with self._lock:
            self._index.pin(key)

    def unpin(self, key: CacheKey) -> None:
        with self._lock:
            self._index.unpin(key)

    def put(self, block: BlockDescriptor, tensors: BlockTensors) -> PutResult:
        key = block.key
        with self._lock:
            if key in self._index or key in self._writing:
                self._index.touch(key)
                return PutResult(PutOutcome.PRESENT)
        chunks = encode_block(self.namespace.ident, block, self.layout, tensors)
        size = encoded_nbytes(chunks)
        with self._lock:
            victims = self._pick_victims(size)
            if victims is None:
                return PutResult(PutOutcome.NO_ROOM)
            removed = self._remove(victims)
            self._total_bytes += size
            self._writing.add(key)
        self._drop_files(removed)
        path = block_path(self.directory, key)
        try:
            path.parent.mkdir(exist_ok=True)
            _write_atomically(path, chunks)
        except OSError:
            with self._lock:
                self._writing.discard(key)
                self._total_bytes -= size
            return PutResult(PutOutcome.NO_ROOM, evicted=tuple(removed))
        with self._lock:
            self._writing.discard(key)
            self._index.add(key, size)
        return PutResult(PutOutcome.STORED, size, tuple(removed))

    def clear(self) -> list[CacheKey]:
        with self._lock:
            removed = self._remove([key for key, _ in self._index.unpinned()])
        self._drop_files(removed)
        return removed

    def _pick_victims(self, incoming_bytes: int) -> list[CacheKey] | None:
        """Oldest unpinned keys to evict so `incoming_bytes` fit (under the lock); None if
        they cannot fit."""
        excess = self._total_bytes + incoming_bytes - self.capacity_bytes
        victims: list[CacheKey] = []
        for key, size in self._index.unpinned():
            if excess <= 0:
                break
            victims.append(key)
            excess -= size
        return victims if excess <= 0 else None

    def _remove(self, keys: list[CacheKey]) -> list[CacheKey]:
        """Drop keys from the index (under the lock); their files go after (`_drop_files`),
        and until then lookups miss them."""
        for key in keys:
            size = self._index.pop(key)
            assert size is not None, "removing a key the index does not hold"
            self._total_bytes -= size
            self._deleting.add(key)
        return keys

    def _drop_files(self, keys: list[CacheKey]) -> None:
        for key in keys:
            block_path(self.directory, key).unlink(missing_ok=True)
            with self._lock:
                self._deleting.discard(key)

    def _forget(self, key: CacheKey) -> None:
        with self._lock:
            size = self._index.pop(key)
            if size is not None:
                self._total_bytes -= size


class DiskConnector(TierConnector):
    medium = MEDIUM_DISK

    def __init__(self, directory: str | os.PathLike[str], size_gib: float = DEFAULT_DISK_GIB,
                 *, model_fingerprint: str, hash_algo: str, hash_seed: str | None,
                 name: str = "disk",
                 max_pending_blocks: int = DEFAULT_MAX_PENDING_BLOCKS) -> None:
        if not str(directory):
            raise ValueError("--kv-offload-dir must name a directory")
        root = Path(directory)
        if root.exists() and not root.is_dir():
            raise ValueError(f"--kv-offload-dir {root} exists and is not a directory")
        if not size_gib > 0:
            raise ValueError(f"--kv-offload-disk-gib must be > 0, got {size_gib}")
        super().__init__(name, max_pending_blocks)
        self.root = root
        self.size_gib = size_gib
        self.model_fingerprint = model_fingerprint
        self.hash_algo = hash_algo
        self.hash_seed = persistent_hash_seed(hash_seed)
        self.namespace: DiskNamespace | None = None

    def _make_lane(self, index: int, share: float) -> TierConnector:
        return DiskConnector(self.root, self.size_gib * share,
                             model_fingerprint=self.model_fingerprint, hash_algo=self.hash_algo,
                             hash_seed=self.hash_seed, name=f"{self.name}/g{index}",
                             max_pending_blocks=self.max_pending_blocks)

    def _open_store(self, kv: DeviceKV, mode: ConnectorMode) -> BlockStore:
        self.namespace = DiskNamespace(self.model_fingerprint, self.hash_algo, self.hash_seed,
                                       mode.lookahead_tokens, kv.layout,
                                       lane_label(mode))
        capacity = int(self.size_gib * GIB)
        if capacity < kv.layout.nbytes:
            raise ValueError(
                f"--kv-offload-disk-gib {self.size_gib} GiB holds no whole KV block of "
                f"{kv.layout.nbytes} bytes"
            )
        return DiskBlockStore(self.root, self.namespace, capacity)
