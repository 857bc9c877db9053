"""Verifying one step's drafts and sampling its tokens, on the runner's logits and row arrays.

Owns `RunnerSampler` (what `ModelRunner.execute_model` calls after the forward) and its result
`Sampled`: per sampling request the verified tokens (accepted drafts + bonus, greedy or
rejection sampling), cut at the first stop and appended to the runner's token ids; why the
stopped ones stop; drafts accepted. It keeps the runner's per-row real-token counts
(`RequestRows.num_tokens`) in step and reports acceptance to the adaptive speculation policy.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from speckv.engine.messages import FinishReason, ScheduledRequest
from speckv.engine.request_rows import RequestRows
from speckv.engine.runner_batch import RunnerRequest, StepForward
from speckv.engine.sampler import accepted_greedy, greedy_tokens, verify_greedy, verify_random
from speckv.engine.stopping import first_stop, may_stop
from speckv.speculation.adaptive import AdaptiveSpeculation

# The one small-batch special case of the step's hot path: up to this many scheduled requests,
# sampling goes request by request (`_sample_each`). Measured per step, greedy decode, vocab
# 49,152, one thread, this 2-core AMD EPYC (request by request / arrays): 1 request 98 / 242 us,
# 4: 263-281 / 310-318, 8: 449-819 / 324-332, 32: 1,679 / 509. (It was 32.)
_SMALL_BATCH = 4


@dataclass(frozen=True)
class Sampled:
    """One step's verified tokens (what `ModelRunnerOutput` carries), and the same as arrays
    by batch index ([num_reqs]) for the proposer's batch."""

    by_id: dict[str, list[int]]  # per sampling request: accepted drafts + bonus, cut at a stop
    reasons: dict[str, FinishReason]  # the requests those tokens end
    accepted: dict[str, int]  # drafts accepted per request that verified drafts
    # (arrays, or lists from a small batch's sampling)
    num_kept: np.ndarray | list[int]  # len(by_id[request]) (0 where it did not sample)
    stopped: np.ndarray | list[bool]  # named in `reasons`


