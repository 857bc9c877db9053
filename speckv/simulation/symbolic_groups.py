"""SymbolicGroups: the toy runner's symbolic state of every KV cache group of a hybrid layout.

Owns what each group's blocks hold, per block id, and which positions a hit or a resumed
request needs, group by group, mirroring the real runner:

    full attention    target KV of every position; the draft group (the first full-attention
                      group: a drafter's KV follows its block table) also holds the draft KV
    sliding window W  target KV; a hit / resume at h needs positions [max(0, h - W + 1), h)
    Mamba / GDN, B    block k - 1 holds the state after k * B tokens (a checkpoint), block
                      (end - 1) // B the running state after `end`; a hit / resume at h
                      needs the state after h tokens in block (h - 1) // B

A Mamba state is recorded as the tokens it was computed from (`SymbolicState`): a checkpoint
is right exactly when it equals the hitting request's first h tokens. Rejected drafts never
advance it: a step that verifies drafts writes the states only after sampling, from the
accepted tokens (as `RunnerStates.commit` does); other steps write them with the forward.
"""

from __future__ import annotations

from collections.abc import Sequence

from speckv.cache.specs import FullAttentionSpec, KVCacheSpec, MambaSpec, SlidingWindowSpec

NULL_BLOCK_ID = 0  # the pool's null block: "no state here", never written


class SymbolicState:
    """A Mamba / GDN group's state per block id: the token prefix it was computed from."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.states: list[tuple[int, ...] | None] = [None] * num_blocks

    def write(self, block_id: int, prefix: Sequence[int]) -> None:
        if block_id != NULL_BLOCK_ID:
            self.states[block_id] = tuple(prefix)

    def read(self, block_id: int) -> object:
        return self.states[block_id]

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        rows = [self.states[src] for src, _ in copies]
        for (_, dst), row in zip(copies, rows):
            self.states[dst] = row


class SymbolicGroups:
    """Per-group symbolic stores (`SymbolicKV` for attention groups, `SymbolicState` for
    Mamba) over one layout, and the per-group rules of what a step writes and a hit reads."""

    def __init__(self, specs: Sequence[KVCacheSpec], stores: Sequence[object],
                 draft_depth: int) -> None:
        if len(specs) != len(stores):
            raise ValueError(f"{len(stores)} stores for {len(specs)} KV cache groups")
        self.specs = list(specs)
        self.stores = list(stores)
        self.draft_depth = draft_depth
        self.draft_group = next((g for g, spec in enumerate(specs)
                                 if isinstance(spec, FullAttentionSpec)), None)
        self.has_state = any(isinstance(spec, MambaSpec) for spec in specs)

    # ---- writes ------------------------------------------------------------------------------
    def forward(self, tables: Sequence[Sequence[int]], sequence: Sequence[int], start: int,
                end: int, verifies_drafts: bool) -> None:
        """The forward over positions [start, end) of `sequence` (real tokens + drafts)."""
        for g, (spec, store) in enumerate(zip(self.specs, self.stores)):
            if isinstance(spec, MambaSpec):
                if not verifies_drafts:
                    self._write_states(store, tables[g], sequence, start, end)
            else:
                draft_start = start if g == self.draft_group else end
                store.write(tables[g], sequence, start, end, draft_start)

    def commit(self, tables: Sequence[Sequence[int]], tokens: Sequence[int], start: int,
               num_computed: int, verified_drafts: bool) -> None:
        """After sampling: the drafter rewrites its KV for the accepted positions from the
        real tokens (module j of a k-module MTP reaches back j positions), and a step that
        verified drafts writes the states of its accepted positions."""
        if self.draft_group is not None:
            rewrite_from = max(0, start - self.draft_depth)
            self.stores[self.draft_group].write(tables[self.draft_group], tokens, num_computed,
                                                num_computed, rewrite_from)
        if verified_drafts:
            for g, spec in enumerate(self.specs):
                if isinstance(spec, MambaSpec):
                    self._write_states(self.stores[g], tables[g], tokens, start, num_computed)

    @staticmethod
    def _write_states(store: SymbolicState, table: Sequence[int], sequence: Sequence[int],
                      start: int, end: int) -> None:
        if end <= start:
            return
        size = store.block_size
        for boundary in range(start // size * size + size, end + 1, size):
            store.write(table[boundary // size - 1], sequence[:boundary])
        store.write(table[(end - 1) // size], sequence[:end])  # the running state

    def copy_blocks(self, copies: Sequence[tuple[int, int, int]]) -> None:
        """(group, source, destination) block copies, all sources read first."""
        for g, store in enumerate(self.stores):
            pairs = [(src, dst) for group, src, dst in copies if group == g]
            if pairs:
                store.copy_blocks(pairs)

    # ---- checks ------------------------------------------------------------------------------
    def mismatch(self, tables: Sequence[Sequence[int]], tokens: Sequence[int],
                 num_tokens: int, num_draft_positions: int,
                 state_at_checkpoint: bool = False) -> str | None:
        """Where the state a continuation from `num_tokens` reads (every group's share of it)
        is not what a cold run of `tokens` writes, draft KV checked at [0,
        num_draft_positions) of the draft group; None if it all is. `state_at_checkpoint`:
        check a Mamba group's state at the latest checkpoint <= `num_tokens` instead (after a
        forward that moved the running state on)."""
        if num_tokens <= 0:
            return None
        for g, (spec, store) in enumerate(zip(self.specs, self.stores)):
            table = tables[g]
            if isinstance(spec, MambaSpec):
                num_state = (num_tokens // spec.block_size * spec.block_size
                             if state_at_checkpoint else num_tokens)
                if num_state <= 0:
                    continue
                block_id = table[(num_state - 1) // spec.block_size]
                state = store.read(block_id)
                if state != tuple(tokens[:num_state]):
                    held = "nothing" if state is None else f"{len(state)} tokens"  # type: ignore[arg-type]
                    return (f"group {g} (mamba): the state after {num_state} tokens in block "
                            f"{block_id} was computed from {held}, not the request's prefix")
                continue
            first = 0
            if isinstance(spec, SlidingWindowSpec):
                first = max(0, num_tokens - spec.sliding_window + 1)
            num_draft = num_draft_positions if g == self.draft_group else 0
            if first == 0:  # the store's own (vectorized on paged tensors) check
                problem = store.mismatch(table, tokens, num_tokens, num_draft)
            else:
                problem = _window_mismatch(store, table, tokens, first, num_tokens, num_draft)
            if problem is not None:
                return f"group {g} ({spec.kind}): {problem}"
        return None


def _window_mismatch(store, table, tokens, first: int, end: int, num_draft: int) -> str | None:
    for position in range(first, max(end, num_draft)):
        target, draft = store.read(table, position)
        expected_target, expected_draft = store.expected_at(tokens, position)
        if position < end and target != expected_target:
            return f"position {position}: target KV of {target!r}, a cold run {expected_target}"
        if position < num_draft and draft != expected_draft:
            return f"position {position}: draft KV of {draft!r}, a cold run {expected_draft}"
    return None
