"""The per-group rules of a P/D transfer (pure): what the prefill side offers from the blocks it
still holds, how long a hit the decode side takes beyond its local hit, and which blocks that
hit reads (every full block, the window's blocks, one GDN state)."""

from __future__ import annotations

from speckv.cache.group_rules import GroupRule
from speckv.connectors.nixl.groups import Groups
from speckv.connectors.nixl.params import HashContract, KVTransferParams

B, U = 4, 8
GDN = Groups((GroupRule(0, "full_attention", B, 1), GroupRule(1, "mamba", U, 0)))
SWA = Groups((GroupRule(0, "full_attention", B, 1), GroupRule(1, "sliding_window", B, 1, 10)))


class _Request:
    """A prompt whose chain hash i is `b"h<L>:<i>"` (enough for these rules)."""

    request_id = "r"

    def __init__(self, num_tokens: int) -> None:
        self.num_tokens = num_tokens

    def get_block_hashes(self, lookahead: int) -> list[bytes]:
        return [f"h{lookahead}:{i}".encode() for i in range((self.num_tokens - lookahead) // B)]


def _params(groups: Groups, num_tokens: int, block_ids, manifest) -> KVTransferParams:
    return KVTransferParams("p", "e", "127.0.0.1", 5000, "l", block_ids, num_tokens, 0,
                            HashContract("sha256", "0", B, 1, False), manifest,
                            [rule.block_size for rule in groups.rules])


def test_the_offer_is_the_longest_prefix_every_held_group_serves():
    request = _Request(46)
    full = list(range(1, 12))  # 11 blocks of 4: positions < 44
    state = [0, 0, 0, 20, 21]  # checkpoints at 8..24 released, 32 and 40 held
    num_tokens, ids, manifest = GDN.offer(request, [full, state], 45, 45)
    assert num_tokens == 40  # (45 - 1) // 8 * 8, the state at 40 held
    assert ids == [full[:10], [0, 0, 0, 20, 21]]
    assert manifest[1] == [b"", b"", b"", b"h0:7", b"h0:9"]  # state hashes: legacy chain
    # the state at 40 released too: the offer falls back to the checkpoint at 32
    num_tokens, ids, _ = GDN.offer(request, [full, [0, 0, 0, 20, 0]], 45, 45)
    assert num_tokens == 32 and ids[1] == [0, 0, 0, 20]


def test_the_decode_side_reads_only_what_the_hit_needs_beyond_its_local_hit():
    request = _Request(46)
    tables = [list(range(101, 113)), list(range(201, 213))]
    params = _params(SWA, 44, [list(range(1, 12)), list(range(21, 32))],
                     [[f"h1:{i}".encode() for i in range(11)]] * 2)
    tokens, stale = SWA.servable(request, params, 16, False)
    assert (tokens, stale) == (28, None)  # up to 44 = (46 - 1) // 4 * 4 (the hashes allow)
    local, remote = SWA.reads(tables, params, 16, 44)
    assert local == (tuple(range(105, 112)), (209, 210, 211))  # full 4..10; window 8..10
    assert remote == (tuple(range(5, 12)), (29, 30, 31))
    # a stale block hash in the window: the hit stops before it, the block is named
    bad = _params(SWA, 44, params.block_ids,
                  [params.manifest[0], [*params.manifest[1][:9], b"x", b"y"]])
    tokens, stale = SWA.servable(request, bad, 16, False)
    assert stale == (1, 9) and tokens == 36 - 16  # the window before 36 is blocks 6..8
    gdn = _params(GDN, 40, [list(range(1, 11)), [0, 0, 0, 24, 25]],
                  [[f"h1:{i}".encode() for i in range(10)],
                   [b"", b"", b"", b"h0:7", b"h0:9"]])
    assert GDN.servable(request, gdn, 16, False) == (24, None)
    local, remote = GDN.reads([list(range(101, 112)), list(range(201, 207))], gdn, 16, 40)
    assert local == (tuple(range(105, 111)), (205,)) and remote[1] == (25,)  # one state
    # the legacy drop: one unit less, as a local hit
    assert GDN.servable(request, gdn, 16, True)[0] == 32 - 16
