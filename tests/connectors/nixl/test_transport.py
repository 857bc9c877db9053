"""The NIXL data path and the side channel between two real processes on loopback: paged
blocks of every layer of the target and the drafter arrive bit-exact; a READ is admitted only
for blocks under a live lease; a mismatched peer is refused by field."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch

from speckv.connectors.nixl.layout_desc import check_peer_layout, describe_layout
from speckv.connectors.nixl.params import HashContract, ParamsError
from speckv.connectors.nixl.side_channel import (
    Admit,
    Admitted,
    Alive,
    Heartbeat,
    Hello,
    Refused,
    Release,
    Released,
    SideChannelClient,
    SideChannelError,
    Welcome,
)
from speckv.connectors.nixl.transport import NixlTransport, nixl_available
from tests.connectors.nixl.peer_helpers import CONTRACT, KVShape, PrefillPeer, make_kv
from tests.patience import WATCHDOG_S, wait_until

pytestmark = pytest.mark.skipif(not nixl_available(), reason="needs nixl-cu12")


@pytest.fixture(scope="module")
def peer() -> Iterator[PrefillPeer]:
    peer = PrefillPeer()
    yield peer
    peer.close()


@pytest.fixture(scope="module")
def decode() -> Iterator[tuple[NixlTransport, SideChannelClient, str, Welcome]]:
    kv = make_kv(KVShape(), None)
    layout = describe_layout(kv, "decode-0", "epoch-d", "decode-0-agent", CONTRACT)
    transport = NixlTransport(kv, "decode-0-agent", layout)
    yield transport, layout
    transport.shutdown()


def _welcome(peer: PrefillPeer) -> tuple[SideChannelClient, Welcome]:
    client = SideChannelClient("127.0.0.1", peer.port, timeout_s=WATCHDOG_S)
    welcome = client.call(Hello("decode-0", "epoch-d"))
    assert isinstance(welcome, Welcome)
    return client, welcome


def test_a_read_of_paged_blocks_arrives_bit_exact_and_releases_the_lease(peer, decode) -> None:
    transport, layout = decode
    client, welcome = _welcome(peer)
    check_peer_layout(layout, welcome.layout)
    name = transport.add_peer(welcome.agent_metadata, welcome.layout)
    remote, local = [3, 9, 5, 7], [1, 2, 11, 4]
    lease = peer.issue("r-read", [remote])
    assert isinstance(client.call(Admit(peer.epoch, lease, [remote], 10.0)), Admitted)
    read = transport.start_read(name, [remote], [local], b"done:" + lease.encode())
    wait_until(lambda: transport.poll(read) != "PROC", "the READ completes",
               pids=(peer.process.pid,), poll_s=0.001)
    assert read.state == "DONE"
    expected = make_kv(KVShape(), seed=1234)  # the peer's contents, rebuilt from its seed
    for mine, theirs in zip(transport.kv.caches, expected.caches):
        # same bytes copied: exact
        assert torch.equal(mine.storage[:, :, local], theirs.storage[:, :, remote])
        untouched = [b for b in range(KVShape().num_blocks) if b not in local]
        assert not mine.storage[:, :, untouched].any()
    assert peer.expect("ended")[1] == "r-read"  # the READ's notification ended the lease
    assert peer.held() == 0
    assert isinstance(client.call(Admit(peer.epoch, lease, [remote], 10.0)), Refused)
    client.close()


def test_reads_are_admitted_only_under_a_live_lease_of_this_epoch(peer) -> None:
    client, _ = _welcome(peer)
    lease = peer.issue("r-stray", [[2, 4]])
    stray = client.call(Admit(peer.epoch, lease, [[2, 6]], 10.0))
    assert isinstance(stray, Refused) and stray.field == "block_ids[0]"
    stale = client.call(Admit("another-epoch", lease, [[2]], 10.0))
    assert isinstance(stale, Refused) and stale.field == "epoch"
    assert client.call(Heartbeat(peer.epoch, [lease, "nope"])) == Alive([True, False])
    assert client.call(Release(peer.epoch, lease)) == Released(True)
    assert peer.expect("ended")[1] == "r-stray"
    short = peer.issue("r-short", [[2]], lease_s=0.2)
    time.sleep(0.3)
    expired = client.call(Admit(peer.epoch, short, [[2]], 10.0))
    assert isinstance(expired, Refused) and expired.field == "lease_id"
    assert peer.expect("ended")[1] == "r-short"  # the expired lease freed its blocks
    client.close()


def test_a_mismatched_peer_is_refused_naming_the_field(peer) -> None:
    client, welcome = _welcome(peer)
    other = describe_layout(make_kv(KVShape(dtype="bfloat16"), None), "d", "e", "d-agent",
                            HashContract("sha256", "0", 4, 1, False))
    with pytest.raises(ParamsError) as refused:
        check_peer_layout(other, welcome.layout)
    assert refused.value.field == "layout.segments[target].dtype"
    client.close()


def test_a_dead_side_channel_times_out() -> None:
    client = SideChannelClient("127.0.0.1", 1, timeout_s=0.2)  # not a wall limit: made to fire
    with pytest.raises(SideChannelError, match="no answer"):
        client.call(Hello("d", "e"))
    client.close()
