"""Helpers for engine tests on the tiny GDN hybrid: run to completion, an oracle proposer."""

from __future__ import annotations

from collections.abc import Sequence

from speckv.cache.drafter_policy import drafter_policy
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.outputs import RequestOutput
from speckv.speculation.proposer import ProposerInput, ProposeTiming


def run_all(engine: LLMEngine) -> dict[str, RequestOutput]:
    finished: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    return finished


class OracleProposer:
    """Proposes the known greedy continuation, with every `wrong_every`-th draft wrong, so
    windows are accepted in part and rejected in part (no draft KV: an n-gram-like proposer)."""

    aux_layers: tuple[int, ...] = ()
    kv_cache = None
    last_timing = ProposeTiming()

    def __init__(self, reference: dict[str, list[int]], num_spec_tokens: int,
                 wrong_every: int = 3, vocab_size: int = 128) -> None:
        self.reference = reference  # request id -> prompt + greedy output
        self.num_spec_tokens = num_spec_tokens
        self.policy = drafter_policy("ngram")
        self.wrong_every = wrong_every
        self.vocab_size = vocab_size
        self.calls = 0

    def free(self, request_id: str) -> None:
        pass

    def bind_target_kv(self, kv_cache, layout) -> None:
        pass

    def propose(self, inputs: Sequence[ProposerInput]) -> dict[str, list[int]]:
        out = {}
        for x in inputs:
            if not x.wants_drafts:
                continue
            ref = self.reference[x.request_id]
            n = len(x.token_ids)
            drafts = list(ref[n: n + min(x.max_drafts, self.num_spec_tokens)])
            self.calls += 1
            if drafts and self.calls % self.wrong_every == 0:
                bad = len(drafts) // 2
                drafts[bad] = (drafts[bad] + 1) % self.vocab_size
            out[x.request_id] = drafts
        return out
