"""Self-distillation data for the built-in EAGLE3 head: the target's own answers and features.

Owns (1) running the engine (speculation and prefix caching off, continuous batching) over chat
conversations while a recording runner keeps, per request, the target's features at every
position it computes, (2) the on-disk format (safetensors, no pickle) and (3) the draft
vocabulary (EAGLE3 `d2t`): the most frequent tokens of the target's answers, and how much of a
held-out set it covers.

One sequence (prompt + answer, `n` tokens) stores `features [n - 1, 4, hidden]` (bfloat16):
the outputs of the three aux decoder layers the EAGLE3 head fuses (`AUX_LAYERS`, low / mid /
high) and the post-norm final hidden state (what the LM head reads; the training targets come
from it). The last token has none: the engine never computes the token it sampled last.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.messages import ScheduledRequest
from speckv.engine.model_runner import ModelRunner
from speckv.engine.sampling_params import SamplingParams
from speckv.models.base import TargetModel
from speckv.models.common.tokenizer import Tokenizer

# Our aux indices are decoder-layer OUTPUTS; vLLM's EAGLE3 ids (layer inputs) are these + 1:
# (2, 15, 29) for the 30-layer SmolLM2, all collectable by vLLM's loop.
AUX_LAYERS: tuple[int, int, int] = (1, 14, 28)
NUM_FEATURES = len(AUX_LAYERS) + 1  # aux low, mid, high, post-norm final

Conversation = list[dict[str, str]]


@dataclass(frozen=True)
class DistillSequence:
    tokens: list[int]  # prompt + the target's answer
    num_prompt_tokens: int
    features: torch.Tensor  # [len(tokens) - 1, NUM_FEATURES, hidden] bfloat16 (aux..., final)

    def __post_init__(self) -> None:
        if self.features.shape[0] != len(self.tokens) - 1:
            raise ValueError(
                f"{len(self.tokens)} tokens need {len(self.tokens) - 1} feature rows, got "
                f"{self.features.shape[0]}"
            )

    @property
    def answer(self) -> list[int]:
        return self.tokens[self.num_prompt_tokens :]


class _RecordingRunner(ModelRunner):
    """The engine's runner, also keeping the features of every position it computes."""

    def __init__(self, model: TargetModel, num_blocks: int, block_size: int,
                 aux_layers: tuple[int, ...]) -> None:
        super().__init__(model, num_blocks, block_size, None)
        self.aux_layers = aux_layers
        self.features: dict[str, list[torch.Tensor]] = {}

    def _forward(self, scheduled: list[ScheduledRequest]):
        forward = super()._forward(scheduled)
        out = forward.output
        rows = torch.stack([*out.aux_hidden_states, out.hidden_states], dim=1)
        rows = rows.to(torch.bfloat16)  # [num_tokens, NUM_FEATURES, hidden]
        for index, item in enumerate(scheduled):
            first = forward.token_offsets[index]
            chunks = self.features.setdefault(item.request_id, [])
            have = sum(chunk.shape[0] for chunk in chunks)
            if item.start != have:  # recomputed after a preemption: keep what precedes it
                kept = torch.cat(chunks)[: item.start] if chunks else rows[:0]
                chunks[:] = [kept]
            chunks.append(rows[first : first + item.num_new_tokens].clone())
        return forward


def chat_ids(tokenizer: Tokenizer, conversation: Conversation | str) -> list[int]:
    """Token ids of a conversation (or one user text) under the chat template, ready for the
    assistant's next turn."""
    if isinstance(conversation, str):
        conversation = [{"role": "user", "content": conversation}]
    text = tokenizer.apply_chat_template(conversation)
    return tokenizer.encode(text, add_special_tokens=False)


