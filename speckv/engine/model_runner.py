"""ModelRunner: turns one SchedulerOutput into one forward, sampled tokens and next drafts.

Owns the model, its `PagedKVCache`, the proposer (with the drafter's own KV cache) and, per
request, what it needs across steps: real token ids (it appends what it samples), one block
table per KV cache group of the model's `KVCacheLayout` (kept from the scheduler's deltas; the
runner never reads the cache manager) and its sampling seed. Each forward gets one
`AttentionMetadata` per group (`GroupedAttentionMetadata`; each layer reads its group's); the
drafter's KV follows the block table of the layout's `draft_group` (full attention). One step:

    forward     every scheduled request's new tokens (real, then drafts) at positions
                [start, end), flattened on one token axis, no padding; logits only at the
                rows that sample (from the last real token: 1 bonus row + 1 row per draft)
    copy        the step's block copies (divergent block reuse), before anything reads them
    sample      verify drafts (greedy or rejection sampling), cut at the first stop token
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
from dataclasses import dataclass

import numpy as np
import torch

from speckv.attention import AttentionMetadata, GroupedAttentionMetadata, PagedKVCache
from speckv.attention.state_cache import StatePlan
from speckv.cache.results import BlockCopy
from speckv.engine.block_table import BatchBlockTable
from speckv.engine.hybrid_state import RunnerStates, state_group
from speckv.engine.kv_connector import RunnerConnector
from speckv.engine.messages import (
    EMPTY_RUNNER_OUTPUT,
    FinishReason,
    ModelRunnerOutput,
    NewRequestData,
    ScheduledRequest,
    SchedulerOutput,
)
from speckv.engine.sampler import verify_greedy, verify_random
from speckv.engine.stopping import first_stop
from speckv.models.base import TargetModel
from speckv.models.common.decoder import ModelOutput
from speckv.models.common.kv_layout import KVCacheLayout
from speckv.speculation.adaptive import AdaptiveSpeculation, StepCost
from speckv.speculation.proposer import Proposer, ProposerBatch, TargetRows


@dataclass
class _RunnerRequest:
    """The runner's copy of one request (kept until the scheduler says it finished)."""

    data: NewRequestData
    token_ids: list[int]  # real tokens: prompt + sampled
    block_ids: list[list[int]]  # one block table per KV cache group
    row: int = 0  # its row in the runner's persistent block tables (`BatchBlockTable`)
    # drafts allowed next step, before the engine's draft length: min(output_room - real
    # tokens, context_room - real tokens), from the request's stop limits
    output_room: int = 0
    context_room: int = 0


@dataclass(frozen=True)
class _Forward:
    """One forward's rows, by batch index of `SchedulerOutput.scheduled`."""

    output: ModelOutput  # hidden states, each [num_tokens, hidden]
    token_offsets: list[int]  # batch index -> first row of that request on the token axis
    logits: torch.Tensor  # [num_sample_rows, vocab] fp32
    logit_offsets: dict[int, tuple[int, int]]  # batch index -> [start, end) rows in `logits`
    # [num_tokens] int64 physical slot of every computed token in the drafter's group
    slot_mapping: torch.Tensor
    # linear-attention layers' plan (hybrid models only): recorded verification windows
    state_plan: StatePlan | None = None
    # the drafter's group's block tables of the batch: [num_reqs, width] int32 0-padded, and
    # blocks per request [num_reqs] (what the proposer's forwards address its KV with)
    draft_table: np.ndarray | None = None
    draft_table_lens: np.ndarray | None = None
    # per request: positions computed this step, and one past the last of them
    query_lens: list[int] | None = None
    seq_lens: list[int] | None = None


