"""`Gemma4AssistantProposer`: the engine's `Proposer` for the Gemma 4 assistant.

Owns the binding to the target's paged KV (the runner hands over its cache and layout once,
`bind_target_kv`) and, per step, one batched draft loop over the requests that want drafts:
S assistant steps, one query per request at position n-1, reading the target's blocks through
each group's block table (`ProposerInput.block_tables`). Nothing is written: no catch-up pass,
no per-request state, no drafter cache (so the KV budget and the connectors see none).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from speckv.attention import AttentionMetadata
from speckv.attention.kv_cache import LayerKVCache
from speckv.cache.drafter_policy import DrafterPolicy
from speckv.speculation.proposer import ProposerInput, ProposeTiming

if TYPE_CHECKING:  # the assistant builds this proposer (`Gemma4Assistant.make_proposer`)
    from speckv.drafters.gemma4_assistant import Gemma4Assistant


@dataclass(frozen=True)
class TargetKV:
    """Per attention type, the target layer whose paged KV the assistant's layers read."""

    caches: Mapping[str, LayerKVCache]  # kind -> [num_blocks, block_size, kv_heads, head_dim]
    groups: Mapping[str, int]  # kind -> the target's KV cache group of that layer
    block_sizes: Mapping[str, int]  # kind -> that group's block size


class Gemma4AssistantProposer:
    """Runner adapter: `bind_target_kv` once, then `propose(inputs)` once per step."""

    kv_cache = None  # no draft KV of its own
    aux_layers: tuple[int, ...] = ()

    def __init__(self, assistant: Gemma4Assistant, num_spec_tokens: int) -> None:
        if num_spec_tokens < 1:
            raise ValueError(f"num_spec_tokens must be >= 1, got {num_spec_tokens}")
        self.assistant = assistant
        self.policy: DrafterPolicy = assistant.policy  # gemma4_mtp: L = 0, no drop
        self.num_spec_tokens = num_spec_tokens
        self.last_timing = ProposeTiming()
        self._kv: TargetKV | None = None

    def bind_target_kv(self, kv_cache, layout) -> None:
        """The target's cache (addressed by model layer) and its `KVCacheLayout`."""
        caches, groups, block_sizes = {}, {}, {}
        layer_to_group = layout.layer_to_group
        for kind, layer in self.assistant.target_layers.items():
            cache = kv_cache.layer(layer)
            group = layer_to_group[layer]
            caches[kind], groups[kind] = cache, group
            block_sizes[kind] = layout.specs[group].block_size
        for attn in (layer.self_attn for layer in self.assistant.layers):
            kind = "full_attention" if attn.sliding_window is None else "sliding_attention"
            shape = tuple(caches[kind].key.shape[2:])
            if shape != (attn.num_kv_heads, attn.head_dim):
                raise ValueError(f"the assistant's {kind} layers read {attn.num_kv_heads} KV "
                                 f"heads of {attn.head_dim}; the target's layer "
                                 f"{self.assistant.target_layers[kind]} has {shape[0]} of "
                                 f"{shape[1]}")
            window = getattr(layout.specs[groups[kind]], "sliding_window", None)
            if attn.sliding_window is not None and window is not None \
                    and attn.sliding_window > window:
                raise ValueError(f"the assistant's sliding window {attn.sliding_window} is "
                                 f"wider than the target's {window} (those keys are freed)")
        self._kv = TargetKV(caches, groups, block_sizes)

    def free(self, request_id: str) -> None:
        """Nothing is kept per request."""

    @torch.inference_mode()
    def propose(self, inputs: Sequence[ProposerInput]) -> dict[str, list[int]]:
        start = time.perf_counter()
        self.last_timing = ProposeTiming()
        # the target's KV is final up to n-2 only once the step reached the last real token
        want = [x for x in inputs if x.end > x.start and x.wants_drafts and x.max_drafts > 0
                and x.end == len(x.token_ids) - 1]
        if not want:
            return {}
        kv = self._kv
        if kv is None:
            raise RuntimeError("the Gemma 4 assistant is not bound to the target's KV cache "
                               "(the model runner binds it)")
        assistant = self.assistant
        device = assistant.device
        num_known = [len(x.token_ids) - 1 for x in want]  # keys 0 .. n-2 per request
        metadata = {
            kind: AttentionMetadata.build([1] * len(want), num_known,
                                          [x.block_tables[kv.groups[kind]] for x in want],
                                          kv.block_sizes[kind], device)
            for kind in kv.caches}
        positions = torch.tensor(num_known, dtype=torch.int64, device=device)  # n - 1
        tokens = torch.tensor([x.token_ids[-1] for x in want], dtype=torch.int64,
                              device=device)
        hidden = torch.stack([x.hidden_states[-1] for x in want])  # h_target[n-2]
        num = min(self.num_spec_tokens, max(x.max_drafts for x in want))
        drafts = []
        for _ in range(num):
            y, hidden = assistant.step(assistant.embed(tokens), hidden, positions, kv, metadata)
            tokens = assistant.draft_token_ids(y)
            drafts.append(tokens)
        rows = torch.stack(drafts, dim=1).tolist()  # [num_reqs, num]
        self.last_timing = ProposeTiming(0.0, time.perf_counter() - start)
        return {x.request_id: row[: x.max_drafts] for x, row in zip(want, rows)}
