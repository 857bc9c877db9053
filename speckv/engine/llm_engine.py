"""LLMEngine: add requests, step, abort. One step = schedule → run → sample → update → publish.

Owns the per-request serving state (sampling params, generator, text, timings) and the order
of one step:

    schedule (scheduler.py: hits, chunked prefill, preemption)
    run the model (model_runner.py: logits only at rows that sample)
    sample / verify drafts (sampler.py), truncated at the first stop: EOS, stop token,
        stop string, max_tokens or max_model_len; `Request.apply_verification`
    proposer (proposer.py): writes draft KV for every position made final this step, then
        proposes the next drafts; runs BEFORE finished requests are freed (SPEC §5)
    finish: `KVCacheManager.finish` (caches what the last token completed, then frees)
    publish the step's KV events (optional)

Bad requests raise a ValueError from `add_request` and never enter the batch; the engine keeps
serving the others.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from speckv.attention import num_blocks_for_budget
from speckv.cache import FullAttentionSpec, KVCacheManager
from speckv.cache.block_pool import hit_check_for
from speckv.cache.events import KVCacheEvent, KVEventSink
from speckv.engine.config import EngineConfig
from speckv.engine.model_runner import ModelRunner, RunnerOutput
from speckv.engine.outputs import RequestOutput
from speckv.engine.proposer import Proposer, ProposerInput
from speckv.engine.request import BlockHashing, Request, RequestStatus
from speckv.engine.sampler import make_generator, verify_greedy, verify_random
from speckv.engine.sampling_params import SamplingParams
from speckv.engine.scheduler import Scheduler, SchedulerOutput
from speckv.engine.speculative import Drafter, make_proposer
from speckv.engine.stats import SchedulerStats  # [stats hook]
from speckv.hashing.functions import get_hash_algo, make_none_hash
from speckv.models.llama import LlamaForCausalLM
from speckv.models.tokenizer import Tokenizer
from speckv.spec.policy import HashMode, make_drafter_policy, resolve_hash_mode

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class EventPublisher(Protocol):
    def publish(self, events: Sequence[KVCacheEvent]) -> Any: ...


@dataclass
class _RequestState:
    request: Request  # its eos_token_ids are every token that stops it (EOS + stop_token_ids)
    params: SamplingParams
    generator: torch.Generator | None
    first_token_s: float | None = None
    text: str = ""
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None


class LLMEngine:
    def __init__(
        self,
        model: LlamaForCausalLM,
        config: EngineConfig | None = None,
        tokenizer: Tokenizer | None = None,
        proposer: Proposer | None = None,
        event_publisher: EventPublisher | None = None,
        detokenize: bool = True,
        drafter: Drafter | None = None,
        hash_mode_override: HashMode | None = None,
    ) -> None:
        """`hash_mode_override` bypasses the policy decision; only the draft-KV benchmark's
        negative control uses it (legacy hashes without the drop serve stale draft KV)."""
        self.config = config = config or EngineConfig()
        self.model = model
        self.tokenizer = tokenizer
        self.detokenize = detokenize and tokenizer is not None
        model_config = model.config
        self.vocab_size = model_config.vocab_size
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        block_size = config.block_size
        assert model_config.head_dim is not None
        # a drafter's KV layers share the target's blocks (same heads and head size)
        num_draft_layers = drafter.num_kv_layers if drafter is not None else 0
        self.num_blocks = config.num_blocks or num_blocks_for_budget(
            config.kv_cache_memory_bytes,
            model_config.num_hidden_layers + num_draft_layers,
            block_size,
            model_config.num_key_value_heads,
            model_config.head_dim,
            model.dtype,
        )
        if proposer is None:
            proposer = make_proposer(config, drafter, self.num_blocks)
        policy = proposer.policy if proposer is not None else make_drafter_policy("none")
        self.hash_mode = hash_mode_override or resolve_hash_mode(
            policy,
            enable_prefix_caching=config.enable_prefix_caching,
            disable_lookahead_block_hashes=config.disable_lookahead_block_hashes,
        )
        self._owned_publisher: Any = None  # [kv events] made from the config; close() ends it
        if event_publisher is None and config.kv_events_endpoint is not None:
            from speckv.events.publisher import publisher_for_endpoints

            event_publisher = self._owned_publisher = publisher_for_endpoints(
                config.kv_events_endpoint, config.kv_events_replay_endpoint)
        self.event_publisher = event_publisher
        algo = get_hash_algo(config.hash_algo)
        self.manager = KVCacheManager(
            [FullAttentionSpec(block_size)],
            self.num_blocks,
            self.hash_mode,
            enable_caching=config.enable_prefix_caching,
            hit_check=hit_check_for(algo),
            event_sink=KVEventSink() if event_publisher is not None else None,
        )
        self.hashing = BlockHashing(
            algo,
            make_none_hash(algo, config.hash_seed),
            self.manager.hash_block_size,
            self.manager.lookahead_values if config.enable_prefix_caching else [],
        )
        self.proposer = proposer
        self.num_spec_tokens = proposer.num_spec_tokens if proposer is not None else 0
        self.scheduler = Scheduler(
            self.manager, config.max_num_batched_tokens, config.max_num_seqs, self.num_spec_tokens
        )
        self.runner = ModelRunner(
            model,
            self.manager,
            self.num_blocks,
            block_size,
            aux_layers=tuple(proposer.aux_layers) if proposer is not None else (),
        )
        eos = tokenizer.eos_token_ids if tokenizer is not None else ()
        self.eos_token_ids: tuple[int, ...] = tuple(eos) or tuple(model_config.eos_token_ids)
        self._states: dict[str, _RequestState] = {}
        self._counter = itertools.count()
        self.last_stats: SchedulerStats | None = None  # [stats hook] set by every step()

    def close(self) -> None:  # [kv events]
        """Release what the engine made itself (the KV-event publisher from the config)."""
        if self._owned_publisher is not None:
            self._owned_publisher.shutdown()
            self._owned_publisher = None

    # ---- requests --------------------------------------------------------------------------
    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue one request; returns its id. Raises ValueError (engine unchanged) if bad."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        index = next(self._counter)
        request_id = request_id if request_id is not None else f"req-{index}"
        if request_id in self._states:
            raise ValueError(f"request {request_id}: the id is already in use")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"request {request_id}: a text prompt needs a tokenizer")
            if not prompt:
                raise ValueError(f"request {request_id}: the prompt is empty")
            token_ids: Sequence[int] = self.tokenizer.encode(prompt)
        else:
            token_ids = prompt
        if len(token_ids) > self.max_model_len:
            raise ValueError(
                f"request {request_id}: the prompt has {len(token_ids)} tokens, more than "
                f"max_model_len ({self.max_model_len})"
            )
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids.update(self.eos_token_ids)
        request = Request(
            request_id,
            token_ids,
            self.hashing,
            max_tokens=params.max_tokens,
            eos_token_ids=stop_ids,
            vocab_size=self.vocab_size,
            arrival_time=time.perf_counter(),
        )
        capacity = (self.num_blocks - 1) * self.config.block_size
        if request.num_prompt_tokens + 1 + self.num_spec_tokens > capacity:
            raise ValueError(
                f"request {request_id}: the prompt has {request.num_prompt_tokens} tokens but "
                f"the KV cache holds {capacity} tokens in all"
            )
        generator = None
        if not params.greedy:
            seed = params.seed if params.seed is not None else self.config.seed * 1_000_003 + index
            generator = make_generator(seed, self.runner.device)
        self._states[request_id] = _RequestState(request, params, generator)
        self.scheduler.add(request)
        return request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its blocks; returns its final output (None: unknown)."""
        state = self._states.get(request_id)
        if state is None:
            return None
        self._retire(state.request, cache=False)
        state.request.status = RequestStatus.FINISHED_ABORTED
        state.finish_reason = "abort"
        return self._output(state)

    def get_request(self, request_id: str) -> Request:
        """The scheduler-side state of an unfinished request (read-only use)."""
        return self._states[request_id].request

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    @property
    def num_unfinished_requests(self) -> int:
        return self.scheduler.num_unfinished

    # ---- one step --------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that produced tokens or
        finished in it (deltas since the previous output)."""
        scheduler_output = self.scheduler.schedule()
        outputs: list[RequestOutput] = []
        if scheduler_output.is_empty:
            outputs.extend(self._fail_unschedulable())
            self._publish_events()
            self._take_stats()  # [stats hook]
            return outputs
        runner_output = self.runner.execute(scheduler_output)
        sampled_states = self._sample_and_update(scheduler_output, runner_output)
        self._propose(scheduler_output, runner_output)
        for state in sampled_states:
            if state.finish_reason is not None:
                self._retire(state.request, cache=True)
            outputs.append(self._output(state))
        self._publish_events()
        self._take_stats()  # [stats hook]
        return outputs

    def _take_stats(self) -> None:  # [stats hook]
        scheduler = self.scheduler
        self.last_stats = scheduler.stats.take(len(scheduler.running), len(scheduler.waiting),
                                               self.manager.get_num_free_blocks(),
                                               self.num_blocks - 1)

    def _sample_and_update(
        self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput
    ) -> list[_RequestState]:
        logits = runner_output.logits  # [num_sample_rows, vocab]
        argmax: list[int] = []
        if any(
            self._states[item.request.request_id].params.greedy
            for item in scheduler_output.scheduled
            if item.samples
        ):
            argmax = logits.argmax(-1).tolist()
        now = time.perf_counter()
        updated: list[_RequestState] = []
        for index, item in enumerate(scheduler_output.scheduled):
            if not item.samples:
                continue
            request = item.request
            state = self._states[request.request_id]
            lo, hi = runner_output.logit_offsets[index]
            drafts = request.spec_token_ids[: item.num_drafts]
            if state.params.greedy:
                sampled = verify_greedy(argmax[lo:hi], drafts)
            else:
                assert state.generator is not None
                sampled = verify_random(logits[lo:hi], drafts, state.params, state.generator)
            sampled, reason, text = self._truncate_at_stop(state, sampled)
            request.apply_verification(item.num_drafts, sampled)
            self.scheduler.stats.record_verification(item.num_drafts, len(sampled) - 1)  # [stats]
            state.num_draft_tokens += item.num_drafts
            state.num_accepted_tokens += len(sampled) - 1
            if state.first_token_s is None:
                state.first_token_s = now
            if self.detokenize:
                self._update_text(state, text)
            if reason is not None:
                state.finish_reason = reason
                request.status = (
                    RequestStatus.FINISHED_STOPPED if reason == "stop"
                    else RequestStatus.FINISHED_LENGTH
                )
            updated.append(state)
        return updated

    def _truncate_at_stop(
        self, state: _RequestState, sampled: list[int]
    ) -> tuple[list[int], str | None, str | None]:
        """Cut `sampled` after the first token that ends the request, and say why; also the
        decoded output including the kept tokens when stop strings made it decode them
        (None otherwise), so the text update need not decode again. Pure."""
        request = state.request
        text = None
        for index, token in enumerate(sampled):
            kept = sampled[: index + 1]
            if token in request.eos_token_ids:
                return kept, "stop", None
            if state.params.stop and self.tokenizer is not None:
                text = self._decode(state, request.output_token_ids + kept)
                if any(stop in text for stop in state.params.stop):
                    return kept, "stop", text
            if (
                request.num_output_tokens + index + 1 >= state.params.max_tokens
                or request.num_tokens + index + 1 >= self.max_model_len
            ):
                return kept, "length", text
        return sampled, None, text

    def _decode(self, state: _RequestState, token_ids: Sequence[int]) -> str:
        assert self.tokenizer is not None
        return self.tokenizer.decode(
            token_ids, skip_special_tokens=state.params.skip_special_tokens
        )

    def _update_text(self, state: _RequestState, text: str | None = None) -> None:
        """`text`: the output already decoded (by `_truncate_at_stop`), else decoded here."""
        if text is None:
            text = self._decode(state, state.request.output_token_ids)
        for stop in state.params.stop:
            cut = text.find(stop)
            if cut >= 0:
                text = text[:cut]
        state.text = text

    def _propose(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> None:
        if self.proposer is None:
            return
        model_output = runner_output.model_output
        inputs: list[ProposerInput] = []
        for index, item in enumerate(scheduler_output.scheduled):
            request = item.request
            state = self._states[request.request_id]
            end = request.num_computed_tokens  # rejected drafts are already rolled back
            row0 = runner_output.token_offsets[index]
            rows = slice(row0, row0 + end - item.start)
            room_tokens = state.params.max_tokens - request.num_output_tokens - 1
            room_len = self.max_model_len - request.num_tokens - 1
            inputs.append(
                ProposerInput(
                    request_id=request.request_id,
                    token_ids=request.all_token_ids,
                    start=item.start,
                    end=end,
                    hidden_states=model_output.hidden_states[rows],
                    prenorm_hidden=model_output.prenorm_hidden[rows],
                    aux_hidden_states=tuple(h[rows] for h in model_output.aux_hidden_states),
                    block_table=runner_output.block_tables[index],
                    slot_mapping=runner_output.slot_mapping[rows],
                    wants_drafts=item.samples and state.finish_reason is None,
                    max_drafts=max(0, min(self.num_spec_tokens, room_tokens, room_len)),
                )
            )
        drafts = self.proposer.propose(inputs)
        for item in inputs:
            proposed = drafts.get(item.request_id)
            if proposed and item.wants_drafts:
                self._states[item.request_id].request.spec_token_ids = [
                    int(t) for t in proposed[: item.max_drafts]
                ]

    def _fail_unschedulable(self) -> list[RequestOutput]:
        """Nothing could run: the waiting head needs more blocks than the whole cache has."""
        if self.scheduler.running or not self.scheduler.waiting:
            return []
        request = self.scheduler.waiting[0]
        state = self._states[request.request_id]
        self._retire(request, cache=False)
        request.status = RequestStatus.FINISHED_LENGTH
        state.finish_reason = "length"
        state.error = (
            f"request {request.request_id}: {request.num_tokens} tokens no longer fit in the KV "
            f"cache ({self.num_blocks - 1} blocks of {self.config.block_size})"
        )
        return [self._output(state)]

    def _retire(self, request: Request, cache: bool) -> None:
        """Take a request out of the scheduler, release its blocks (`cache`: first cache what
        its last token completed) and drop the proposer's per-request state (drafters carry
        KV bookkeeping). Every way out of the engine (finish, abort, unschedulable) ends here."""
        self.scheduler.remove(request)
        if cache:
            self.manager.finish(request)
        else:
            self.manager.free(request)
        if self.proposer is not None:
            self.proposer.free(request.request_id)

    def _publish_events(self) -> None:
        if self.event_publisher is not None:
            events = self.manager.take_events()
            if events:
                self.event_publisher.publish(events)

    def _output(self, state: _RequestState) -> RequestOutput:
        request = state.request
        output_ids = request.output_token_ids
        finished = state.finish_reason is not None
        text = state.text
        # hold back an incomplete UTF-8 sequence until the next token completes it
        visible = len(text) if finished or not text.endswith("\ufffd") else len(text) - 1
        visible = max(visible, state.num_sent_chars)
        delta_text = text[state.num_sent_chars : visible]
        delta_ids = output_ids[state.num_sent_tokens :]
        state.num_sent_chars = visible
        state.num_sent_tokens = len(output_ids)
        if finished:
            self._states.pop(request.request_id, None)
        return RequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(output_ids),
            text=text,
            delta_token_ids=delta_ids,
            delta_text=delta_text,
            num_cached_tokens=request.num_cached_tokens,
            ttft_s=(
                state.first_token_s - request.arrival_time
                if state.first_token_s is not None
                else None
            ),
            finish_reason=state.finish_reason,
            num_preemptions=request.num_preemptions,
            num_draft_tokens=state.num_draft_tokens,
            num_accepted_tokens=state.num_accepted_tokens,
            error=state.error,
        )
