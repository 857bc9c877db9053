"""One draft module's interface (`DraftModule`: forward over paged draft KV, a dense forward
for training, KV-only writes, logits and draft tokens) and the fuse-then-decoder-layer module
EAGLE and MTP share.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from speckv.attention import AttentionMetadata, PagedKVCache
from speckv.drafters.layers import dense_attention
from speckv.models.llama.model import LlamaDecoderLayer


class DraftModule(nn.Module, ABC):
    """One link of the chain: (token t[p+j], hidden h_{j-1}[p]) -> h_j[p], KV written at p."""

    @abstractmethod
    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64, t[p + j]
        hidden: torch.Tensor,  # [num_tokens, hidden] h_{j-1}[p]
        positions: torch.Tensor,  # [num_tokens] int64
        kv_cache: PagedKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor: ...  # [num_tokens, hidden] h_j[p] (pre final norm)

    @abstractmethod
    def dense_forward(
        self,
        input_ids: torch.Tensor,  # [batch, seq] int64
        hidden: torch.Tensor,  # [batch, seq, hidden]
        positions: torch.Tensor,  # [seq] int64
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dense causal reference / training path: (h_j [b, s, hidden], k, v [b, s, kv, d])."""

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n, target_vocab] fp32 logits over the TARGET vocabulary."""

    def write_kv(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64, t[p + j]
        hidden: torch.Tensor,  # [num_tokens, hidden] h_{j-1}[p]
        positions: torch.Tensor,  # [num_tokens] int64
        kv_cache: PagedKVCache,
        metadata: AttentionMetadata,
    ) -> None:
        """Write the draft KV `forward` writes, without computing its output (a catch-up
        whose outputs nobody reads: the last module of a chain, or no drafts wanted)."""
        self.forward(input_ids, hidden, positions, kv_cache, metadata)

    def draft_token_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden] -> [n] int64 greedy draft (target ids); a module with a reduced draft
        vocabulary overrides this to skip the target-vocabulary logits."""
        return self.compute_logits(hidden).argmax(-1)


class FuseThenLayerModule(DraftModule):
    """A module whose inputs are fused into one vector (`fuse`) that a plain Llama decoder
    layer (`self.layer`) then reads: EAGLE and MTP. EAGLE3 feeds its layer differently."""

    layer: LlamaDecoderLayer

    @abstractmethod
    def fuse(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """(t[p + j], h_{j-1}[p]) -> the layer's input, [..., hidden]."""

    def forward(self, input_ids, hidden, positions, kv_cache, metadata):
        return self.layer(self.fuse(input_ids, hidden), positions, kv_cache, metadata)

    def write_kv(self, input_ids, hidden, positions, kv_cache, metadata):
        attn = self.layer.self_attn
        cos_sin = self.layer._rotary.cos_sin(positions, hidden.dtype)
        x = self.layer.input_layernorm(self.fuse(input_ids, hidden))
        attn.write_kv(x, cos_sin, kv_cache, metadata)

    def dense_forward(self, input_ids, hidden, positions):
        x = self.fuse(input_ids, hidden)  # [b, s, hidden]
        a, k, v = dense_attention(
            self.layer.self_attn, self.layer.input_layernorm(x), positions, self.layer._rotary
        )
        r = x + a
        return r + self.layer.mlp(self.layer.post_attention_layernorm(r)), k, v
