"""The part of a causal LM every family shares: the output type, the layer walk that keeps the
requested aux layers, the final norm + LM head (+ an optional logit soft-cap), and the paged KV
cache of an attention model (its size per block id and its tensors for a `KVCacheLayout`), and
the refusal of a model without linear-attention state to make or plan one.

A family's model subclasses `CausalLMBase` and keeps only what differs: its embedding, its
layers and what each layer is fed (rotary table, per-layer inputs, linear-attention state).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from speckv.attention import GroupedKVCache, PagedKVCache, bytes_per_block
from speckv.attention.state_cache import PagedStateCache, StatePlan
from speckv.cache.specs import MambaSpec
from speckv.models.common.kv_layout import KVCacheLayout
from speckv.models.common.random_init import EmbeddingPlacement


@dataclass(frozen=True)
class ModelOutput:
    hidden_states: torch.Tensor  # [num_tokens, hidden] after the final norm (LM-head input)
    prenorm_hidden: torch.Tensor  # [num_tokens, hidden] last layer output before the final norm
    # One [num_tokens, hidden] per requested aux layer: OUTPUT of decoder layer i (pre-norm),
    # i.e. HF `output_hidden_states[i + 1]`. vLLM's EAGLE3 `aux_hidden_state_layers` index i
    # means the INPUT of layer i, which is our aux layer i - 1.
    aux_hidden_states: tuple[torch.Tensor, ...] = ()


# one decoder layer's call inside the walk: (layer index, layer, hidden) -> hidden
LayerStep = Callable[[int, Any, torch.Tensor], torch.Tensor]


class CausalLMBase(EmbeddingPlacement):
    """Mixin of a family's `nn.Module` target: `decode` (layers -> `ModelOutput`),
    `compute_logits`, and the attention-only KV cache (`kv_cache_bytes_per_block`,
    `make_layout_kv_cache`), which a family with other KV shapes or state overrides."""

    config: Any  # the family's shape (ModelConfig or HybridConfig)
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Linear

    def decode(self, h: torch.Tensor, aux_layers: Sequence[int], step: LayerStep) -> ModelOutput:
        """Run every layer on `h` ([num_tokens, hidden]) and apply the final norm, keeping the
        output of each layer in `aux_layers`."""
        for i in aux_layers:
            if not 0 <= i < self.config.num_hidden_layers:
                raise ValueError(f"aux_layers entry {i} out of range")
        aux: dict[int, torch.Tensor] = {}
        wanted = set(aux_layers)
        for i, layer in enumerate(self.layers):
            h = step(i, layer, h)  # [num_tokens, hidden]
            if i in wanted:
                aux[i] = h
        return ModelOutput(self.norm(h), h, tuple(aux[i] for i in aux_layers))

    @property
    def final_logit_softcapping(self) -> float | None:
        """When set (Gemma), logits -> tanh(logits / cap) * cap; None: the raw logits."""
        return None

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, vocab] fp32 logits (soft-capped when the model says so)."""
        logits = self.lm_head(hidden_states).float()
        cap = self.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def make_state_cache(self, num_blocks: int) -> PagedStateCache:
        """The paged linear-attention state of a model with a state group; this model has
        none (a family with Mamba / GDN layers overrides this and `plan_state`)."""
        raise ValueError(f"{type(self).__name__} keeps no linear-attention state")

    def plan_state(self, cache: PagedStateCache, query_lens: Sequence[int],
                   seq_lens: Sequence[int], state_tables: Sequence[Sequence[int]], unit: int,
                   record: Sequence[bool] | None = None) -> StatePlan:
        """One forward's `StatePlan` over `cache` (a model with a state group only)."""
        raise ValueError(f"{type(self).__name__} keeps no linear-attention state")

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """Bytes one block id costs (the engine's KV budget): K and V of every layer."""
        config = self.config
        return bytes_per_block(config.num_hidden_layers, block_size,
                               config.num_key_value_heads, config.head_dim, self.dtype)

    def make_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """A PagedKVCache of every layer, in the model's dtype and on its device."""
        config = self.config
        return PagedKVCache(config.num_hidden_layers, num_blocks, block_size,
                            config.num_key_value_heads, config.head_dim, self.dtype,
                            self.device)

    def kv_cache_group_bytes(self, layout: KVCacheLayout) -> list[int] | None:
        """What one block id costs in each group of `layout`, its own layers only (K and V of
        a block); None from a model that does not split its block bytes per group."""
        config = self.config
        return [bytes_per_block(len(group.layer_indices), group.spec.block_size,
                                config.num_key_value_heads, config.head_dim, self.dtype)
                for group in layout.groups]

    def make_layout_kv_cache(self, layout: KVCacheLayout, num_blocks: int | Sequence[int]
                             ) -> PagedKVCache | GroupedKVCache:
        """The paged KV for `layout`: one tensor for all layers when every group has one block
        size and one block count, else a `GroupedKVCache` with one `PagedKVCache` per group
        (its block size, its block count, its layers). `num_blocks`: one count for a shared
        pool, or one per group (per-group pools)."""
        counts = ([num_blocks] * layout.num_groups if isinstance(num_blocks, int)
                  else list(num_blocks))
        sizes = {spec.block_size for spec in layout.specs}
        if len(sizes) == 1 and len(set(counts)) == 1:
            return self.make_kv_cache(counts[0], sizes.pop())
        config = self.config
        caches, slots = [], {}
        for g, group in enumerate(layout.groups):
            if isinstance(group.spec, MambaSpec):
                raise ValueError("Mamba state groups need the model's make_layout_kv_cache")
            caches.append(PagedKVCache(len(group.layer_indices), counts[g],
                                       group.spec.block_size, config.num_key_value_heads,
                                       config.head_dim, self.dtype, self.device))
            slots.update({layer: (g, local) for local, layer in enumerate(group.layer_indices)})
        return GroupedKVCache(caches, slots)
