"""The model seam: what the engine, the runner, the drafters and the benches may ask of a
target model, whatever its family (Llama, Gemma 3 / 4, GDN hybrid).

    shape       `config` (vocab, hidden size, layers, KV heads, head size, context, EOS ids)
    placement   `dtype`, `device`
    KV cache    `kv_cache_layout(block_size, state_block_size)` -> groups (a hybrid's layout
                has a state group: `KVCacheLayout.has_state_group`),
                `kv_cache_bytes_per_block(block_size)` (the KV budget's unit),
                `make_layout_kv_cache(layout, num_blocks)` (the paged tensors)
    state       a model with a state group: `make_state_cache(num_blocks)` (its paged
                linear-attention state) and `plan_state(...)` (one forward's `StatePlan`);
                the others refuse both
    compute     `forward(...)` -> `ModelOutput`, `compute_logits(hidden)` -> fp32 logits
    weights     `embed_tokens`, `lm_head` (drafters share them), `named_parameters`

Every family's model subclasses `speckv.models.common.decoder.CausalLMBase` (the shared tail),
so each answers every question above; nothing outside `speckv.models` asks which family it is.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from speckv.attention.state_cache import PagedStateCache, StatePlan
from speckv.models.common.decoder import ModelOutput
from speckv.models.common.kv_layout import KVCacheLayout

# a block size to ask a model for its layout's kinds of groups when no engine picked one yet
PROBE_BLOCK_SIZE = 16


class TargetConfig(Protocol):
    """The shape every family's config answers (ModelConfig: Llama, Gemma's base;
    HybridConfig: GDN hybrids)."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def hidden_size(self) -> int: ...
    @property
    def num_hidden_layers(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def head_dim(self) -> int | None: ...  # (ModelConfig fills a None in at construction)
    @property
    def max_position_embeddings(self) -> int: ...
    @property
    def eos_token_ids(self) -> tuple[int, ...]: ...


class TargetModel(Protocol):
    """A target the engine serves (see the module docstring)."""

    @property
    def config(self) -> TargetConfig: ...
    embed_tokens: nn.Embedding
    lm_head: nn.Linear

    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def device(self) -> torch.device: ...

    def kv_cache_layout(self, block_size: int, state_block_size: int | None = None
                        ) -> KVCacheLayout:
        """The KV cache groups for `block_size`-token KV blocks; `state_block_size`: tokens
        per state block of a state group (a model without one ignores it)."""
        ...

    def kv_cache_bytes_per_block(self, block_size: int) -> int: ...

    def kv_cache_group_bytes(self, layout: KVCacheLayout) -> list[int] | None:
        """Bytes one block id costs in each group of `layout` (None: the model's bytes do not
        split per group, and it keeps one shared pool)."""
        ...

    def make_layout_kv_cache(self, layout: KVCacheLayout, num_blocks: int | Sequence[int]
                             ) -> Any:
        """The paged KV for `layout`: `num_blocks` rows in every group (one shared pool), or
        one count per group (per-group pools)."""
        ...

    def make_state_cache(self, num_blocks: int) -> PagedStateCache:
        """The paged linear-attention state, `num_blocks` block ids of the state group (a
        model without a state group raises ValueError)."""
        ...

    def plan_state(self, cache: PagedStateCache, query_lens: Sequence[int],
                   seq_lens: Sequence[int], state_tables: Sequence[Sequence[int]], unit: int,
                   record: Sequence[bool] | None = None) -> StatePlan:
        """One forward's plan over `cache`: request r computes [seq_lens[r] - query_lens[r],
        seq_lens[r]) with its state group's block table, `unit` tokens per state block;
        `record[r]`: keep every position's state (a speculative window to verify)."""
        ...

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: Any,
                 metadata: Any, aux_layers: Sequence[int] = (), *args: Any, **kwargs: Any
                 ) -> ModelOutput: ...

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor: ...

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True
                         ) -> Iterator[tuple[str, nn.Parameter]]: ...


def has_state_group(model: TargetModel) -> bool:
    """Whether the model keeps Mamba / GDN state per block (a GDN hybrid)."""
    return model.kv_cache_layout(PROBE_BLOCK_SIZE).has_state_group
