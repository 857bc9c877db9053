"""`DrafterProposer`: the engine's `Proposer` protocol on top of a drafter (EAGLE/EAGLE3/MTP).

Owns the translation from the engine's per-step `ProposerInput`s (positions made final this
step, their target hidden states, the request's real tokens and block table) to one batched
`Drafter.write_draft_kv` catch-up and one batched `Drafter.propose`, the drafter's own
`PagedKVCache` (same num_blocks / block_size as the target's), and the per-request
`DraftCarry` (dropped when a request's next pass does not continue where the last ended: a
prefix hit or a resumed preemption starts fresh, which is correct because every position below
the new start already has all modules' draft KV).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from speckv.drafters.base import CatchUpRequest, DraftCarry, Drafter, TargetStates
from speckv.spec.policy import DrafterPolicy
from speckv.spec.proposer import ProposerInput, ProposeTiming


def _target_states(items: Sequence[ProposerInput], num_aux: int) -> TargetStates:
    """The items' target rows, in order, as one TargetStates: one gather from the step's
    shared rows when the runner built the items, else the items' own tensors concatenated."""
    shared = items[0].target_rows
    if shared is not None and all(x.target_rows is shared for x in items):
        counts = np.fromiter((x.end - x.start for x in items), np.int64, len(items))
        firsts = np.fromiter((x.first_row for x in items), np.int64, len(items))
        total = int(counts.sum())
        # [total] row of every position: firsts[i] + 0 .. counts[i] - 1 per item
        index = np.repeat(firsts - (np.cumsum(counts) - counts), counts) + np.arange(total)
        num_rows = shared.hidden_states.shape[0]
        if total == num_rows and bool((index == np.arange(total)).all()):
            return TargetStates(shared.hidden_states, tuple(shared.aux_hidden_states[:num_aux]))
        rows = torch.from_numpy(index).to(shared.hidden_states.device)
        return TargetStates(shared.hidden_states.index_select(0, rows),
                            tuple(h.index_select(0, rows)
                                  for h in shared.aux_hidden_states[:num_aux]))
    return TargetStates(
        torch.cat([x.hidden_states for x in items]),
        tuple(torch.cat([x.aux_hidden_states[i] for x in items]) for i in range(num_aux)),
    )


class DrafterProposer:
    """Runner adapter: call `propose(inputs)` once per step (see speckv/spec/proposer.py)."""

    def __init__(
        self,
        drafter: Drafter,
        num_spec_tokens: int,
        num_blocks: int,
        block_size: int,
    ) -> None:
        if num_spec_tokens < 1:
            raise ValueError(f"num_spec_tokens must be >= 1, got {num_spec_tokens}")
        self.drafter = drafter
        self.policy: DrafterPolicy = drafter.policy  # decides lookahead hashes vs the drop
        self.num_spec_tokens = num_spec_tokens
        self.aux_layers: tuple[int, ...] = drafter.target_aux_layers
        self.kv_cache = drafter.make_kv_cache(num_blocks, block_size)
        self._carries: dict[str, DraftCarry] = {}
        self.last_timing = ProposeTiming()

    def free(self, request_id: str) -> None:
        """Forget a finished request's carry (the engine should call this when it frees one)."""
        self._carries.pop(request_id, None)

    def propose(self, inputs: Sequence[ProposerInput]) -> dict[str, list[int]]:
        start = time.perf_counter()
        self.last_timing = ProposeTiming()
        items = [x for x in inputs if x.end > x.start]
        if not items:
            return {}
        L = self.drafter.draft_kv_lookahead_tokens
        reqs = []
        for x in items:
            carry = self._carries.get(x.request_id)
            if carry is not None and carry.next_position != x.start:
                carry = None  # prefix hit / preemption: positions below start are complete
            # Real tokens after each final position, plus up to L - 1 more known ones (prefill).
            nxt = list(x.token_ids[x.start + 1 : x.end + L])
            reqs.append(CatchUpRequest(x.start, x.end - x.start, nxt, x.block_table, carry))
        states = _target_states(items, len(self.aux_layers))
        # Draft only for requests whose catch-up reaches their last real token.
        want = [
            i
            for i, x in enumerate(items)
            if x.wants_drafts and x.max_drafts > 0 and x.end == len(x.token_ids) - 1
        ]
        state = self.drafter.write_draft_kv(states, reqs, self.kv_cache, will_propose=bool(want))
        for x, c in zip(items, state.carries):
            self._carries[x.request_id] = c
        caught_up = time.perf_counter()
        self.last_timing = ProposeTiming(caught_up - start, 0.0)
        if not want:
            return {}
        # Greedy drafts are a prefix of longer runs: draft no more than any request may take.
        num = min(self.num_spec_tokens, max(items[i].max_drafts for i in want))
        drafts = self.drafter.propose(state.subset(want), num, self.kv_cache).tolist()
        self.last_timing = ProposeTiming(caught_up - start, time.perf_counter() - caught_up)
        return {items[i].request_id: d[: items[i].max_drafts] for i, d in zip(want, drafts)}
