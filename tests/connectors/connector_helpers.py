"""Builders for the connector tests: real paged caches (target + drafter), real block hashes,
and a small driver that calls a connector in the engine's order (see speckv/connectors/base.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from speckv.attention import PagedKVCache
from speckv.connectors import ConnectorMode, DeviceKV, KVConnector, RequestBlocks
from speckv.connectors.layout import BlockLayout
from speckv.connectors.metadata import BlockDescriptor
from speckv.connectors.rules import describe_block
from speckv.hashing.extra_keys import NO_HASH_INPUTS, HashInputs
from speckv.hashing.formats import format_for
from speckv.hashing.functions import get_hash_algo, make_none_hash
from speckv.hashing.request_hasher import RequestBlockHasher
from tests.patience import WATCHDOG_S

BLOCK_SIZE = 4
_ids = itertools.count()

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class Req:
    """A request as a connector reads it, hashed by the real incremental hasher."""

    def __init__(self, tokens: Sequence[int], *, block_size: int = BLOCK_SIZE,
                 algo: str = "sha256", seed: str = "0", lookahead_values=(0, 1, 2),
                 hash_inputs: HashInputs = NO_HASH_INPUTS, request_id: str | None = None,
                 lora_name: str | None = None) -> None:
        self.request_id = request_id or f"r{next(_ids)}"
        self.all_token_ids = list(tokens)
        self.hash_inputs = hash_inputs
        self._lora_name = lora_name
        hash_algo = get_hash_algo(algo)
        none_hash = make_none_hash(hash_algo, seed)
        self._hashers = {
            lookahead: RequestBlockHasher(hash_algo, none_hash, block_size,
                                          format_for(lookahead), hash_inputs)
            for lookahead in lookahead_values
        }
        self._update()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def lora_name(self) -> str | None:
        return self._lora_name

    kv_transfer_params = None

    def get_block_hashes(self, lookahead_tokens: int) -> list[bytes]:
        return self._hashers[lookahead_tokens].block_hashes

    def append(self, tokens: Sequence[int]) -> None:
        self.all_token_ids.extend(tokens)
        self._update()

    def _update(self) -> None:
        for hasher in self._hashers.values():
            hasher.update(self.all_token_ids)


class KVWorld:
    """A target cache and a drafter cache sharing one block table, as the engine has them."""

    def __init__(self, dtype: torch.dtype = torch.float32, num_blocks: int = 48,
                 block_size: int = BLOCK_SIZE, target_layers: int = 2, draft_layers: int = 1,
                 num_kv_heads: int = 2, head_dim: int = 8, device: str = "cpu",
                 with_draft: bool = True) -> None:
        self.block_size = block_size
        self.target = PagedKVCache(target_layers, num_blocks, block_size, num_kv_heads,
                                   head_dim, dtype, device)
        self.draft = (PagedKVCache(draft_layers, num_blocks, block_size, num_kv_heads,
                                   head_dim, dtype, device) if with_draft else None)
        self.kv = DeviceKV(self.target, self.draft)
        self._free = list(range(num_blocks - 1, 0, -1))  # block 0 is the null block
        self._generator = torch.Generator().manual_seed(1234)

    @property
    def caches(self) -> tuple[PagedKVCache, ...]:
        return self.kv.caches

    def allocate(self, num_blocks: int) -> list[int]:
        return [self._free.pop() for _ in range(num_blocks)]

    def free(self, block_ids: Sequence[int]) -> None:
        self._free.extend(reversed(list(block_ids)))

    def write_cold_kv(self, block_ids: Sequence[int]) -> None:
        """What a cold forward + drafter would write: distinct values per block, per cache."""
        for cache in self.caches:
            for block_id in block_ids:
                values = torch.randn(cache.storage[:, :, block_id].shape,
                                     generator=self._generator)
                cache.storage[:, :, block_id] = values.to(cache.dtype).to(cache.device)

    def block(self, block_id: int) -> tuple[torch.Tensor, ...]:
        """Both caches' bytes of one block, copied."""
        return tuple(cache.storage[:, :, block_id].clone().cpu() for cache in self.caches)

    def blocks(self, block_ids: Sequence[int]) -> list[tuple[torch.Tensor, ...]]:
        return [self.block(block_id) for block_id in block_ids]

    def zero(self, block_ids: Sequence[int]) -> None:
        for cache in self.caches:
            cache.storage[:, :, list(block_ids)] = 0


