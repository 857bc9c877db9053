"""A model-free driver of the real KV cache manager, for benchmarks, samples and tests.

Owns nothing but a toy next-token rule: it runs requests through the scheduler-side lifecycle
(hit → allocate → compute → verify drafts → cache → finish / preempt) exactly as the engine
does, with a deterministic "target model" (`next_token`) so drafts can be accepted or rejected
on purpose.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from speckv.cache.kv_cache_manager import KVCacheManager
from speckv.engine.request import Request, RequestStatus


def next_token(context: Sequence[int], vocab_size: int) -> int:
    """The toy target model: a fixed function of the last three tokens."""
    a, b, c = (list(context[-3:]) + [0, 0, 0])[:3]
    return (a * 1_000_003 + b * 10_007 + c * 101 + len(context) * 7) % vocab_size


class SymbolicKV:
    """A stand-in for the paged KV tensors that records what each slot was computed from.

    target[slot] = the token at that position; draft[slot] = the tokens after it that the
    drafter's KV at that position was computed from (k of them for k-module MTP). A cache hit
    is correct exactly when every hit slot holds what a cold run of the hitting request would
    write: `expected_at(tokens, position)`.
    """

    def __init__(self, num_blocks: int, block_size: int, draft_depth: int) -> None:
        self.block_size = block_size
        self.draft_depth = draft_depth
        self.target: list[int | None] = [None] * (num_blocks * block_size)
        self.draft: list[tuple[int, ...] | None] = [None] * (num_blocks * block_size)

    def slot(self, block_ids: Sequence[int], position: int) -> int:
        return block_ids[position // self.block_size] * self.block_size + (
            position % self.block_size
        )

    def write(self, block_ids: Sequence[int], sequence: Sequence[int], start: int,
              end: int, draft_start: int) -> None:
        """Compute positions [start, end) over `sequence` (real tokens + drafts): target KV
        there, draft KV at [draft_start, end) from the tokens after each position."""
        for position in range(start, end):
            self.target[self.slot(block_ids, position)] = sequence[position]
        for position in range(draft_start, end):
            self.draft[self.slot(block_ids, position)] = tuple(
                sequence[position + 1 : position + 1 + self.draft_depth]
            )

    def expected_at(self, tokens: Sequence[int], position: int) -> tuple[int, tuple[int, ...]]:
        return tokens[position], tuple(tokens[position + 1 : position + 1 + self.draft_depth])

    def read(self, block_ids: Sequence[int], position: int) -> tuple[object, object]:
        slot = self.slot(block_ids, position)
        return self.target[slot], self.draft[slot]


@dataclass(frozen=True)
class StepOutcome:
    scheduled: bool  # False: no free blocks (nothing changed)
    num_new_tokens: int = 0
    num_accepted: int = 0
    finished: bool = False


class CacheSimulator:
    def __init__(self, manager: KVCacheManager, num_spec_tokens: int, vocab_size: int = 32000,
                 kv: SymbolicKV | None = None):
        self.manager = manager
        self.num_spec_tokens = num_spec_tokens
        self.vocab_size = vocab_size
        self.kv = kv

    def step(self, request: Request, num_accept: int = 0) -> StepOutcome:
        """Schedule all of a request's pending tokens (+ its drafts) for one step, run the toy
        model, accept `num_accept` drafts (capped), propose new drafts. Mutates."""
        if request.is_finished:
            raise ValueError(f"request {request.request_id} is finished")
        hit = None
        if request.num_computed_tokens == 0 and request.status is not RequestStatus.RUNNING:
            hit = self.manager.get_computed_blocks(request)
        num_hit = hit.num_computed_tokens if hit is not None else 0
        num_drafts = len(request.spec_token_ids)
        num_new = request.num_tokens - request.num_computed_tokens - num_hit + num_drafts
        allocation = self.manager.allocate_slots(request, num_new, hit, self.num_spec_tokens)
        if allocation is None:
            return StepOutcome(scheduled=False)
        if hit is not None:
            request.num_cached_tokens = num_hit
        request.status = RequestStatus.RUNNING
        first_new = request.num_computed_tokens + num_hit
        request.num_computed_tokens += num_hit + num_new
        if self.kv is not None:
            # target pass over real tokens + drafts; the drafter's proposal pass writes draft
            # KV from whatever follows (drafts included: garbage where they get rejected)
            sequence = [*request.all_token_ids, *request.spec_token_ids]
            self.kv.write(self.block_ids(request), sequence, first_new,
                          request.num_computed_tokens, first_new)
        # verification: drafts matching the toy model are accepted, up to num_accept
        context = list(request.all_token_ids)
        sampled: list[int] = []
        for draft in request.spec_token_ids:
            expected = next_token(context, self.vocab_size)
            if len(sampled) >= num_accept or draft != expected:
                break
            sampled.append(draft)
            context.append(draft)
        sampled.append(next_token(context, self.vocab_size))
        num_room = request.max_tokens - request.num_output_tokens
        sampled = sampled[: max(1, num_room)]
        request.apply_verification(num_drafts, sampled)
        if self.kv is not None:
            # the drafter rewrites its KV for the accepted positions from the real tokens;
            # module j of a k-module MTP reaches back j positions
            rewrite_from = max(0, first_new - self.kv.draft_depth)
            self.kv.write(self.block_ids(request), request.all_token_ids,
                          request.num_computed_tokens, request.num_computed_tokens,
                          rewrite_from)
        stop = request.check_stop()
        if stop is not None:
            request.status = stop
            self.manager.finish(request)
            return StepOutcome(True, num_new, len(sampled) - 1, finished=True)
        request.spec_token_ids = self._propose(request)
        return StepOutcome(True, num_new, len(sampled) - 1)

    def block_ids(self, request: Request) -> list[int]:
        return self.manager.get_block_ids(request.request_id)[0]

    def _propose(self, request: Request) -> list[int]:
        """Drafts: the toy model's true continuation, with the last one wrong, so that tests
        see both accepted and rejected drafts."""
        context = list(request.all_token_ids)
        drafts = []
        for index in range(self.num_spec_tokens):
            token = next_token(context, self.vocab_size)
            if index == self.num_spec_tokens - 1 and index > 0:
                token = (token + 1) % self.vocab_size
            drafts.append(token)
            context.append(token)
        return drafts

    def preempt(self, request: Request) -> None:
        """Free a running request's blocks; it recomputes (and re-hits) later. Mutates."""
        self.manager.cache_computed_blocks(request)
        self.manager.free(request)
        request.preempt()

    def abort(self, request: Request) -> None:
        self.manager.free(request)
        request.status = RequestStatus.FINISHED_ABORTED

    def run_to_completion(self, request: Request, num_accept: int = 1) -> None:
        while not request.is_finished:
            if not self.step(request, num_accept).scheduled:
                raise RuntimeError("out of KV cache blocks")
