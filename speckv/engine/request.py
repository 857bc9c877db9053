"""A request as the scheduler sees it: real tokens, drafts, computed tokens, block hashes.

Owns one request's token state and its incremental block hashers. Token kinds:

    all_token_ids   = prompt + sampled tokens: the *real* tokens, the only ones ever hashed
    spec_token_ids  = drafts proposed for the next step: never hashed, may be rejected
    num_computed_tokens = tokens whose target KV (and draft KV where defined) is written

One step of speculative decoding, with d drafts scheduled and a of them accepted:

    before: [ computed ....... | last real ] [ d drafts ]
    run:    num_computed_tokens += 1 + d       (last real token + drafts are computed)
    verify: num_computed_tokens -= d - a       (rejected drafts' KV is garbage)
            all_token_ids += a accepted drafts + 1 bonus token (bonus not computed yet)
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import Enum
from typing import Any

from speckv.engine.messages import FinishReason, NewRequestData, StopLimits
from speckv.engine.sampling_params import SamplingParams
from speckv.hashing.block_hashing import BlockHashing
from speckv.hashing.extra_keys import NO_HASH_INPUTS, HashInputs, LoRARef
from speckv.hashing.functions import BlockHash


class RequestStatus(Enum):
    WAITING = "waiting"
    # allocated, its KV loading asynchronously from a KV connector: not scheduled until the
    # connector reports the load finished (`ConnectorOutput.finished_recving`)
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self.value.startswith("finished")

    @classmethod
    def finished(cls, reason: FinishReason) -> RequestStatus:
        return _FINISHED[reason]


_FINISHED = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
}


def validate_token_ids(token_ids: Sequence[int], vocab_size: int | None, what: str) -> list[int]:
    """Plain Python ints in range, or a ValueError naming the first bad one."""
    checked: list[int] = []
    for index, token_id in enumerate(token_ids):
        if isinstance(token_id, bool) or not hasattr(token_id, "__index__"):
            raise ValueError(f"{what}[{index}] = {token_id!r} is not an integer token id")
        value = int(token_id)
        if value < 0 or (vocab_size is not None and value >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise ValueError(f"{what}[{index}] = {value} is outside the vocabulary {bound}")
        checked.append(value)
    return checked


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        hashing: BlockHashing,
        *,
        max_tokens: int = 16,
        eos_token_ids: Sequence[int] = (),
        hash_inputs: HashInputs = NO_HASH_INPUTS,
        vocab_size: int | None = None,
        arrival_time: float = 0.0,
        max_model_len: int | None = None,
        sampling_params: SamplingParams | None = None,
        sampling_seed: int | None = None,
    ) -> None:
        if not prompt_token_ids:
            raise ValueError(f"request {request_id}: the prompt is empty")
        if max_tokens < 1:
            raise ValueError(f"request {request_id}: max_tokens must be >= 1, got {max_tokens}")
        self.request_id = request_id
        self.prompt_token_ids = validate_token_ids(prompt_token_ids, vocab_size, "prompt")
        self.all_token_ids: list[int] = list(self.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.spec_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache, first schedule
        self.num_external_cached_tokens = 0  # of them, loaded from a KV connector's tier
        self.num_preemptions = 0
        self.max_tokens = max_tokens
        self.eos_token_ids = frozenset(eos_token_ids)  # every token that stops it
        self.stop_limits = StopLimits(
            self.eos_token_ids, max_tokens, max_model_len if max_model_len else 2**62
        )
        self.sampling_params = sampling_params or SamplingParams(max_tokens=max_tokens)
        self.sampling_seed = sampling_seed  # the runner's generator seed (None: greedy)
        self.hash_inputs = hash_inputs
        self.arrival_time = arrival_time
        self.status = RequestStatus.WAITING
        # what the KV connector's `request_finished` returned for the caller (set at finish)
        self.finished_kv_transfer_params: dict[str, Any] | None = None
        self._hashers = hashing.hashers_for(hash_inputs)
        self._next_hash_at = 0  # real tokens at which some hasher's next block hash appears
        self._update_hashes()

    # ---- reads -------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Real tokens (prompt + sampled), drafts excluded."""
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens :]

    @property
    def lora_name(self) -> str | None:
        lora: LoRARef | None = self.hash_inputs.lora
        return lora.name if lora is not None else None

    @property
    def kv_transfer_params(self) -> dict[str, Any] | None:
        """What the API request carried for the KV connector (None: nothing)."""
        return self.sampling_params.kv_transfer_params

    def get_block_hashes(self, lookahead_tokens: int) -> list[BlockHash]:
        return self._hashers[lookahead_tokens].block_hashes

    def hash_with_successors(self, lookahead_tokens: int, index: int,
                             successors: Sequence[int]) -> BlockHash:
        """The hash block `index` of this request would have with `successors` after it."""
        return self._hashers[lookahead_tokens].hash_with_successors(
            self.all_token_ids, index, successors)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def new_request_data(self) -> NewRequestData:
        """What the runner keeps for this request's life (sent on its first schedule)."""
        return NewRequestData(
            self.request_id, list(self.prompt_token_ids), self.sampling_params,
            self.sampling_seed, self.stop_limits,
        )

    # ---- mutations ---------------------------------------------------------------------------
    def append_output_token_ids(self, token_ids: Sequence[int]) -> None:
        """New real tokens (accepted drafts, bonus or plain sampled tokens). Mutates."""
        if len(token_ids) == 1:
            self.all_token_ids.append(int(token_ids[0]))
        else:
            self.all_token_ids.extend(int(token_id) for token_id in token_ids)
        if len(self.all_token_ids) >= self._next_hash_at:
            self._update_hashes()

    def apply_verification(self, num_scheduled_drafts: int, sampled: Sequence[int]) -> int:
        """Apply one verified step: `sampled` = accepted drafts + one bonus token.

        Rolls back the rejected drafts' computed positions, appends the real tokens, clears the
        drafts, and returns the number of rejected drafts. Mutates.
        """
        if not sampled:
            raise ValueError("a verified step samples at least the bonus token")
        num_accepted = len(sampled) - 1
        if num_accepted > num_scheduled_drafts:
            raise ValueError(
                f"{num_accepted} drafts accepted but only {num_scheduled_drafts} scheduled"
            )
        num_rejected = num_scheduled_drafts - num_accepted
        self.num_computed_tokens -= num_rejected
        self.spec_token_ids = []
        self.append_output_token_ids(sampled)
        return num_rejected

    def preempt(self) -> None:
        """Forget computed state; the caller has freed the blocks. Mutates."""
        self.status = RequestStatus.PREEMPTED
        self.num_computed_tokens = 0
        self.spec_token_ids = []
        self.num_preemptions += 1

    def _update_hashes(self) -> None:
        next_at = None
        for hasher in self._hashers.values():
            hasher.update(self.all_token_ids)
            # the next block hash needs one more full block plus its lookahead tokens
            at = (len(hasher.block_hashes) + 1) * hasher.block_size + hasher.lookahead_tokens
            next_at = at if next_at is None else min(next_at, at)
        self._next_hash_at = next_at if next_at is not None else 2**62
