"""The P/D transfer per KV cache group: what the prefill side offers, how long a hit the
decode side takes from it, and which blocks that hit READs. Pure.

Owns the three per-group computations of `NixlConnector`, over the cache manager's hit rule
(`cache.group_rules`: the longest prefix every group serves, full attention every block, a
sliding window the blocks before the hit, GDN / Mamba the state checkpoint at the hit):

    offer      prefill side, at finish: per group the blocks still held (0 where a sliding
               window or an old checkpoint was released) whose KV / state is complete and
               provable (hashed, written, at most (N - 1) // B_g), and `num_tokens`, the
               longest prefix every group serves with them; the manifest per group
    servable   decode side: a group's block i is at hand where the local hit covers it or
               where the peer holds it under the hash this engine computes itself (attention
               groups: the mode's lookahead chain; GDN: legacy hashes); the hit is the local
               rule's over those (at most N - 1, the legacy drop once)
    reads      what a hit H needs beyond the local hit h:

    full attention   blocks [h / B, H / B)
    sliding window   the window's blocks before H: [max(h / B, H / B - ceil((W - 1) / B)),
                     H / B)  (the blocks between hold nothing and are never cached)
    GDN / Mamba      one block: the checkpoint H / U - 1, the state after exactly H tokens

Which GDN state: the decode engine resumes at H (a multiple of U, at most N - 1, so it
recomputes the prompt's tail and samples the first token itself); its first computed token,
at position H, reads the state after H tokens from block (H - 1) // U. The prefill engine ran
[0, N) and wrote the checkpoint at every multiple of U it crossed, so block H / U - 1 of its
table holds exactly that state (conv inputs and recurrent state), as a cold run's does. Its
running state after N (block (N - 1) // U) is not what the decode side needs: resuming at N
would skip the last prompt token's logits, and the attention and draft KV would end off the
block grid:

    prompt of N = 1,300 tokens, U = 544, blocks of B = 16:

    tokens   [0 ......... 544)[544 ....... 1088)[1088 ... 1300)
    GDN      state@544         state@1088        state@1300 (running, not sent)
    full KV  blocks 0 .. 67 (positions < 1088)   68 .. 81 (recomputed)
    decode   H = 1088: READ full blocks 0..67 + the GDN block holding state@1088, compute
             [1088, 1300) from state@1088 (what a cold run's position 1088 reads), sample
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from speckv.cache.block import NULL_BLOCK_ID
from speckv.cache.group_rules import GroupRule, group_hashes, hit_given
from speckv.connectors.nixl.params import KVTransferParams
from speckv.connectors.rules import ConnectorMode, ConnectorRequest, num_lookup_candidates


def group_rules(mode: ConnectorMode) -> list[GroupRule]:
    """Every KV cache group's hit rule from the engine's mode: one full-attention group, or a
    hybrid's groups. A sliding window enters by the blocks a hit reads before it
    (`num_needed_blocks`): the smallest window that reads as many."""
    if not mode.groups:
        return [GroupRule(0, "full_attention", mode.block_size, mode.lookahead_tokens)]
    return [GroupRule(g.group_id, g.kind, g.block_size, g.lookahead_tokens,
                      g.num_needed_blocks * g.block_size + 1
                      if g.kind == "sliding_window" else None) for g in mode.groups]


@dataclass(frozen=True)
class Groups:
    """The groups of one engine: their rules, the hash unit and the alignment unit."""

    rules: tuple[GroupRule, ...]

    @property
    def hash_unit(self) -> int:
        return _gcd(rule.block_size for rule in self.rules)

    @property
    def unit(self) -> int:
        return _lcm(rule.block_size for rule in self.rules)

    def mismatch(self, params: KVTransferParams) -> str | None:
        """Why a peer's params cannot map onto these groups (None: they can)."""
        sizes = [params.block_size_of(g) for g in range(len(params.block_ids))]
        if sizes != [rule.block_size for rule in self.rules]:
            return (f"kv_transfer_params.block_ids: {len(sizes)} KV cache groups of {sizes} "
                    f"tokens, this engine has {[rule.block_size for rule in self.rules]}")
        return None

    def hashes(self, request: ConnectorRequest, rule: GroupRule) -> Sequence[bytes]:
        """A group's block hashes of `request`, as the cache manager names its blocks."""
        chain = request.get_block_hashes(rule.lookahead_tokens)
        return group_hashes(chain, rule.block_size // self.hash_unit)

    def offer(self, request: ConnectorRequest, tables: Sequence[Sequence[int]],
              num_written_tokens: int, num_prompt_tokens: int
              ) -> tuple[int, list[list[int]], list[list[bytes]]]:
        """Prefill side: (num_tokens, block ids per group, manifest per group)."""
        held, hashes = [], []
        for rule, table in zip(self.rules, tables):
            own = self.hashes(request, rule)
            limit = min(num_lookup_candidates(num_prompt_tokens, len(own), rule.block_size),
                        num_written_tokens // rule.block_size, len(table))
            held.append([table[index] != NULL_BLOCK_ID for index in range(limit)])
            hashes.append(own)
        num_tokens = hit_given(self.rules, held, self.unit, num_prompt_tokens - 1, False)
        block_ids = [[int(table[index]) if held_g[index] else 0
                      for index in range(num_tokens // rule.block_size)]
                     for rule, table, held_g in zip(self.rules, tables, held)]
        manifest = [[bytes(h[index]) if ids[index] else b"" for index in range(len(ids))]
                    for h, ids in zip(hashes, block_ids)]
        return num_tokens, block_ids, manifest

    def servable(self, request: ConnectorRequest, params: KVTransferParams,
                 num_local_hit_tokens: int, drops_last_unit: bool
                 ) -> tuple[int, tuple[int, int] | None]:
        """Decode side: (tokens after the local hit the peer's blocks serve, the first
        (group, block) whose manifest hash differs from this engine's, or None)."""
        helds = []
        stale: tuple[int, int] | None = None
        for g, rule in enumerate(self.rules):
            own = self.hashes(request, rule)
            local = num_local_hit_tokens // rule.block_size
            ids, manifest = params.block_ids[g], params.manifest[g]
            held = [index < local or (index < len(ids) and ids[index] != 0
                                      and manifest[index] == bytes(own[index]))
                    for index in range(len(own))]
            if stale is None:
                stale = next(((g, index) for index in range(local, min(len(ids), len(own)))
                              if ids[index] and not held[index]), None)
            helds.append(held)
        hit = hit_given(self.rules, helds, self.unit, request.num_tokens - 1, drops_last_unit)
        return max(0, hit - num_local_hit_tokens), stale

    def reads(self, tables: Sequence[Sequence[int]], params: KVTransferParams,
              num_local_hit_tokens: int, end: int
              ) -> tuple[tuple[tuple[int, ...], ...], tuple[tuple[int, ...], ...]]:
        """Decode side: per group, (local block ids, the peer's block ids) a hit at `end`
        reads beyond the local hit (the module docstring)."""
        local_ids, remote_ids = [], []
        for g, rule in enumerate(self.rules):
            first = num_local_hit_tokens // rule.block_size
            needed = [index for index in rule.needed_blocks(end) if index >= first]
            local_ids.append(tuple(int(tables[g][index]) for index in needed))
            remote_ids.append(tuple(int(params.block_ids[g][index]) for index in needed))
        return tuple(local_ids), tuple(remote_ids)


def _gcd(values) -> int:
    import math

    return math.gcd(*values)


def _lcm(values) -> int:
    import math

    return math.lcm(*values)
