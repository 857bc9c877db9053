"""A remote engine's KV, in process: asynchronous loads and delayed frees on a seeded schedule.

Owns `FakeRemoteConnector`, a real `KVConnector` that stands in for a prefill/decode transfer
(what NIXL would move between two engines) without a network, so the engine's asynchronous
seams can be tested with real tensors:

    receive  `get_num_new_matched_tokens` offers the blocks after the local hit that the shared
             `RemoteBlocks` dict holds (by block key, content-checked like a tier) as an
             asynchronous hit (`load_async=True`); the load starts in `start_load_kv` and
             lands in the request's device blocks `min_load_steps..max_load_steps` steps
             later (drawn from the seed; 0: in the step it starts), reported in
             `finished_recving`; `fail_blocks` (and `fail_rate`, seeded) make blocks fail: the
             load stops there and reports a `LoadFailure`
    send     with `send_on_finish`, `request_finished` asks to delay freeing the request's
             blocks (`delay_free=True`, with `kv_transfer_params` naming what is sent); the
             blocks are read into the dict `send_steps` steps later, then reported in
             `finished_sending`: a block freed (or reused) too early sends someone else's KV

Two engines sharing one `RemoteBlocks` are a prefill engine and a decode engine; one engine
can also send to itself. `seen_params` records the `kv_transfer_params` each request carried
into `get_num_new_matched_tokens`. Everything runs on the engine thread (no copy thread).
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from speckv.cache.block import NULL_BLOCK_ID, CacheKey, make_cache_key
from speckv.connectors.base import ExternalHit, FinishDecision, KVConnector, RequestBlocks
from speckv.connectors.layout import BlockTensors, DeviceKV
from speckv.connectors.metadata import (
    BlockDescriptor,
    ConnectorMetadata,
    ConnectorOutput,
    ConnectorStats,
    LoadFailure,
    RequestLoad,
    StepMetadata,
)
from speckv.connectors.rules import (
    ConnectorMode,
    ConnectorRequest,
    describe_block,
    num_lookup_candidates,
    num_servable_blocks,
    num_storable_blocks,
)

MEDIUM_REMOTE = "REMOTE"


@dataclass
class RemoteBlocks:
    """What the remote side holds: block key -> (descriptor, host tensors of every segment)."""

    blocks: dict[CacheKey, tuple[BlockDescriptor, BlockTensors]] = field(default_factory=dict)

    def __contains__(self, key: CacheKey) -> bool:
        return key in self.blocks


@dataclass
class _Transfer:
    request_id: str
    due_step: int
    load: RequestLoad | None = None  # a receive
    sends: tuple[tuple[BlockDescriptor, int], ...] = ()  # a send: (block, device block id)


class FakeRemoteConnector(KVConnector):
    def __init__(self, remote: RemoteBlocks, *, seed: int = 0, min_load_steps: int = 0,
                 max_load_steps: int = 2, send_on_finish: bool = False, send_steps: int = 2,
                 fail_blocks: frozenset[CacheKey] = frozenset(), fail_rate: float = 0.0,
                 name: str = "remote") -> None:
        if not 0 <= min_load_steps <= max_load_steps or send_steps < 0:
            raise ValueError("need 0 <= min_load_steps <= max_load_steps and send_steps >= 0")
        self.name = name
        self.remote = remote
        self.min_load_steps = min_load_steps
        self.max_load_steps = max_load_steps
        self.fail_rate = fail_rate
        self.send_on_finish = send_on_finish
        self.send_steps = send_steps
        self.fail_blocks = set(fail_blocks)
        self._rng = random.Random(seed)
        self._kv: DeviceKV | None = None
        self._mode: ConnectorMode | None = None
        self._step = 0
        self._planned: dict[str, RequestLoad] = {}
        self._receiving: dict[str, _Transfer] = {}
        self._sending: dict[str, _Transfer] = {}
        self._recved: set[str] = set()
        self._sent: set[str] = set()
        self._failures: list[LoadFailure] = []
        self.seen_params: dict[str, dict[str, Any] | None] = {}
        self.loaded_blocks = 0
        self.sent_blocks = 0

    @property
    def supports_lookahead_block_hashes(self) -> bool:
        return True  # keyed, looked up and sent by the request's own block hashes

    def initialize(self, kv: DeviceKV, mode: ConnectorMode) -> None:
        self._kv, self._mode = kv, mode

    def _ready(self) -> tuple[DeviceKV, ConnectorMode]:
        if self._kv is None or self._mode is None:
            raise RuntimeError(f"connector {self.name!r} is used before initialize()")
        return self._kv, self._mode

    # ---- what is in flight (for tests) -------------------------------------------------------
    @property
    def receiving(self) -> frozenset[str]:
        """Requests whose asynchronous load has started or is planned, not yet reported."""
        return frozenset(self._receiving) | frozenset(self._planned)

    @property
    def sending(self) -> frozenset[str]:
        return frozenset(self._sending)

    def sending_block_ids(self) -> frozenset[int]:
        """Device blocks a send will still read."""
        return frozenset(block_id for transfer in self._sending.values()
                         for _, block_id in transfer.sends)

    # ---- scheduler side ----------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: ConnectorRequest,
                                   num_local_hit_tokens: int) -> ExternalHit:
        _, mode = self._ready()
        self.seen_params[request.request_id] = request.kv_transfer_params
        hashes = request.get_block_hashes(mode.lookahead_tokens)
        end = num_lookup_candidates(request.num_tokens, len(hashes), mode.block_size)
        run = 0
        for index in range(num_local_hit_tokens // mode.block_size, end):
            if make_cache_key(hashes[index], mode.group_id) not in self.remote:
                break
            run += 1
        servable = num_servable_blocks(run, mode)
        if servable == 0:
            return ExternalHit(0)
        return ExternalHit(servable * mode.block_size, MEDIUM_REMOTE, load_async=True)

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[int],
                                 num_local_hit_tokens: int, num_external_tokens: int) -> None:
        _, mode = self._ready()
        if not num_external_tokens:
            return
        start = num_local_hit_tokens // mode.block_size
        end = start + num_external_tokens // mode.block_size
        hashes = request.get_block_hashes(mode.lookahead_tokens)
        blocks = tuple(describe_block(request, hashes, i, mode) for i in range(start, end))
        self._planned[request.request_id] = RequestLoad(
            request.request_id, num_local_hit_tokens, mode.block_size, blocks,
            tuple(block_ids[start:end]))

    def build_connector_meta(self, scheduled: Sequence[RequestBlocks]) -> StepMetadata:
        loads = tuple(self._planned.values())
        self._planned = {}
        return ConnectorMetadata(self._step + 1, loads, ())

    def request_finished(self, blocks: RequestBlocks) -> FinishDecision:
        request = blocks.request
        if self._planned.pop(request.request_id, None) is not None:
            self._recved.add(request.request_id)  # accepted, never started: done, nothing sent
        if not self.send_on_finish:
            return FinishDecision()
        _, mode = self._ready()
        hashes = request.get_block_hashes(mode.lookahead_tokens)
        end = min(num_storable_blocks(len(hashes), blocks.num_written_tokens,
                                      request.num_tokens, mode), len(blocks.block_ids))
        sends = tuple((describe_block(request, hashes, i, mode), blocks.block_ids[i])
                      for i in range(end) if blocks.block_ids[i] != NULL_BLOCK_ID)
        self._sending[request.request_id] = _Transfer(
            request.request_id, self._step + self.send_steps, sends=sends)
        return FinishDecision(delay_free=True, kv_transfer_params={
            "remote_engine": self.name, "remote_request_id": request.request_id,
            "num_blocks": len(sends)})

    def request_preempted(self, blocks: RequestBlocks) -> None:
        return None  # a running request has no load in flight

    # ---- worker side -------------------------------------------------------------------------
    def snapshot_saves(self, meta: StepMetadata) -> None:
        return None

    def load_blocks(self, meta: StepMetadata) -> None:
        """Start this step's loads, then land the transfers due now (loads and sends)."""
        kv, _ = self._ready()
        if not isinstance(meta, ConnectorMetadata):
            raise TypeError(f"connector {self.name!r} got {type(meta).__name__}")
        self._step += 1
        for load in meta.loads:
            due = self._step + self._rng.randint(self.min_load_steps, self.max_load_steps)
            self._receiving[load.request_id] = _Transfer(load.request_id, due, load=load)
        for request_id, transfer in list(self._receiving.items()):
            if transfer.due_step <= self._step:
                del self._receiving[request_id]
                assert transfer.load is not None
                self._land(kv, transfer.load)
                self._recved.add(request_id)
        for request_id, transfer in list(self._sending.items()):
            if transfer.due_step <= self._step:
                del self._sending[request_id]
                ids = [block_id for _, block_id in transfer.sends]
                if ids:
                    for (block, _), tensors in zip(transfer.sends, _read(kv, ids)):
                        self.remote.blocks[block.key] = (block, tensors)
                self.sent_blocks += len(ids)
                self._sent.add(request_id)

    def _land(self, kv: DeviceKV, load: RequestLoad) -> None:
        """Write the load's blocks; stop at the first one missing, failing or not the block
        the request expects, and report the rest failed."""
        writer = kv.begin_write(len(load.blocks))
        num_ok = 0
        reason = ""
        for block, block_id in zip(load.blocks, load.device_block_ids):
            found = self.remote.blocks.get(block.key)
            if block.key in self.fail_blocks or (self.fail_rate
                                                 and self._rng.random() < self.fail_rate):
                reason = "injected failure"
            elif found is None:
                reason = "missing on the remote side"
            elif found[0] != block:
                reason = "a different block under this key"
            if reason:
                break
            assert found is not None
            writer.add(block_id, found[1])
            num_ok += 1
        writer.finish()
        self.loaded_blocks += num_ok
        if reason:
            self._failures.append(LoadFailure(
                load.request_id, load.first_token + num_ok * load.block_size,
                load.device_block_ids[num_ok:], reason))

    def get_finished(self) -> ConnectorOutput:
        recved, self._recved = frozenset(self._recved), set()
        sent, self._sent = frozenset(self._sent), set()
        failures, self._failures = tuple(self._failures), []
        return ConnectorOutput(finished_loads=recved, load_failures=failures,
                               finished_recving=recved, finished_sending=sent)

    def get_block_ids_with_load_errors(self) -> frozenset[int]:
        return frozenset()  # asynchronous failures travel in get_finished()

    def stats(self) -> dict[str, ConnectorStats]:
        return {self.name: ConnectorStats(self.name, MEDIUM_REMOTE,
                                          loaded_blocks=self.loaded_blocks,
                                          saved_blocks=self.sent_blocks)}


def _read(kv: DeviceKV, block_ids: Sequence[int]) -> list[BlockTensors]:
    """Private host copies of the device blocks (every segment)."""
    out = [kv.new_host_block() for _ in block_ids]
    ready = kv.read_blocks_into(block_ids, out)
    if ready is not None:
        ready.synchronize()
    return out