def generate_sequences(
    model: TargetModel,
    tokenizer: Tokenizer,
    prompts: Sequence[list[int]],
    params: Sequence[SamplingParams],
    *,
    max_num_seqs: int = 96,
    deadline: float | None = None,
    progress: Callable[[int, int], None] | None = None,
    aux_layers: tuple[int, ...] = AUX_LAYERS,
) -> list[DistillSequence]:
    """The target's answers to `prompts` (token ids) with their features; stops adding
    prompts after `deadline` (time.monotonic()), finishing those already running."""
    if len(prompts) != len(params):
        raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
    longest = max((len(p) + s.max_tokens for p, s in zip(prompts, params)), default=1)
    block_size = 16
    config = engine_config(
        block_size=block_size,
        num_blocks=max_num_seqs * -(-longest // block_size) + 2,  # never preempts
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=4096,
        enable_prefix_caching=False,  # a hit would skip positions whose features we need
        dtype=str(model.dtype).removeprefix("torch."),
        device=str(model.device),
    )
    engine = LLMEngine(model, config, tokenizer, detokenize=False)
    recorder = _RecordingRunner(model, engine.num_blocks, block_size, aux_layers)
    engine.runner = engine.core.runner = recorder  # type: ignore[assignment]
    ids: list[tuple[str, list[int]]] = []
    done: dict[str, list[int]] = {}
    next_prompt = 0
    while next_prompt < len(prompts) or engine.has_unfinished_requests():
        # keep the batch full until the deadline
        while (next_prompt < len(prompts) and engine.num_unfinished_requests < max_num_seqs
               and (deadline is None or time.monotonic() < deadline)):
            prompt = prompts[next_prompt]
            ids.append((engine.add_request(prompt, params[next_prompt]), list(prompt)))
            next_prompt += 1
        if not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output.token_ids
                if progress is not None:
                    progress(len(done), len(prompts))
    sequences = []
    for request_id, prompt in ids:
        tokens = prompt + done[request_id]
        features = torch.cat(recorder.features.pop(request_id))[: len(tokens) - 1]
        sequences.append(DistillSequence(tokens, len(prompt), features))
    return sequences


# ---- on disk --------------------------------------------------------------------------------


def save_sequences(sequences: Sequence[DistillSequence], path: Path) -> None:
    """safetensors: tokens_i (int64), features_i (bf16), num_prompt_tokens (int64 [n])."""
    from safetensors.torch import save_file

    state: dict[str, torch.Tensor] = {
        "num_prompt_tokens": torch.tensor([s.num_prompt_tokens for s in sequences])
    }
    for i, seq in enumerate(sequences):
        state[f"tokens_{i}"] = torch.tensor(seq.tokens, dtype=torch.int64)
        state[f"features_{i}"] = seq.features.contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))


def load_sequences(path: Path) -> list[DistillSequence]:
    from safetensors.torch import load_file

    state = load_file(str(path))
    prompt_lens = state["num_prompt_tokens"].tolist()
    return [
        DistillSequence(state[f"tokens_{i}"].tolist(), prompt_lens[i], state[f"features_{i}"])
        for i in range(len(prompt_lens))
    ]


# ---- the draft vocabulary -------------------------------------------------------------------


def answer_token_counts(sequences: Sequence[DistillSequence]) -> Counter[int]:
    """How often the target produced each token (answers only: what a draft must guess)."""
    counts: Counter[int] = Counter()
    for seq in sequences:
        counts.update(seq.answer)
    return counts


def draft_vocabulary(counts: Counter[int], size: int, always: Sequence[int] = ()) -> list[int]:
    """The `size` most frequent target ids (plus `always`, e.g. EOS), ascending (EAGLE3 keeps
    its draft vocabulary in target-id order)."""
    chosen = list(dict.fromkeys([*always, *(t for t, _ in counts.most_common())]))[:size]
    if len(chosen) < size:  # fewer distinct tokens than size: pad with the lowest unused ids
        used = set(chosen)
        chosen += [t for t in range(size + len(used)) if t not in used][: size - len(chosen)]
    return sorted(chosen)


def coverage(vocab: Sequence[int], sequences: Sequence[DistillSequence]) -> float:
    """Share of the answer tokens of `sequences` inside `vocab` (an upper bound on how often
    a draft from that vocabulary can be right)."""
    allowed = set(vocab)
    total = hits = 0
    for seq in sequences:
        for token in seq.answer:
            total += 1
            hits += token in allowed
    return hits / total if total else 0.0
