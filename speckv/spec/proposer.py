"""The speculative-decoding seam: what a drafter gets after verification, and what it returns.

Owns the `Proposer` protocol and its per-request input. The n-gram proposer
(`speckv.spec.ngram`) and the EAGLE / EAGLE3 / MTP drafters (`DrafterProposer` in
`speckv.drafters.proposer`) implement it. The model runner calls `propose` once per step, after
verification and BEFORE the scheduler frees any finished request, so a drafter writes its draft
KV for every position made final this step (finishing requests included) before the block that
position completes can be cached: draft KV first, then the block's hash is used.

For position p of a request, the drafter reads the target's hidden state at p and the real
token at p + 1 (`token_ids[p + 1]`, i.e. the token after it; module j of a k-module MTP reads
`token_ids[p + j]`). A drafter keeps its own `PagedKVCache` with the same `num_blocks` and
`block_size` as the target's, so the same block table and slot mapping address it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from speckv.spec.policy import DrafterPolicy


@dataclass(frozen=True)
class ProposerInput:
    """One request's positions made final this step (target KV written, token after known)."""

    request_id: str
    token_ids: Sequence[int]  # all real tokens of the request (prompt + output), after this step
    start: int  # first final position of this step
    end: int  # one past the last final position (= num_computed_tokens after verification)
    # Target hidden states at positions [start, end), each [end - start, hidden]:
    hidden_states: torch.Tensor  # after the final norm (LM-head input)
    prenorm_hidden: torch.Tensor  # last decoder layer output, before the final norm
    aux_hidden_states: tuple[torch.Tensor, ...]  # per requested aux layer (see ModelOutput)
    block_table: Sequence[int]  # physical block ids (group 0), shared with the drafter's cache
    slot_mapping: torch.Tensor  # [end - start] int64 physical slots of positions [start, end)
    wants_drafts: bool  # False: finishing (write draft KV only) or still prefilling
    max_drafts: int  # drafts allowed for this request next step (<= num_spec_tokens)
    # one block table per KV cache group of the target (drafters that read the target's
    # KV in every group: the Gemma 4 assistant); () where the runner does not pass them
    block_tables: tuple[Sequence[int], ...] = ()


@dataclass(frozen=True)
class ProposeTiming:
    """What the latest `propose` call spent (seconds), for the adaptive draft length."""

    catch_up_s: float = 0.0  # writing the draft KV of the positions made final
    draft_s: float = 0.0  # proposing the drafts


class Proposer(Protocol):
    num_spec_tokens: int
    policy: DrafterPolicy  # decides lookahead hashes vs the legacy drop
    # Target layers whose outputs the drafter reads (EAGLE3); () for none.
    aux_layers: tuple[int, ...]
    last_timing: ProposeTiming  # of the latest `propose` call

    def propose(self, inputs: Sequence[ProposerInput]) -> dict[str, list[int]]:
        """Write draft KV for the final positions; return drafts (<= max_drafts) per request
        id for the requests with `wants_drafts`."""
        ...

    def free(self, request_id: str) -> None:
        """Forget a finished / aborted request's per-request state."""
        ...
