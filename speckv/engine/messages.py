"""The typed messages between the engine's parts; no part hands another a live object.

Owns the shapes of one step's traffic:

    Scheduler ──SchedulerOutput──► runner (ModelRunner, or speckv.simulation.ToyRunner)
        ▲                              │ keeps its own per-request state: token ids, block
        │                              │ table (from the deltas below), sampling seed
        └───────ModelRunnerOutput──────┘ sampled tokens (verified, cut at a stop) + next drafts
    Scheduler.update_from_output ──EngineCoreOutput──► OutputProcessor ──► RequestOutput
        ▲ stop strings: tokens kept per request (`StopStringCuts`), found by the output
          processor in the runner's sampled tokens before the update (data, no call back)

Block ids travel as deltas: a request's first schedule (or its resume after a preemption)
carries its whole block table; later steps carry only the blocks allocated in that step.

    positions of one scheduled request in a step:
        [ computed before | start ............ end )
                            real tokens | drafts      (num_new_tokens in all)
    on first schedule, "computed before" = local hit | external tokens (loaded by the KV
    connector in this step's worker phase, before the forward)

A prefix-cache hit that reuses a block at a divergence point (the request's block after the
hit is cached under another successor) comes with a `BlockCopy`: the runner copies the source
block's KV (target and draft, every layer) into the request's own block before the forward,
which then recomputes the block's last L positions.

With a KV connector, the SchedulerOutput carries the connector's step metadata (which tier
blocks to load into which device blocks, which device blocks to save); the runner starts it
before its forward and hands back the connector's `ConnectorOutput`, whose load failures the
scheduler applies (the request recomputes from the first failed token).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from speckv.cache.results import BlockCopy
from speckv.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from speckv.connectors.metadata import ConnectorOutput, StepMetadata


class FinishReason(StrEnum):
    """Why a request left the engine (the string is what users see, OpenAI-style)."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"  # the caller aborted it
    ERROR = "error"  # the engine could not serve it (`error` says why)


@dataclass(frozen=True)
class StopLimits:
    """What ends a request, token-wise."""

    stop_token_ids: frozenset[int]  # EOS (unless ignore_eos) and the request's stop_token_ids
    max_tokens: int  # output tokens, at most
    max_model_len: int  # prompt + output tokens, at most


@dataclass(frozen=True)
class NewRequestData:
    """A request the runner has not seen: everything it keeps for the request's life."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    sampling_seed: int | None  # seeds each position's generator (None: greedy)
    stop_limits: StopLimits


@dataclass(frozen=True, kw_only=True)
class ScheduledRequest:
    """One request computed in this step, in batch order (built by keyword only)."""

    request_id: str
    start: int  # first position computed this step (after any prefix-cache hit)
    num_new_tokens: int  # positions computed this step, drafts included
    draft_token_ids: tuple[int, ...]  # drafts verified this step (the last positions)
    # Block ids per KV cache group added to the request's table this step; with
    # `replaces_block_table` (first schedule or resume) they are the whole table, hit included.
    new_block_ids: tuple[list[int], ...]
    replaces_block_table: bool
    num_hit_tokens: int  # prefix-cache hit taken this step, tokens (0 unless from waiting)
    # True when this step reaches the request's last real token, so its logits sample
    samples: bool
    # tokens after the hit that the KV connector loads before this step's forward (first
    # schedule only): positions [num_hit_tokens, start)
    num_external_tokens: int = 0

    @property
    def end(self) -> int:
        """One past the last position computed this step."""
        return self.start + self.num_new_tokens

    @property
    def num_drafts(self) -> int:
        return len(self.draft_token_ids)


@dataclass(frozen=True)
class SchedulerOutput:
    new_requests: list[NewRequestData]  # first scheduled this step (state to keep)
    scheduled: list[ScheduledRequest]  # every request computed this step, in batch order
    # left the engine since the previous step: the runner drops their state
    finished_request_ids: frozenset[str]
    preempted_request_ids: frozenset[str]  # preempted this step (they come back resumed)
    num_scheduled_tokens: int  # positions computed this step, all requests
    # the KV connector's work for this step (None: no connector); the runner must start it
    # even when nothing is scheduled (it snapshots the saves of requests that left)
    kv_connector_metadata: StepMetadata | None = None
    # block copies to carry out before the forward (divergent block reuse), all requests
    block_copies: tuple[BlockCopy, ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True)
class ModelRunnerOutput:
    """What one step produced, per request id."""

    # requests whose step sampled: accepted drafts + one bonus token, cut after the first
    # token that stops the request (EOS / stop token, max_tokens, max_model_len)
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)  # for the next step
    # the KV connector's report of this step (None: no connector): finished loads and saves,
    # load failures (each request named there was cut from the batch: nothing was computed
    # or sampled for it; it recomputes from its failure's first_failed_token)
    kv_connector_output: ConnectorOutput | None = None
    # why a request's sampled tokens end it (decided here, once: the scheduler only applies
    # it); requests that go on are absent
    finish_reasons: dict[str, FinishReason] = field(default_factory=dict)
    # drafts accepted by this step's verification per request that verified drafts, counted
    # once here before any stop cut (the adaptive policy reads the same count; the scheduler
    # reports what the cut kept)
    num_accepted_drafts: dict[str, int] = field(default_factory=dict)


EMPTY_RUNNER_OUTPUT = ModelRunnerOutput()


@dataclass(frozen=True, kw_only=True)
class EngineCoreOutput:
    """One request's progress in one step, as the scheduler saw it (no text; built by
    keyword only)."""

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None  # None while running
    num_cached_tokens: int  # prompt tokens served by the prefix cache on first schedule
    num_draft_tokens: int = 0  # drafts verified this step
    num_accepted_tokens: int = 0  # of them accepted
    num_preemptions: int = 0  # so far
    error: str | None = None  # with FinishReason.ERROR
    # of num_cached_tokens, those a KV connector loaded from a tier (the rest: local hit)
    num_external_cached_tokens: int = 0
    # with a finish: what the KV connector's `request_finished` returned for the caller
    kv_transfer_params: dict[str, Any] | None = None
