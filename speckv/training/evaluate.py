"""A standalone greedy speculative-decoding loop (target + drafter on paged caches, no engine).

Owns the reference use of the drafter interface: prefill, catch-up, propose, verify, accept.
With greedy verification its output equals the target's own greedy output token for token; the
mean acceptance length (tokens produced per target forward = accepted drafts + 1) measures the
drafter. Block ids can be shuffled to exercise the paged addressing.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from speckv.attention import AttentionMetadata
from speckv.drafters.base import Drafter
from speckv.drafters.draft_state import CatchUpRequest, DraftCarry, TargetStates
from speckv.models.base import TargetModel


@dataclass(frozen=True)
class SpecResult:
    tokens: list[int]  # generated tokens (prompt excluded)
    accepted_per_step: list[int]  # drafts accepted in each verification step

    @property
    def acceptance_length(self) -> float:
        """Mean tokens per target verification step (accepted drafts + the bonus token)."""
        steps = self.accepted_per_step
        return (sum(steps) + len(steps)) / len(steps) if steps else 0.0


@torch.inference_mode()
def speculative_generate(
    target: TargetModel,
    drafter: Drafter,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    num_spec_tokens: int = 3,
    stop_token_ids: Sequence[int] = (),
    block_size: int = 16,
    shuffle_blocks_seed: int | None = None,
    prefill_chunk_tokens: int = 0,
) -> SpecResult:
    """Greedy speculative decoding of one request; returns exactly the target's greedy tokens.

    `prefill_chunk_tokens` > 0 prefills in chunks (exercises carries across passes).
    The reference loop (prefill, draft, verify, roll back) the engine's speculation is
    checked against, read top to bottom.
    """
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    num_blocks, table = _block_table(len(prompt_ids) + max_new_tokens + num_spec_tokens + 1,
                                     block_size, shuffle_blocks_seed)
    kv = target.make_kv_cache(num_blocks, block_size)
    dkv = drafter.make_kv_cache(num_blocks, block_size)
    device = target.device
    aux = drafter.target_aux_layers

    def run_target(ids: list[int], start: int) -> tuple[torch.Tensor, TargetStates]:
        md = AttentionMetadata.build([len(ids)], [start + len(ids)], [table], block_size, device)
        out = target(
            torch.tensor(ids, dtype=torch.int64, device=device), md.positions(), kv, md, aux
        )
        logits = target.compute_logits(out.hidden_states)  # [len(ids), vocab]
        return logits, TargetStates(out.hidden_states, out.aux_hidden_states)

    tokens = list(prompt_ids)
    n_prompt = len(prompt_ids)
    carry: DraftCarry | None = None
    # Prefill (optionally chunked): every chunk is a catch-up pass over its positions.
    chunk = prefill_chunk_tokens if prefill_chunk_tokens > 0 else n_prompt
    done = 0
    state = None
    while done < n_prompt:
        ids = tokens[done : done + chunk]
        logits, ts = run_target(ids, done)
        end = done + len(ids)
        if end == n_prompt:
            tokens.append(int(logits[-1].argmax()))
        state = drafter.write_draft_kv(
            ts,
            [CatchUpRequest(done, len(ids), tokens[done + 1 : end + 1], table, carry)],
            dkv,
        )
        carry = state.carries[0]
        done = end
    assert state is not None
    accepted: list[int] = []
    stop = set(stop_token_ids)
    while len(tokens) - n_prompt < max_new_tokens and not stop.intersection(tokens[n_prompt:]):
        n = len(tokens)
        drafts = drafter.propose(state, num_spec_tokens, dkv)[0].tolist()  # [S]
        logits, ts = run_target([tokens[-1], *drafts], n - 1)  # positions n-1 .. n-1+S
        greedy = logits.argmax(-1).tolist()  # greedy[i] = target's token at position n+i
        a = 0
        while a < num_spec_tokens and drafts[a] == greedy[a]:
            a += 1
        new = [*drafts[:a], greedy[a]]
        accepted.append(a)
        tokens.extend(new)
        # Target rows of the accepted prefix: positions n-1 .. n-1+a.
        state = drafter.write_draft_kv(
            ts.select(torch.arange(a + 1, device=device)),
            [CatchUpRequest(n - 1, a + 1, new, table, carry)],
            dkv,
        )
        carry = state.carries[0]
    return SpecResult(_cut_at_stop(tokens[n_prompt:], stop)[:max_new_tokens], accepted)



def _block_table(num_tokens: int, block_size: int, shuffle_seed: int | None
                 ) -> tuple[int, list[int]]:
    """Blocks for `num_tokens` (+ the null block) and one request's table over them, in
    order or shuffled by `shuffle_seed`."""
    num_blocks = -(-num_tokens // block_size) + 1
    table = list(range(1, num_blocks))  # NULL_BLOCK_ID (0) stays out of the table
    if shuffle_seed is not None:
        random.Random(shuffle_seed).shuffle(table)
    return num_blocks, table


def _cut_at_stop(out: list[int], stop: set[int]) -> list[int]:
    """The target would have stopped at the first stop token: `out` up to it."""
    for i, t in enumerate(out):
        if t in stop:
            return out[: i + 1]
    return out


def mean_acceptance_length(results: Sequence[SpecResult]) -> float:
    """Tokens per verification step over all steps of all results."""
    return SpecResult([], [a for r in results for a in r.accepted_per_step]).acceptance_length