class ModelRunner:
    def __init__(
        self,
        model: TargetModel,
        num_blocks: int | Sequence[int],
        block_size: int,
        proposer: Proposer | None = None,
        connector: RunnerConnector | None = None,
        layout: KVCacheLayout | None = None,
        spec_policy: AdaptiveSpeculation | None = None,
    ) -> None:
        """`layout`: the model's KV cache groups (default `model.kv_cache_layout`).
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
        if proposer is not None:  # a drafter may read the target's KV (Gemma 4 assistant)
            proposer.bind_target_kv(self.kv_cache, self.layout)
        self.num_spec_tokens = proposer.num_spec_tokens if proposer is not None else 0
        self.aux_layers: tuple[int, ...] = tuple(proposer.aux_layers) if proposer else ()
        self.requests: dict[str, _RunnerRequest] = {}
        # the same block tables as one persistent array per group (rows kept in lockstep)
        self._tables = [BatchBlockTable() for _ in self.group_block_sizes]
        # the draft length per step (speckv/speculation/adaptive.py); None: always num_spec_tokens
        self.spec_policy = spec_policy

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
            clock = self.spec_policy.clock if self.spec_policy is not None else time.perf_counter
            start = clock()
            forward = self._forward(scheduled)
            sampled, reasons, accepted = self._sample(scheduled, forward)
            if self.states is not None and forward.state_plan is not None:
                # rejected drafts must not advance the recurrent state
                self.states.commit(forward.state_plan, scheduled, self._state_tables(scheduled),
                                   sampled)
            target_s = clock() - start
            drafts = self._propose(scheduled, forward, sampled, reasons, target_s)
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
            if self.proposer is not None:
                self.proposer.free(request_id)
        for data in scheduler_output.new_requests:
            rows = {batch_table.add_row() for batch_table in tables}
            assert len(rows) == 1, "the groups' block tables hold their rows in lockstep"
            limits = data.stop_limits
            self.requests[data.request_id] = _RunnerRequest(
                data, list(data.prompt_token_ids), [[] for _ in self.group_block_sizes],
                rows.pop(), limits.max_tokens + len(data.prompt_token_ids) - 1,
                limits.max_model_len - 1,
            )
        num_groups = len(self.group_block_sizes)
        for item in scheduler_output.scheduled:
            state = self.requests[item.request_id]
            if len(item.new_block_ids) != num_groups:
                raise ValueError(f"the scheduler sent {len(item.new_block_ids)} block-id "
                                 f"groups; the model has {num_groups}")
            for table, new, batch_table in zip(state.block_ids, item.new_block_ids, tables):
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

    def _forward(self, scheduled: list[ScheduledRequest]) -> _Forward:
        input_ids: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        token_offsets: list[int] = []
        sample_rows: list[int] = []
        logit_offsets: dict[int, tuple[int, int]] = {}
        batch_rows: list[int] = []
        requests = self.requests
        num_tokens = 0
        for index, item in enumerate(scheduled):
            state = requests[item.request_id]
            batch_rows.append(state.row)
            token_offsets.append(num_tokens)
            start, num_new = item.start, item.num_new_tokens
            end = start + num_new
            token_ids = state.token_ids
            num_real = len(token_ids)
            if end <= num_real:
                input_ids.extend(token_ids[start:end])
            else:  # the last real token(s), then drafts
                num_drafts = end - max(start, num_real)
                drafts = item.draft_token_ids[:num_drafts]
                assert len(drafts) == num_drafts and start <= num_real, \
                    "scheduled tokens do not exist"
                input_ids.extend(token_ids[start:])
                input_ids.extend(drafts)
            if item.samples:
                first = num_tokens + (num_real - 1 - start)
                last = num_tokens + num_new
                num_rows = len(sample_rows)
                logit_offsets[index] = (num_rows, num_rows + last - first)
                sample_rows.extend(range(first, last))
            query_lens.append(num_new)
            seq_lens.append(end)
            num_tokens += num_new
        rows_array = np.asarray(batch_rows, dtype=np.int64)
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
        return _Forward(output, token_offsets, logits, logit_offsets,
                        groups[self.draft_group].slot_mapping, state_plan, draft_table,
                        draft_lens, query_lens, seq_lens)

    def _state_tables(self, scheduled: list[ScheduledRequest]) -> list[list[int]]:
        """The state group's block table of each scheduled request (hybrid models)."""
        assert self.states is not None
        return [self.requests[item.request_id].block_ids[self.states.group]
                for item in scheduled]

    def _sample(self, scheduled: list[ScheduledRequest], forward: _Forward
                ) -> tuple[dict[str, list[int]], dict[str, FinishReason], dict[str, int]]:
        """Verified tokens per sampling request, cut at the first stop and appended to the
        runner's token ids; why the stopped ones stop; drafts accepted per request that
        verified drafts (before the cut: what verification accepted)."""
        logits = forward.logits  # [num_sample_rows, vocab]
        requests = self.requests
        states = [requests[item.request_id] for item in scheduled]
        argmax: list[int] = []
        for item, state in zip(scheduled, states):
            if item.samples and state.data.sampling_seed is None:
                argmax = logits.argmax(-1).tolist()
                break
        sampled_by_id: dict[str, list[int]] = {}
        reasons: dict[str, FinishReason] = {}
        accepted: dict[str, int] = {}
        verified: list[int] = []  # drafts verified, per request that had drafts
        verified_accepted: list[int] = []  # of them accepted
        logit_offsets = forward.logit_offsets
        for index, item in enumerate(scheduled):
            if not item.samples:
                continue
            state = states[index]
            data = state.data
            lo, hi = logit_offsets[index]
            drafts = item.draft_token_ids
            seed = data.sampling_seed
            if seed is None:
                # no drafts: the argmax of the one row (what verify_greedy returns)
                sampled = verify_greedy(argmax[lo:hi], drafts) if drafts else [argmax[lo]]
            else:
                sampled = verify_random(logits[lo:hi], drafts, data.sampling_params, seed,
                                        len(state.token_ids))
            if drafts:
                num_accepted = len(sampled) - 1
                accepted[item.request_id] = num_accepted
                verified.append(len(drafts))
                verified_accepted.append(num_accepted)
            token_ids = state.token_ids
            num_kept, reason = first_stop(sampled, len(token_ids), len(data.prompt_token_ids),
                                          data.stop_limits)
            if reason is not None:
                sampled = sampled[:num_kept]
                reasons[item.request_id] = reason
            token_ids.extend(sampled)
            sampled_by_id[item.request_id] = sampled
        if self.spec_policy is not None and verified:
            self.spec_policy.observe_acceptance(verified, verified_accepted)
        return sampled_by_id, reasons, accepted

    def _propose(self, scheduled: list[ScheduledRequest], forward: _Forward,
                 sampled_by_id: dict[str, list[int]], stopped: dict[str, FinishReason],
                 target_s: float
                 ) -> dict[str, list[int]]:
        if self.proposer is None:
            return {}
        output = forward.output
        num_decode = sum(1 for item in scheduled if item.request_id in sampled_by_id
                         and item.request_id not in stopped)
        num_spec = self.num_spec_tokens
        if self.spec_policy is not None:
            num_spec = self.spec_policy.decide(num_decode)
        target_rows = TargetRows(output.hidden_states, output.prenorm_hidden,
                                 tuple(output.aux_hidden_states), forward.slot_mapping)
        requests = self.requests
        n = len(scheduled)
        request_ids = [item.request_id for item in scheduled]
        states = [requests[request_id] for request_id in request_ids]
        token_ids = [state.token_ids for state in states]
        num_tokens = np.fromiter(map(len, token_ids), np.int64, n)
        if forward.query_lens is None or forward.seq_lens is None:
            raise RuntimeError("the forward kept no positions of the batch")
        ends = np.asarray(forward.seq_lens, dtype=np.int64)  # start + num_new_tokens
        starts = ends - np.asarray(forward.query_lens, dtype=np.int64)
        # a sampling request's rejected drafts' KV is garbage: its final positions end
        # after the accepted drafts
        sampling = np.fromiter((request_id in sampled_by_id for request_id in request_ids),
                               bool, n)
        num_sampled = np.fromiter((len(sampled_by_id.get(request_id, ()))
                                   for request_id in request_ids), np.int64, n)
        num_drafts = np.fromiter((len(item.draft_token_ids) for item in scheduled), np.int64, n)
        ends -= np.where(sampling, num_drafts - (num_sampled - 1), 0)
        wants = sampling
        if stopped:
            wants = sampling & np.fromiter((request_id not in stopped
                                            for request_id in request_ids), bool, n)
        rooms = np.minimum(
            np.fromiter((state.output_room for state in states), np.int64, n),
            np.fromiter((state.context_room for state in states), np.int64, n)) - num_tokens
        if forward.draft_table is None or forward.draft_table_lens is None:
            raise RuntimeError("the forward kept no block table of the drafter's group")
        inputs = ProposerBatch(
            request_ids, token_ids, starts, ends,
            np.asarray(forward.token_offsets, dtype=np.int64), wants,
            np.clip(rooms, 0, num_spec), target_rows, forward.draft_table,
            forward.draft_table_lens, [state.block_ids for state in states], self.draft_group)
        drafts = self.proposer.propose(inputs)
        if self.spec_policy is not None:
            timing = self.proposer.last_timing
            proposed = max((len(d) for d in drafts.values()), default=0)  # k actually drafted
            self.spec_policy.observe_step(StepCost(
                sum(item.num_new_tokens for item in scheduled), target_s, num_decode, proposed,
                timing.catch_up_s, timing.draft_s))
        max_drafts = inputs.max_drafts.tolist()
        out: dict[str, list[int]] = {}
        for index, (request_id, want) in enumerate(zip(request_ids, wants.tolist())):
            if want:
                proposed_ids = drafts.get(request_id)
                if proposed_ids:
                    out[request_id] = list(map(int, proposed_ids[: max_drafts[index]]))
        return out
