"""The NIXL data path: one agent per engine, the engine's paged KV registered, block READs.

Owns the `nixl_agent` (UCX backend: host memory between processes here, VRAM over NVLink/RDMA on
GPU machines), the registration of every segment's `PagedKVCache.storage`, the per-block
descriptor lists (every layer's keys and values, every segment; addressing in
`layout_desc`), and the READ of a list of a peer's blocks into local blocks. A READ returns a
handle at once; `poll` says DONE / PROC / ERR without blocking, so an engine step never waits
on the network. The peer is told of a finished READ by the notification the READ carries.

Not thread-safe: one thread drives an agent's transfers (the connector's transfer thread on the
decode side, the engine thread on the prefill side, which only reads notifications).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from speckv.connectors.layout import DeviceKV
from speckv.connectors.nixl.layout_desc import KVLayoutDesc, SegmentDesc

logger = logging.getLogger("speckv.connectors.nixl")

try:  # the CUDA 12 wheel names its module nixl_cu12; a source build names it nixl
    from nixl_cu12 import nixl_agent, nixl_agent_config, nixl_thread_sync_t
except ImportError:  # pragma: no cover - depends on the installed wheel
    try:
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    except ImportError:
        nixl_agent = None


def nixl_available() -> bool:
    return nixl_agent is not None


def _chunk_table(segments: Sequence[SegmentDesc], num_blocks: int) -> np.ndarray:
    """[chunks, 3] (address, bytes, device 0): every (segment, layer, k/v, block) chunk, in
    segment-major then (layer * 2 + c) * num_blocks + block order."""
    rows = []
    for segment in segments:
        count = segment.num_chunks_per_block * num_blocks
        table = np.zeros((count, 3), dtype=np.uint64)
        table[:, 0] = segment.base_addr + np.arange(count, dtype=np.uint64) * segment.chunk_bytes
        table[:, 1] = segment.chunk_bytes
        rows.append(table)
    return np.concatenate(rows)


def chunk_indices(segments: Sequence[SegmentDesc], num_blocks: int,
                  block_ids: Sequence[int]) -> np.ndarray:
    """Indices into `_chunk_table` of every chunk of `block_ids`, in a fixed order (segment,
    layer, k/v, then the given block order), so a local and a remote list pair up."""
    ids = np.asarray(block_ids, dtype=np.int64)
    parts = []
    offset = 0
    for segment in segments:
        starts = np.arange(segment.num_chunks_per_block, dtype=np.int64) * num_blocks
        parts.append((offset + starts[:, None] + ids[None, :]).reshape(-1))
        offset += segment.num_chunks_per_block * num_blocks
    return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)


@dataclass
class ReadHandle:
    peer: str
    handle: object
    num_bytes: int
    state: str = "PROC"


class NixlTransport:
    """One engine's NIXL agent over its registered paged KV."""

    def __init__(self, kv: DeviceKV, agent_name: str, layout: KVLayoutDesc) -> None:
        if nixl_agent is None:
            raise RuntimeError("the nixl connector needs the NIXL Python package: "
                               "pip install nixl-cu12")
        self.kv = kv
        self.layout = layout
        self.name = agent_name
        config = nixl_agent_config(enable_prog_thread=True, backends=["UCX"],
                                   sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self.agent = nixl_agent(agent_name, config)
        if "UCX" not in self.agent.backends:
            raise RuntimeError("NIXL has no UCX backend on this machine")
        self._registered = [self.agent.register_memory(cache.storage) for cache in kv.caches]
        self._local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _chunk_table(layout.segments, layout.num_blocks),
            layout.mem_type)
        self._peers: dict[str, tuple[KVLayoutDesc, object]] = {}  # agent name -> layout, dlist

    def metadata(self) -> bytes:
        """This agent's metadata, for a peer's `add_peer` (sent over the side channel)."""
        return self.agent.get_agent_metadata()

    def has_peer(self, agent_name: str) -> bool:
        return agent_name in self._peers

    def add_peer(self, agent_metadata: bytes, layout: KVLayoutDesc) -> str:
        """Load a peer agent (its layout already checked) and prepare its block descriptors."""
        name = self.agent.add_remote_agent(agent_metadata)
        name = name.decode() if isinstance(name, bytes) else name
        if name != layout.agent_name:
            raise ValueError(f"the peer's NIXL agent is {name!r}, its layout says "
                             f"{layout.agent_name!r}")
        remote = self.agent.prep_xfer_dlist(
            name, _chunk_table(layout.segments, layout.num_blocks), layout.mem_type)
        self._peers[name] = (layout, remote)
        return name

    def remove_peer(self, agent_name: str) -> None:
        entry = self._peers.pop(agent_name, None)
        if entry is not None:
            entry[1].release()
            self.agent.remove_remote_agent(agent_name)

    def start_read(self, peer: str, remote_block_ids: Sequence[int],
                   local_block_ids: Sequence[int], notif: bytes = b"") -> ReadHandle:
        """READ the peer's blocks `remote_block_ids[i]` into local `local_block_ids[i]` (every
        layer, every segment); the peer gets `notif` when it is done."""
        if len(remote_block_ids) != len(local_block_ids):
            raise ValueError(f"{len(remote_block_ids)} remote blocks for "
                             f"{len(local_block_ids)} local blocks")
        layout, remote = self._peers[peer]
        for block_id in remote_block_ids:
            if not 0 < block_id < layout.num_blocks:
                raise IndexError(f"peer block {block_id} outside [1, {layout.num_blocks})")
        for block_id in local_block_ids:
            if not 0 < block_id < self.layout.num_blocks:
                raise IndexError(f"local block {block_id} outside [1, {self.layout.num_blocks})")
        local_idx = chunk_indices(self.layout.segments, self.layout.num_blocks, local_block_ids)
        remote_idx = chunk_indices(layout.segments, layout.num_blocks, remote_block_ids)
        handle = self.agent.make_prepped_xfer("READ", self._local, local_idx, remote,
                                              remote_idx, notif)
        num_bytes = len(local_block_ids) * self.kv.layout.nbytes
        read = ReadHandle(peer, handle, num_bytes)
        read.state = self.agent.transfer(handle)
        return read

    def poll(self, read: ReadHandle) -> str:
        """DONE, PROC or ERR, without blocking; a finished handle is released."""
        if read.state == "PROC":
            read.state = self.agent.check_xfer_state(read.handle)
        if read.state != "PROC" and read.handle is not None:
            try:
                read.handle.release()
            except Exception:  # an errored handle may refuse; it is dropped
                logger.debug("NIXL handle release failed", exc_info=True)
            read.handle = None
        return read.state

    def abandon(self, read: ReadHandle) -> None:
        """Give up a READ (timed out): release its handle, cancelling it if NIXL can."""
        if read.handle is not None:
            try:
                read.handle.release()
            except Exception:  # cannot cancel: NIXL keeps and frees it later
                logger.warning("a timed-out NIXL READ could not be cancelled", exc_info=True)
            read.handle = None
        read.state = "ERR"

    def notify(self, peer: str, message: bytes) -> None:
        self.agent.send_notif(peer, message)

    def take_notifs(self) -> dict[str, list[bytes]]:
        """Notifications since the last call, by peer agent name."""
        notifs = self.agent.get_new_notifs()
        return {(k.decode() if isinstance(k, bytes) else k): v for k, v in notifs.items()}

    def shutdown(self) -> None:
        for name in list(self._peers):
            with contextlib.suppress(Exception):  # best effort at exit
                self.remove_peer(name)
        try:
            self._local.release()
            for reg in self._registered:
                self.agent.deregister_memory(reg)
        except Exception:  # best effort at exit
            pass
