"""ModelRunner: turns one SchedulerOutput into one forward, sampled tokens and next drafts.

Owns the model, its `PagedKVCache`, the proposer (with the drafter's own KV cache) and, per
request, what it needs across steps: real token ids (it appends what it samples), one block
table per KV cache group of the model's `KVCacheLayout` (kept from the scheduler's deltas; the
runner never reads the cache manager) and its sampling seed; the scalars the step's array ops
read (real tokens so far, where a length stop falls, seeded or greedy) also as persistent
arrays by row (`RequestRows`), beside the block tables'. Each forward gets one
`AttentionMetadata` per group (`GroupedAttentionMetadata`; each layer reads its group's); the
drafter's KV follows the block table of the layout's `draft_group` (full attention). One step:

    forward     every scheduled request's new tokens (real, then drafts) at positions
                [start, end), flattened on one token axis, no padding; logits only at the
                rows that sample (from the last real token: 1 bonus row + 1 row per draft)
    copy        the step's block copies (divergent block reuse), before anything reads them
    sample      verify drafts (greedy or rejection sampling), cut at the first stop token
                (`runner_sampling.py`; the per-request state and the forward's rows it reads:
                `runner_batch.py`)
    propose     the proposer writes draft KV for every position made final this step, then
                proposes the next drafts; before the scheduler frees anything

With a KV connector (`kv_connector.py`), the step's connector metadata is started before the
forward (saves snapshotted, tier blocks loaded into the target's and drafter's caches); a
request whose load failed is cut from the step (nothing computed or sampled), and the
connector's report goes back in the ModelRunnerOutput.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import torch

from speckv.attention import AttentionMetadata, GroupedAttentionMetadata, PagedKVCache
from speckv.cache.results import BlockCopy
from speckv.engine.block_table import BatchBlockTable
from speckv.engine.hybrid_state import RunnerStates, state_group
from speckv.engine.kv_connector import RunnerConnector
from speckv.engine.messages import (
    EMPTY_RUNNER_OUTPUT,
    FinishReason,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from speckv.engine.request_rows import RequestRows
from speckv.engine.runner_batch import RunnerRequest, StepForward
from speckv.engine.runner_sampling import RunnerSampler, Sampled
from speckv.engine.step_threads import StepThreads, ThreadChooser
from speckv.models.base import TargetModel
from speckv.models.common.kv_layout import KVCacheLayout
from speckv.speculation.adaptive import AdaptiveSpeculation, StepCost
from speckv.speculation.proposer import Proposer, ProposerBatch, TargetRows


class ModelRunner:
    """One step's forward, sampling and drafting over the runner's own per-request state."""

    def __init__(
        self,
        model: TargetModel,
        num_blocks: int | Sequence[int],
        block_size: int,
        proposer: Proposer | None = None,
        connector: RunnerConnector | None = None,
        layout: KVCacheLayout | None = None,
        spec_policy: AdaptiveSpeculation | None = None,
        step_threads: StepThreads | None = None,
    ) -> None:
        """`layout`: the model's KV cache groups (default `model.kv_cache_layout`).
        `step_threads`: CPU compute threads by step size (None: torch's setting throughout).
        `num_blocks`: rows of every group's tensors (one shared pool), or one count per group
        (per-group pools: each group's block ids index its own rows)."""
        self.model = model
        self.connector = connector
        self.block_size = block_size
        self.layout = layout if layout is not None else model.kv_cache_layout(block_size)
        self.group_block_sizes = tuple(spec.block_size for spec in self.layout.specs)
        self.layer_to_group = self.layout.layer_to_group
        draft_group = self.layout.draft_group
        if proposer is not None and proposer.kv_cache is not None and draft_group is None:
            raise ValueError("a drafter's KV needs a full-attention KV cache group; this model "
                             f"has none ({self.layout.describe()})")
        self.draft_group = draft_group if draft_group is not None else 0
        # one tensor for all layers, or one per group when their block sizes differ
        self.kv_cache: PagedKVCache = model.make_layout_kv_cache(self.layout, num_blocks)
        self.device = model.device
        # GDN / Mamba state per block id of the model's state group (hybrid models only)
        self.states: RunnerStates | None = (
            RunnerStates(model, num_blocks if isinstance(num_blocks, int)
                         else num_blocks[state_group(self.layout)], self.layout)
            if state_group(self.layout) is not None else None)
        self.proposer = proposer
        self._threads = ThreadChooser(step_threads) if step_threads is not None else None
        if proposer is not None:  # a drafter may read the target's KV (Gemma 4 assistant)
            proposer.bind_target_kv(self.kv_cache, self.layout)
        self.num_spec_tokens = proposer.num_spec_tokens if proposer is not None else 0
        self.aux_layers: tuple[int, ...] = tuple(proposer.aux_layers) if proposer else ()
        self.requests: dict[str, RunnerRequest] = {}
        # the same block tables as one persistent array per group (rows kept in lockstep)
        self._tables = [BatchBlockTable() for _ in self.group_block_sizes]
        self._rows = RequestRows()  # per-row scalars, the same row numbers
        # the draft length per step (speckv/speculation/adaptive.py); None: always num_spec_tokens
        self.sampler = RunnerSampler(self._rows, spec_policy)

    @property
    def spec_policy(self) -> AdaptiveSpeculation | None:
        """The adaptive draft length (the sampler's, which it tells each step's acceptance)."""
        return self.sampler.spec_policy

    @spec_policy.setter
    def spec_policy(self, policy: AdaptiveSpeculation | None) -> None:
        self.sampler.spec_policy = policy

    def block_table(self, request_id: str, group: int = 0) -> list[int]:
        """The runner's block table of a request it holds, for one KV cache group."""
        return self.requests[request_id].block_ids[group]

    def block_tables(self, request_id: str) -> tuple[list[int], ...]:
        """The runner's block tables of a request it holds, one per KV cache group."""
        return tuple(self.requests[request_id].block_ids)

    # ---- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(scheduler_output)
        if scheduler_output.block_copies:
            self._copy_blocks(scheduler_output.block_copies)
        scheduled = scheduler_output.scheduled
        if self.connector is not None:
            cut = self.connector.start_step(
                scheduler_output.kv_connector_metadata, scheduled,
                {item.request_id: self.requests[item.request_id].block_ids[0]
                 for item in scheduled})
            if cut:
                scheduled = [item for item in scheduled if item.request_id not in cut]
        elif scheduler_output.is_empty:
            return EMPTY_RUNNER_OUTPUT
        sampled: dict[str, list[int]] = {}
        drafts: dict[str, list[int]] = {}
        reasons: dict[str, FinishReason] = {}
        accepted: dict[str, int] = {}
        if scheduled:
            if self._threads is not None:
                self._threads.begin(sum(item.num_new_tokens for item in scheduled))
            clock = self.spec_policy.clock if self.spec_policy is not None else time.perf_counter
            start = clock()
            forward = self._forward(scheduled)
            verified = self.sampler.sample(scheduled, forward)
            sampled, reasons, accepted = verified.by_id, verified.reasons, verified.accepted
            if self.states is not None and forward.state_plan is not None:
                # rejected drafts must not advance the recurrent state
                self.states.commit(forward.state_plan, scheduled, self._state_tables(scheduled),
                                   sampled)
            target_s = clock() - start
            drafts = self._propose(scheduled, forward, verified, target_s)
            if self._threads is not None:
                self._threads.end()
        if self.connector is None:
            return ModelRunnerOutput(sampled, drafts, None, reasons, accepted)
        return ModelRunnerOutput(sampled, drafts, self.connector.finish_step(), reasons,
                                 accepted)

    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        tables = self._tables
        for request_id in scheduler_output.finished_request_ids:
            state = self.requests.pop(request_id, None)
            if state is not None:
                for batch_table in tables:
                    batch_table.free_row(state.row)
                self._rows.free(state.data.stop_limits)
            if self.proposer is not None:
                self.proposer.free(request_id)
        for data in scheduler_output.new_requests:
            rows = {batch_table.add_row() for batch_table in tables}
            assert len(rows) == 1, "the groups' block tables hold their rows in lockstep"
            row = rows.pop()
            num_prompt = len(data.prompt_token_ids)
            self._rows.add(row, num_prompt, num_prompt, data.stop_limits,
                           data.sampling_seed is not None)
            self.requests[data.request_id] = RunnerRequest(
                data, list(data.prompt_token_ids), [[] for _ in self.group_block_sizes], row)
        num_groups = len(self.group_block_sizes)
        requests = self.requests
        for item in scheduler_output.scheduled:
            new_block_ids = item.new_block_ids
            if len(new_block_ids) != num_groups:
                raise ValueError(f"the scheduler sent {len(new_block_ids)} block-id "
                                 f"groups; the model has {num_groups}")
            if not item.replaces_block_table and not any(new_block_ids):
                continue  # most decode steps: no block added
            state = requests[item.request_id]
            for table, new, batch_table in zip(state.block_ids, new_block_ids, tables):
                if item.replaces_block_table:
                    table[:] = new
                    batch_table.replace(state.row, new)
                elif new:
                    table.extend(new)
                    batch_table.extend(state.row, new)

    def _copy_blocks(self, copies: tuple[BlockCopy, ...]) -> None:
        """Each copy's source block into its destination in every KV tensor, the target's and
        the drafter's: one batched copy per tensor (copies come only for attention groups)."""
        device = self.device
        src = torch.tensor([copy.src_block_id for copy in copies], dtype=torch.int64,
                           device=device)
        dst = torch.tensor([copy.dst_block_id for copy in copies], dtype=torch.int64,
                           device=device)
        self.kv_cache.copy_blocks(src, dst)
        draft_cache = self.proposer.kv_cache if self.proposer is not None else None
        if draft_cache is not None:
            draft_cache.copy_blocks(src, dst)

    def _forward(self, scheduled: list[ScheduledRequest]) -> StepForward:
        input_ids: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []  # token-axis row of each logit row
        first_logit_rows: list[int] = []
        num_logit_rows: list[int] = []
        num_drafts: list[int] = []
        samples: list[bool] = []
        token_offsets: list[int] = []
        num_tokens = 0
        request_ids = [item.request_id for item in scheduled]
        requests = self.requests
        states = [requests[request_id] for request_id in request_ids]
        token_lists = [state.token_ids for state in states]
        for item, token_ids in zip(scheduled, token_lists):
            start, num_new = item.start, item.num_new_tokens
            end = start + num_new
            num_real = len(token_ids)
            drafts = item.draft_token_ids
            if end <= num_real:
                input_ids.extend(token_ids[start:end])
            else:  # the last real token(s), then drafts
                num_input_drafts = end - max(start, num_real)
                if num_input_drafts != len(drafts):
                    drafts = drafts[:num_input_drafts]
                    assert len(drafts) == num_input_drafts, "scheduled tokens do not exist"
                assert start <= num_real, "scheduled tokens do not exist"
                input_ids.extend(token_ids[start:])
                input_ids.extend(drafts)
            if item.samples:
                # its logits: from its last real token (1 bonus row + 1 per draft)
                first = num_tokens + (num_real - 1 - start)
                first_logit_rows.append(len(sample_rows))
                num_logit_rows.append(end - num_real + 1)
                sample_rows.extend(range(first, num_tokens + num_new))
                num_drafts.append(len(item.draft_token_ids))
            else:
                first_logit_rows.append(0)
                num_logit_rows.append(0)
                num_drafts.append(0)
            samples.append(item.samples)
            token_offsets.append(num_tokens)
            query_lens.append(num_new)
            seq_lens.append(end)
            num_tokens += num_new
        rows_array = np.fromiter((state.row for state in states), np.int64, len(states))
        groups = []
        gathered = []
        for batch_table, block_size in zip(self._tables, self.group_block_sizes):
            table, lens = batch_table.gather(rows_array)
            gathered.append((table, lens))
            groups.append(AttentionMetadata.from_block_table(
                query_lens, seq_lens, table, block_size, self.device, lens))
        metadata = (groups[0] if len(groups) == 1
                    else GroupedAttentionMetadata(tuple(groups), self.layer_to_group))
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)  # [num_tokens]
        state_plan = None
        if self.states is None:
            output = self.model(ids, metadata.positions(), self.kv_cache, metadata,
                                self.aux_layers)
        else:
            state_plan = self.states.plan(scheduled, self._state_tables(scheduled))
            output = self.model(ids, metadata.positions(), self.kv_cache, metadata,
                                self.aux_layers, state=state_plan)
        hidden = output.hidden_states
        if len(sample_rows) != num_tokens:  # (else every row samples, in order: no gather)
            hidden = hidden.index_select(0, torch.tensor(sample_rows, dtype=torch.int64,
                                                         device=self.device))
        logits = self.model.compute_logits(hidden)
        draft_table, draft_lens = gathered[self.draft_group]
        return StepForward(
            output, scheduled, token_offsets, logits, groups[self.draft_group].slot_mapping,
            request_ids, states, token_lists, rows_array, samples, first_logit_rows,
            num_logit_rows, num_drafts, draft_table, draft_lens, query_lens, seq_lens,
            state_plan)

    def _state_tables(self, scheduled: list[ScheduledRequest]) -> list[list[int]]:
        """The state group's block table of each scheduled request (hybrid models)."""
        assert self.states is not None
        return [self.requests[item.request_id].block_ids[self.states.group]
                for item in scheduled]

    def _propose(self, scheduled: list[ScheduledRequest], forward: StepForward,
                 verified: Sampled, target_s: float) -> dict[str, list[int]]:
        if self.proposer is None:
            return {}
        output = forward.output
        sampling = forward.samples
        wants = sampling & ~np.asarray(verified.stopped, dtype=bool)
        num_decode = int(wants.sum())
        num_spec = self.num_spec_tokens
        num_target_tokens = sum(forward.query_lens_host)
        if self.spec_policy is not None:
            # this step's target cost first: the decision weighs the forward it follows
            self.spec_policy.observe_target(num_target_tokens, target_s)
            num_spec = self.spec_policy.decide(num_decode)
        target_rows = TargetRows(output.hidden_states, output.prenorm_hidden,
                                 tuple(output.aux_hidden_states), forward.slot_mapping)
        request_ids = forward.request_ids
        states = forward.states
        rows = forward.rows
        num_tokens = self._rows.num_tokens[rows]
        ends = forward.seq_lens  # start + num_new_tokens
        starts = ends - forward.query_lens
        # a sampling request's rejected drafts' KV is garbage: its final positions end
        # after the accepted drafts
        ends = ends - np.where(sampling, forward.num_drafts - (
            np.asarray(verified.num_kept, dtype=np.int64) - 1), 0)
        # drafts allowed next step, before the engine's draft length (the length limits)
        rooms = self._rows.stop_len[rows] - 1 - num_tokens
        inputs = ProposerBatch(
            request_ids, forward.token_ids, starts, ends,
            forward.token_offsets_array, wants, np.clip(rooms, 0, num_spec), target_rows,
            forward.draft_table, forward.draft_table_lens,
            [state.block_ids for state in states], self.draft_group)
        drafts = self.proposer.propose(inputs)
        if self.spec_policy is not None:
            timing = self.proposer.last_timing
            proposed = max((len(d) for d in drafts.values()), default=0)  # k actually drafted
            self.spec_policy.observe_drafter(StepCost(
                num_target_tokens, target_s, num_decode, proposed,
                timing.catch_up_s, timing.draft_s))
        wanted = np.flatnonzero(wants)
        out: dict[str, list[int]] = {}
        for request_id, limit in zip([request_ids[i] for i in wanted.tolist()],
                                     inputs.max_drafts[wanted].tolist()):
            proposed_ids = drafts.get(request_id)
            if proposed_ids:
                out[request_id] = list(map(int, proposed_ids[:limit]))
        return out
