"""The decode side's bookkeeping of a transfer: the link to a prefill engine (`PeerLink`), one
request's pull under that engine's lease (`Pull`), and a NIXL READ in flight (`ReadInFlight`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from speckv.connectors.metadata import RequestLoad
from speckv.connectors.nixl.layout_desc import KVLayoutDesc
from speckv.connectors.nixl.params import KVTransferParams
from speckv.connectors.nixl.side_channel import SideChannelClient
from speckv.connectors.nixl.transport import ReadHandle

logger = logging.getLogger("speckv.connectors.nixl")


@dataclass
class PeerLink:
    client: SideChannelClient
    agent_name: str
    layout: KVLayoutDesc


@dataclass
class Pull:
    """One decode-side request that names a prefill engine's lease."""

    params: KVTransferParams
    peer: PeerLink | None = None
    # per KV cache group, the blocks to READ (local i <- remote i): only what the hit reads
    local_block_ids: tuple[tuple[int, ...], ...] = ()
    remote_block_ids: tuple[tuple[int, ...], ...] = ()
    num_blocks: int = 0  # blocks of every group the READ moves
    first_token: int = 0
    released: bool = False
    error: str | None = None  # why the handshake failed (None: it did not)
    load: RequestLoad | None = None  # what to READ, once the blocks are allocated


@dataclass
class ReadInFlight:
    load: RequestLoad
    pull: Pull
    read: ReadHandle
    started: float
    deadline: float