def bit_equal(left: Sequence[tuple[torch.Tensor, ...]],
              right: Sequence[tuple[torch.Tensor, ...]]) -> bool:
    """Byte-for-byte equality (NaN-safe, dtype-exact), target and draft."""
    if len(left) != len(right):
        return False
    for a_block, b_block in zip(left, right):
        for a, b in zip(a_block, b_block, strict=True):
            if a.dtype != b.dtype or a.shape != b.shape:
                return False
            if not torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)):
                return False
    return True


class Driver:
    """Calls one connector as the engine will, one step at a time."""

    def __init__(self, connector: KVConnector, world: KVWorld, lookahead_tokens: int = 1,
                 drops_last_block: bool = False) -> None:
        self.connector = connector
        self.world = world
        self.mode = ConnectorMode(lookahead_tokens, drops_last_block, world.block_size)
        connector.initialize(world.kv, self.mode)
        self.outputs = []

    def admit(self, request: Req, local_hit_tokens: int = 0,
              block_ids: Sequence[int] | None = None) -> tuple[int, list[int]]:
        """Lookup, allocate blocks for the whole request, tell the connector; returns the
        external hit (tokens) and the block ids."""
        hit = self.connector.get_num_new_matched_tokens(request, local_hit_tokens)
        if block_ids is None:
            block_ids = self.world.allocate(-(-request.num_tokens // self.world.block_size))
        self.connector.update_state_after_alloc(request, block_ids, local_hit_tokens,
                                                hit.num_tokens)
        return hit.num_tokens, list(block_ids)

    def step(self, scheduled: Sequence[RequestBlocks] = ()):
        meta = self.connector.build_connector_meta(list(scheduled))
        self.connector.start_load_kv(meta)
        failed = self.connector.get_block_ids_with_load_errors()
        self.connector.wait_for_save()
        output = self.connector.get_finished()
        assert output.failed_block_ids == failed
        self.outputs.append(output)
        return meta, output

    def finish(self, request: Req, block_ids: Sequence[int], num_written_tokens: int) -> None:
        decision = self.connector.request_finished(
            RequestBlocks(request, list(block_ids), num_written_tokens))
        assert decision.delay_free is False

    def close(self) -> None:
        self.connector.shutdown()


def store_request(driver: Driver, tokens: Sequence[int], written: int | None = None,
                  flush: bool = True) -> tuple[Req, list[int], list[tuple[torch.Tensor, ...]]]:
    """A cold run of `tokens` through the connector: allocate, write cold KV, step with the
    written blocks, finish. Returns the request, its blocks and their cold bytes."""
    request = Req(tokens)
    _, block_ids = driver.admit(request)
    driver.world.write_cold_kv(block_ids)
    written = request.num_tokens - 1 if written is None else written
    driver.step([RequestBlocks(request, block_ids, written)])
    driver.finish(request, block_ids, written)
    if flush:
        assert driver.connector.flush(timeout_s=WATCHDOG_S)
    return request, block_ids, driver.world.blocks(block_ids)


def tier_gib(world: KVWorld, num_blocks: int) -> float:
    """A tier size (GiB) that holds exactly `num_blocks` whole blocks of `world`'s layout."""
    nbytes = BlockLayout.of(world.target, world.draft).nbytes
    return (num_blocks * nbytes + nbytes // 2) / (1 << 30)


def block_of(driver: Driver, request: Req, index: int) -> BlockDescriptor:
    """What the driver's connector stores for block `index` of `request` (its key, header)."""
    return describe_block(request, request.get_block_hashes(driver.mode.lookahead_tokens),
                          index, driver.mode)
