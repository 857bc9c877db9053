"""A prefill-side peer in its own process for the transport tests: paged KV with seeded
contents, a NIXL agent over it, a lease table and the side channel. Commands and answers go
through multiprocessing queues (test plumbing only; the engines talk ZeroMQ and NIXL)."""

from __future__ import annotations

import multiprocessing as mp
import queue
from dataclasses import dataclass

import torch

from speckv.attention import PagedKVCache
from speckv.connectors.layout import DeviceKV
from speckv.connectors.nixl.layout_desc import describe_layout
from speckv.connectors.nixl.params import HashContract
from speckv.connectors.nixl.side_channel import LeaseService, SideChannelServer, Welcome
from speckv.connectors.nixl.transport import NixlTransport
from tests.patience import WATCHDOG_S, wait_until


@dataclass(frozen=True)
class KVShape:
    num_blocks: int = 12
    block_size: int = 4
    target_layers: int = 2
    draft_layers: int = 1
    kv_heads: int = 2
    head_dim: int = 8
    dtype: str = "float32"


CONTRACT = HashContract("sha256", "0", 4, 1, False)


def make_kv(shape: KVShape, seed: int | None) -> DeviceKV:
    """Target + drafter caches; random contents from `seed` (None: zeros)."""
    target = PagedKVCache(shape.target_layers, shape.num_blocks, shape.block_size,
                          shape.kv_heads, shape.head_dim, dtype=shape.dtype)
    draft = PagedKVCache(shape.draft_layers, shape.num_blocks, shape.block_size,
                         shape.kv_heads, shape.head_dim, dtype=shape.dtype)
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        for cache in (target, draft):
            cache.storage.copy_(torch.randn(cache.storage.shape, generator=generator)
                                .to(cache.storage.dtype))
    return DeviceKV(target, draft)


def _serve(shape: KVShape, contract: HashContract, lease_s: float, commands: mp.Queue,
           answers: mp.Queue) -> None:
    torch.set_num_threads(1)
    kv = make_kv(shape, seed=1234)
    epoch = "epoch-p"
    layout = describe_layout(kv, "prefill-0", epoch, "prefill-0-agent", contract)
    transport = NixlTransport(kv, "prefill-0-agent", layout)
    leases = LeaseService(lease_s)
    server = SideChannelServer("127.0.0.1", 0, epoch, Welcome(layout, transport.metadata()),
                               leases)
    answers.put(("ready", server.port, epoch))
    try:
        while True:
            for _peer, messages in transport.take_notifs().items():
                for message in messages:
                    if message.startswith(b"done:"):
                        leases.release(message[5:].decode())
            for request_id in leases.take_ended():
                answers.put(("ended", request_id))
            try:
                command = commands.get(timeout=0.01)  # not a wall limit: a poll
            except queue.Empty:
                continue
            if command[0] == "issue":
                answers.put(("lease", leases.issue(command[1], command[2], command[3])))
            elif command[0] == "held":
                answers.put(("held", len(leases)))
            elif command[0] == "stop":
                break
    finally:
        server.close()
        transport.shutdown()


class PrefillPeer:
    """The peer process; `issue` a lease, `expect` an answer."""

    def __init__(self, shape: KVShape = KVShape(), contract: HashContract = CONTRACT,
                 lease_s: float = 30.0) -> None:
        context = mp.get_context("spawn")
        self.commands: mp.Queue = context.Queue()
        self.answers: mp.Queue = context.Queue()
        self.process = context.Process(target=_serve, args=(shape, contract, lease_s,
                                                            self.commands, self.answers),
                                       daemon=True)
        self.process.start()
        _, self.port, self.epoch = self.expect("ready")

    def expect(self, kind: str, cpu_budget_s: float = 60.0) -> tuple:
        def answer() -> tuple | None:
            try:
                got = self.answers.get_nowait()
            except queue.Empty:
                return None
            return got if got[0] == kind else None

        return wait_until(answer, f"the peer answers {kind!r}", cpu_budget_s,
                          (self.process.pid,))

    def issue(self, request_id: str, block_ids: list[list[int]],
              lease_s: float | None = None) -> str:
        self.commands.put(("issue", request_id, block_ids, lease_s))
        return self.expect("lease")[1]

    def held(self) -> int:
        self.commands.put(("held",))
        return self.expect("held")[1]

    def close(self) -> None:
        if self.process.is_alive():
            self.commands.put(("stop",))
            self.process.join(timeout=WATCHDOG_S)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