class RunnerSampler:
    """The runner's sampling step. `rows`: the runner's persistent per-row arrays (shared, not
    copied); `spec_policy`: the adaptive draft length told each step's acceptance (None: no
    policy; the runner's `spec_policy` reads and sets this one)."""

    def __init__(self, rows: RequestRows, spec_policy: AdaptiveSpeculation | None) -> None:
        self._rows = rows
        self.spec_policy = spec_policy

    def sample(self, scheduled: list[ScheduledRequest], forward: StepForward) -> Sampled:
        """Verified tokens per sampling request, cut at the first stop and appended to the
        runner's token ids; why the stopped ones stop; drafts accepted per request that
        verified drafts (before the cut: what verification accepted). In a large batch the
        greedy requests are verified at once (`accepted_greedy`) and only seeded ones and
        those a stop may end (`may_stop`) go one by one; a small batch goes one by one
        (`verify_greedy`): there array ops' fixed cost would dominate."""
        if len(scheduled) <= _SMALL_BATCH:
            return self._sample_each(scheduled, forward)
        logits = forward.logits  # [num_sample_rows, vocab]
        states, rows, samples = forward.states, forward.rows, forward.samples
        request_ids = forward.request_ids
        n = len(scheduled)
        stopped = np.zeros(n, dtype=bool)
        reasons: dict[str, FinishReason] = {}
        request_rows = self._rows
        seeded = request_rows.seeded[rows] & samples
        first_rows, num_drafts = forward.first_logit_rows, forward.num_drafts
        num_tokens = request_rows.num_tokens[rows]  # real tokens before the step
        sampling = np.flatnonzero(samples)
        argmax: list[int] = []
        if bool((samples & ~seeded).any()):
            argmax_rows = greedy_tokens(logits)  # [num_sample_rows] int64
            num_accepted = accepted_greedy(argmax_rows, first_rows, num_drafts,
                                           forward.draft_ids)
            careful = seeded | may_stop(argmax_rows, first_rows, num_accepted + 1,
                                        num_tokens, request_rows.stop_len[rows],
                                        request_rows.stop_token_ids)
            argmax = argmax_rows.tolist()
        else:
            num_accepted = np.zeros(n, dtype=np.int64)
            careful = samples
        # every sampling request's greedy tokens, in batch order (C-level slicing)
        num_kept = np.where(samples, num_accepted + 1, 0)
        firsts = first_rows[sampling]
        ends = firsts + num_kept[sampling]
        sampled_lists = list(map(argmax.__getitem__, map(slice, firsts.tolist(), ends.tolist())))
        # then one by one: seeded requests' rejection sampling, and the stop rules
        careful_rows = np.flatnonzero(careful & samples)
        if careful_rows.shape[0]:
            positions = np.searchsorted(sampling, careful_rows).tolist()
            for index, position in zip(careful_rows.tolist(), positions):
                sampled, num_accepted[index], reason = self._verify_one(
                    scheduled[index], states[index], logits, int(first_rows[index]),
                    forward.num_logit_rows_host[index], sampled_lists[position])
                if reason is not None:
                    reasons[request_ids[index]] = reason
                    stopped[index] = True
                num_kept[index] = len(sampled)
                sampled_lists[position] = sampled
        token_lists, sampling_ids = forward.token_ids, request_ids
        if sampling.shape[0] != n:
            sampling_list = sampling.tolist()
            token_lists = [token_lists[i] for i in sampling_list]
            sampling_ids = [request_ids[i] for i in sampling_list]
        for token_ids, sampled in zip(token_lists, sampled_lists):
            token_ids.extend(sampled)
        request_rows.num_tokens[rows] = num_tokens + num_kept
        verifying = np.flatnonzero(num_drafts)  # sampling requests that verified drafts
        accepted: dict[str, int] = {}
        if verifying.shape[0]:
            verified_accepted = num_accepted[verifying].tolist()
            accepted = dict(zip([request_ids[i] for i in verifying.tolist()], verified_accepted))
            if self.spec_policy is not None:
                self.spec_policy.observe_acceptance_counts(num_drafts[verifying],
                                                           num_accepted[verifying])
        return Sampled(dict(zip(sampling_ids, sampled_lists)), reasons, accepted, num_kept,
                        stopped)

    def _sample_each(self, scheduled: list[ScheduledRequest], forward: StepForward) -> Sampled:
        """`_sample` request by request (a small batch), on the forward's host lists."""
        logits = forward.logits  # [num_sample_rows, vocab]
        states = forward.states
        argmax: list[int] = []
        if any(sampling and state.data.sampling_seed is None
               for sampling, state in zip(forward.samples_host, states)):
            argmax = logits.argmax(-1).tolist()  # (torch's: cheaper than numpy's for a few rows)
        n = len(scheduled)
        num_kept = [0] * n
        stopped = [False] * n
        sampled_by_id: dict[str, list[int]] = {}
        reasons: dict[str, FinishReason] = {}
        accepted: dict[str, int] = {}
        verified: list[int] = []  # drafts verified, per request that had drafts
        verified_accepted: list[int] = []  # of them accepted
        for index, (item, state, sampling, lo, num_rows) in enumerate(zip(
                scheduled, states, forward.samples_host, forward.first_logit_rows_host,
                forward.num_logit_rows_host)):
            if not sampling:
                continue
            drafts = item.draft_token_ids
            greedy = (verify_greedy(argmax[lo : lo + num_rows], drafts) if drafts
                      else [argmax[lo]]) if state.data.sampling_seed is None else []
            sampled, num_accepted, reason = self._verify_one(item, state, logits, lo,
                                                             num_rows, greedy)
            request_id = item.request_id
            if drafts:
                accepted[request_id] = num_accepted
                verified.append(len(drafts))
                verified_accepted.append(num_accepted)
            if reason is not None:
                reasons[request_id] = reason
                stopped[index] = True
            state.token_ids.extend(sampled)
            sampled_by_id[request_id] = sampled
            num_kept[index] = len(sampled)
        row_num_tokens = self._rows.num_tokens  # (element by element: a few requests)
        for state, sampling, token_ids in zip(states, forward.samples_host, forward.token_ids):
            if sampling:
                row_num_tokens[state.row] = len(token_ids)
        if self.spec_policy is not None and verified:
            self.spec_policy.observe_acceptance(verified, verified_accepted)
        return Sampled(sampled_by_id, reasons, accepted, num_kept, stopped)

    @staticmethod
    def _verify_one(item: ScheduledRequest, state: RunnerRequest, logits: torch.Tensor,
                    first_row: int, num_rows: int, greedy: list[int]
                    ) -> tuple[list[int], int, FinishReason | None]:
        """One request's verification, before its tokens are appended: `greedy` (its greedy
        tokens, accepted drafts + bonus) or, with a seed, rejection sampling of its logit
        rows (`num_rows` of the step's `logits` from `first_row`: 1 + drafts); then cut at
        its first stop. (tokens kept, drafts
        accepted before the cut, the reason the tokens end it or None)"""
        data = state.data
        num_real = len(state.token_ids)
        sampled = greedy
        if data.sampling_seed is not None:
            sampled = verify_random(logits[first_row : first_row + num_rows],
                                    item.draft_token_ids, data.sampling_params,
                                    data.sampling_seed, num_real)
        num_accepted = len(sampled) - 1
        num_stop, reason = first_stop(sampled, num_real, len(data.prompt_token_ids),
                                      data.stop_limits)
        if reason is not None:
            sampled = sampled[:num_stop]
        return sampled, num_accepted, reason
