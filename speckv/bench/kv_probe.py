"""What the draft-KV checks share: the drafters they cover, reading KV through a block table,
and the negative control's engine.

Owns nothing but these three; `draft_kv.py` (one full-attention group, or several groups with
a sliding window) and `draft_kv_hybrid.py` (the GDN hybrid) both import them from here.
"""

from __future__ import annotations

from typing import Any

import torch

from speckv.cache.hash_mode import HashMode
from speckv.engine.llm_engine import LLMEngine

DRAFTERS = ("eagle", "eagle3", "mtp")


class StaleHashesEngine(LLMEngine):
    """The negative control's engine: legacy hashes with the drop turned off, which no
    configuration allows (it serves stale draft KV, which is what the control must show)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, hash_mode=HashMode.for_lookahead(
            0, "negative control: legacy hashes, drop off"), **kwargs)


def kv_at(cache, block_ids: list[int], num_tokens: int, block_size: int,
          layer_indices: list[int] | tuple[int, ...] | None = None, start: int = 0
          ) -> torch.Tensor:
    """K and V of the layers (default: all) at positions [start, num_tokens) through a
    block table. # [num_layers, 2, num_tokens - start, num_kv_heads, head_dim]"""
    positions = torch.arange(start, num_tokens)
    blocks = torch.tensor(block_ids, dtype=torch.long)[positions // block_size]
    offsets = positions % block_size
    layers = []
    for layer_idx in (range(cache.num_layers) if layer_indices is None else layer_indices):
        layer = cache.layer(layer_idx)
        layers.append(torch.stack([layer.key[blocks, offsets], layer.value[blocks, offsets]]))
    return torch.stack(layers).float()
