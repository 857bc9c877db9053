"""The NIXL data path: one agent per engine, the engine's paged KV registered, block READs.

Owns the `nixl_agent` (UCX backend: host memory between processes here, VRAM over NVLink/RDMA on
GPU machines), the registration of every device tensor of every KV cache group (paged KV of
the target and the drafter, GDN conv and recurrent state), the per-chunk descriptor lists
(every plane of every segment; addressing in `layout_desc`), and the READ of a peer's blocks,
per group, into local blocks. A READ returns a
handle at once; `poll` says DONE / PROC / ERR without blocking, so an engine step never waits
on the network. The peer is told of a finished READ by the notification the READ carries.

Driven by the engine's thread only (READs and their polls on the decode side, notifications
on the prefill side); the side-channel threads never touch the agent.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from speckv.connectors.layout import DeviceKV, GroupedDeviceKV
from speckv.connectors.nixl.layout_desc import KVLayoutDesc, SegmentDesc

logger = logging.getLogger("speckv.connectors.nixl")

try:  # the CUDA 12 wheel names its module nixl_cu12; a source build names it nixl
    from nixl_cu12 import _api as nixl_api
    from nixl_cu12 import nixl_agent, nixl_agent_config, nixl_thread_sync_t
except ImportError:  # pragma: no cover - depends on the installed wheel
    try:
        from nixl import _api as nixl_api
        from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t
    except ImportError:
        nixl_agent = None

# The progress thread's pause between two rounds, in microseconds. NIXL's Python agent sets 0,
# a thread that polls without pause: an idle engine burned a whole core (94% of a core measured
# here, 31-39% on a loaded machine). 1 ms keeps an idle agent at ~3% of a core and adds at most
# 1 ms to a READ the peer must progress.
PROGRESS_PAUSE_US = 1000
_config_lock = threading.Lock()


def _make_agent(name: str) -> object:
    """A NIXL agent over UCX whose progress thread pauses `PROGRESS_PAUSE_US` between rounds.

    The Python wrapper hard-codes the pause to 0 when it builds its binding's config; the
    binding's config class is swapped, for this one construction, for a subclass that keeps
    the pause. Where the wrapper is shaped otherwise, the agent is built as the wrapper says."""
    config = nixl_agent_config(enable_prog_thread=True, backends=["UCX"],
                               sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
    binding = getattr(nixl_api, "nixlBind", None)
    base = getattr(binding, "nixlAgentConfig", None)
    if base is None or not isinstance(getattr(base, "pthrDelay", None), property):
        logger.warning("NIXL: cannot set the progress thread's pause; it polls without one")
        return nixl_agent(name, config)

    class _PausedConfig(base):  # type: ignore[misc, valid-type]
        @property
        def pthrDelay(self) -> int:
            return base.pthrDelay.__get__(self)

        @pthrDelay.setter
        def pthrDelay(self, _value: int) -> None:
            base.pthrDelay.__set__(self, PROGRESS_PAUSE_US)

    with _config_lock:
        binding.nixlAgentConfig = _PausedConfig
        try:
            return nixl_agent(name, config)
        finally:
            binding.nixlAgentConfig = base


def nixl_available() -> bool:
    return nixl_agent is not None


def _chunk_table(segments: Sequence[SegmentDesc]) -> np.ndarray:
    """[chunks, 3] (address, bytes, device 0): every (segment, plane, block) chunk, in
    segment-major, then plane (in `planes` order), then block order."""
    rows = []
    for segment in segments:
        n = segment.num_blocks
        planes = np.asarray(segment.planes, dtype=np.uint64)
        index = (planes[:, None] * np.uint64(n)
                 + np.arange(n, dtype=np.uint64)[None, :]).reshape(-1)
        table = np.zeros((len(index), 3), dtype=np.uint64)
        table[:, 0] = np.uint64(segment.base_addr) + index * np.uint64(segment.chunk_bytes)
        table[:, 1] = segment.chunk_bytes
        rows.append(table)
    return np.concatenate(rows)


def chunk_indices(segments: Sequence[SegmentDesc],
                  block_ids: Sequence[Sequence[int]]) -> np.ndarray:
    """Indices into `_chunk_table` of every chunk of `block_ids[g]` (per KV cache group), in a
    fixed order (segment, plane, then the given block order), so a local and a remote list
    pair up."""
    parts = []
    offset = 0
    for segment in segments:
        ids = np.asarray(block_ids[segment.group] if segment.group < len(block_ids) else (),
                         dtype=np.int64)
        starts = np.arange(len(segment.planes), dtype=np.int64) * segment.num_blocks
        if len(ids):
            parts.append((offset + starts[:, None] + ids[None, :]).reshape(-1))
        offset += len(segment.planes) * segment.num_blocks
    return np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32)


@dataclass
class ReadHandle:
    peer: str
    handle: object
    num_bytes: int
    state: str = "PROC"


class NixlTransport:
    """One engine's NIXL agent over its registered paged KV."""

    def __init__(self, kv: DeviceKV | GroupedDeviceKV, agent_name: str,
                 layout: KVLayoutDesc) -> None:
        if nixl_agent is None:
            raise RuntimeError("the nixl connector needs the NIXL Python package: "
                               "pip install nixl-cu12")
        self.kv = kv
        self.layout = layout
        self.name = agent_name
        self.agent = _make_agent(agent_name)
        if "UCX" not in self.agent.backends:
            raise RuntimeError("NIXL has no UCX backend on this machine")
        tensors = {segment.storage.data_ptr(): segment.storage
                   for group in kv.groups for segment in group.segments}
        self._registered = [self.agent.register_memory(tensor) for tensor in tensors.values()]
        self._local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT", _chunk_table(layout.segments), layout.mem_type)
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
        remote = self.agent.prep_xfer_dlist(name, _chunk_table(layout.segments),
                                            layout.mem_type)
        self._peers[name] = (layout, remote)
        return name

    def remove_peer(self, agent_name: str) -> None:
        entry = self._peers.pop(agent_name, None)
        if entry is not None:
            entry[1].release()
            self.agent.remove_remote_agent(agent_name)

    def start_read(self, peer: str, remote_block_ids: Sequence[Sequence[int]],
                   local_block_ids: Sequence[Sequence[int]], notif: bytes = b"") -> ReadHandle:
        """READ, per KV cache group g, the peer's blocks `remote_block_ids[g][i]` into local
        `local_block_ids[g][i]` (every tensor of the group, every plane); the peer gets
        `notif` when it is done."""
        layout, remote = self._peers[peer]
        if len(remote_block_ids) != len(local_block_ids) or \
                len(local_block_ids) > len(self.layout.kv_groups):
            raise ValueError(f"{len(remote_block_ids)} remote and {len(local_block_ids)} local "
                             f"block lists for {len(self.layout.kv_groups)} KV cache groups")
        for g, (theirs, mine) in enumerate(zip(remote_block_ids, local_block_ids)):
            if len(theirs) != len(mine):
                raise ValueError(f"group {g}: {len(theirs)} remote blocks for {len(mine)} "
                                 "local blocks")
            for ids, desc, who in ((theirs, layout, "peer"), (mine, self.layout, "local")):
                count = desc.group_num_blocks(g)
                for block_id in ids:
                    if not 0 < block_id < count:
                        raise IndexError(f"{who} block {block_id} of group {g} outside "
                                         f"[1, {count})")
        local_idx = chunk_indices(self.layout.segments, local_block_ids)
        remote_idx = chunk_indices(layout.segments, remote_block_ids)
        handle = self.agent.make_prepped_xfer("READ", self._local, local_idx, remote,
                                              remote_idx, notif)
        num_bytes = sum(len(local_block_ids[s.group]) * len(s.planes) * s.chunk_bytes
                        for s in self.layout.segments if s.group < len(local_block_ids))
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
