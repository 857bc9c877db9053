"""The timing harness the KV tier benches share (`kv_tiers.py`, `kv_store.py`).

Owns the built-in model's KV layout in paged caches (`bench_kv`), a request as a connector
reads it (`BenchPrompt`), storing one prompt through a connector (`store_prompt`, timing the
step's snapshot and the copy thread's settling), one timed lookup + load of it into other
blocks (`timed_load`), and the check that the loaded blocks equal the stored ones.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from speckv.attention import PagedKVCache
from speckv.connectors import DeviceKV, KVConnector, RequestBlocks
from speckv.hashing.extra_keys import NO_HASH_INPUTS
from speckv.hashing.formats import format_for
from speckv.hashing.functions import get_hash_algo, make_none_hash
from speckv.hashing.request_hasher import RequestBlockHasher

# the built-in model's KV shape and its EAGLE head's
TARGET_LAYERS, DRAFT_LAYERS, KV_HEADS, HEAD_DIM = 30, 1, 3, 64


class BenchPrompt:
    """A request as a connector reads it (see `speckv.connectors.rules.ConnectorRequest`),
    hashed with lookahead L = 1."""

    hash_inputs = NO_HASH_INPUTS
    lora_name = None
    kv_transfer_params = None

    def __init__(self, request_id: str, tokens: list[int], block_size: int) -> None:
        self.request_id = request_id
        self.all_token_ids = tokens
        algo = get_hash_algo("sha256")
        hasher = RequestBlockHasher(algo, make_none_hash(algo, "0"), block_size, format_for(1))
        hasher.update(tokens)
        self._hashes = hasher.block_hashes

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def get_block_hashes(self, lookahead_tokens: int) -> list[bytes]:
        assert lookahead_tokens == 1
        return self._hashes


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_kv(num_blocks: int, block_size: int, dtype: str, device: torch.device) -> DeviceKV:
    """Target + draft paged caches in the built-in model's layout, `2 * num_blocks + 2`
    blocks (a writer's blocks and a reader's), filled with random values."""
    total_blocks = 2 * num_blocks + 2
    target = PagedKVCache(TARGET_LAYERS, total_blocks, block_size, KV_HEADS, HEAD_DIM, dtype,
                          device)
    draft = PagedKVCache(DRAFT_LAYERS, total_blocks, block_size, KV_HEADS, HEAD_DIM, dtype,
                         device)
    kv = DeviceKV(target, draft)
    for cache in kv.caches:
        cache.storage.normal_()
    return kv


@dataclass(frozen=True)
class StoredPrompt:
    tokens: list[int]
    writer: BenchPrompt
    source_ids: list[int]  # the writer's blocks (one more than the prompt's whole blocks)
    reader_ids: list[int]  # where loads go
    snapshot_s: float  # the step's share of storing the prompt
    settle_s: float  # until the copy thread stored every block


def store_prompt(connector: KVConnector, prompt_tokens: int, block_size: int,
                 device: torch.device) -> StoredPrompt:
    """Store a `prompt_tokens`-token prompt's blocks through `connector` as the engine does
    (the step after the prefill lists every block), and wait until they are stored."""
    num_blocks = prompt_tokens // block_size
    tokens = [(7 * i) % 49152 for i in range(prompt_tokens + 1)]
    writer = BenchPrompt("writer", tokens, block_size)
    source_ids = list(range(1, num_blocks + 2))
    connector.update_state_after_alloc(writer, source_ids, 0, 0)
    connector.start_load_kv(connector.build_connector_meta([
        RequestBlocks(writer, source_ids, 0)]))
    meta = connector.build_connector_meta([RequestBlocks(writer, source_ids, prompt_tokens)])
    sync(device)
    start = time.perf_counter()
    connector.start_load_kv(meta)
    sync(device)
    snapshot_s = time.perf_counter() - start
    assert connector.flush(timeout_s=600), "the tier did not settle"
    settle_s = time.perf_counter() - start
    connector.request_finished(RequestBlocks(writer, source_ids, prompt_tokens))
    reader_ids = list(range(num_blocks + 2, 2 * num_blocks + 2))
    return StoredPrompt(tokens, writer, source_ids, reader_ids, snapshot_s, settle_s)


def timed_load(connector: KVConnector, stored: StoredPrompt, block_size: int,
               device: torch.device, request_id: str) -> tuple[float, float]:
    """(lookup seconds, load seconds) of a new request for the stored prompt: the whole
    prompt must hit, and its blocks load into `stored.reader_ids` without errors."""
    reader = BenchPrompt(request_id, stored.tokens, block_size)
    prompt_tokens = len(stored.tokens) - 1
    start = time.perf_counter()
    hit = connector.get_num_new_matched_tokens(reader, 0)
    lookup_s = time.perf_counter() - start
    assert hit.num_tokens == prompt_tokens, (hit, prompt_tokens)
    connector.update_state_after_alloc(reader, stored.reader_ids, 0, hit.num_tokens)
    meta = connector.build_connector_meta([])
    sync(device)
    start = time.perf_counter()
    connector.start_load_kv(meta)
    sync(device)
    load_s = time.perf_counter() - start
    assert not connector.get_block_ids_with_load_errors()
    connector.request_finished(RequestBlocks(reader, stored.reader_ids, 0))
    return lookup_s, load_s


def assert_loaded(kv: DeviceKV, stored: StoredPrompt) -> None:
    """The reader's blocks hold exactly the writer's (every layer, target and draft)."""
    num_blocks = len(stored.reader_ids)
    for cache in kv.caches:
        assert torch.equal(cache.storage[:, :, stored.source_ids[:num_blocks]],
                           cache.storage[:, :, stored.reader_ids])
