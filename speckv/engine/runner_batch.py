"""The runner's per-request state and one forward's rows: what the runner's step phases share.

Owns `RunnerRequest` (the runner's copy of a request across steps) and `StepForward` (one
forward's output, logits and rows by batch index, as host lists and as arrays built on first
read), read by the sampling (`runner_sampling.py`) and the proposer batch (`model_runner.py`).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from speckv.attention.state_cache import StatePlan
from speckv.engine.messages import NewRequestData, ScheduledRequest
from speckv.models.common.decoder import ModelOutput


@dataclass
class RunnerRequest:
    """The runner's copy of one request (kept until the scheduler says it finished)."""

    data: NewRequestData
    token_ids: list[int]  # real tokens: prompt + sampled
    block_ids: list[list[int]]  # one block table per KV cache group
    row: int = 0  # its row in the runner's persistent arrays (`BatchBlockTable`, `RequestRows`)


@dataclass(frozen=True)
class StepForward:
    """One forward's rows, by batch index of `SchedulerOutput.scheduled` ([num_reqs] each):
    host lists, and the same as arrays built on first read (a small batch's sampling reads
    the lists only; array ops' fixed cost would dominate there)."""

    output: ModelOutput  # hidden states, each [num_tokens, hidden]
    scheduled: list[ScheduledRequest]
    token_offsets: list[int]  # batch index -> first row of that request on the token axis
    logits: torch.Tensor  # [num_sample_rows, vocab] fp32
    # [num_tokens] int64 physical slot of every computed token in the drafter's group
    slot_mapping: torch.Tensor
    request_ids: list[str]
    states: list[RunnerRequest]  # the runner's copy of each scheduled request
    token_ids: list[list[int]]  # their real token lists (`RunnerRequest.token_ids`)
    rows: np.ndarray  # int64, their rows in the runner's persistent arrays
    samples_host: list[bool]  # the request's logits sample this step
    # of a sampling request: its first row in `logits` and its rows (1 + drafts verified);
    # 0 for the others
    first_logit_rows_host: list[int]
    num_logit_rows_host: list[int]
    num_drafts_host: list[int]  # drafts verified (0 unless it samples)
    # the drafter's group's block tables of the batch: [num_reqs, width] int32 0-padded, and
    # blocks per request [num_reqs] (what the proposer's forwards address its KV with)
    draft_table: np.ndarray
    draft_table_lens: np.ndarray
    # per request: positions computed this step, and one past the last of them
    query_lens_host: list[int]
    seq_lens_host: list[int]
    # linear-attention layers' plan (hybrid models only): recorded verification windows
    state_plan: StatePlan | None = None

    @cached_property
    def samples(self) -> np.ndarray:  # bool
        return np.asarray(self.samples_host, dtype=bool)

    @cached_property
    def first_logit_rows(self) -> np.ndarray:  # int64
        return np.asarray(self.first_logit_rows_host, dtype=np.int64)

    @cached_property
    def num_drafts(self) -> np.ndarray:  # int64
        return np.asarray(self.num_drafts_host, dtype=np.int64)

    @cached_property
    def query_lens(self) -> np.ndarray:  # int64
        return np.asarray(self.query_lens_host, dtype=np.int64)

    @cached_property
    def seq_lens(self) -> np.ndarray:  # int64
        return np.asarray(self.seq_lens_host, dtype=np.int64)

    @cached_property
    def token_offsets_array(self) -> np.ndarray:  # int64
        return np.asarray(self.token_offsets, dtype=np.int64)

    @cached_property
    def draft_ids(self) -> np.ndarray:
        """[sum(num_drafts)] int64: the drafts verified, requests in batch order."""
        return np.fromiter(
            itertools.chain.from_iterable(
                item.draft_token_ids for item, sampling in zip(self.scheduled, self.samples_host)
                if sampling),
            np.int64, sum(self.num_drafts_host))
