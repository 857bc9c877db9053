"""EAGLE3: fuse low/mid/high target layers, one 2H-input decoder layer, reduced draft vocab.

Owns the EAGLE3 draft module and drafter. Layout follows the public EAGLE3 release and vLLM's
`llama_eagle3.py`:
- `fc: Linear(3H -> H, bias=False)` over `cat(aux_low, aux_mid, aux_high)` of the target gives
  h_0 (only for target states; the drafter's own outputs are already H wide).
- `midlayer`: attention input `cat(input_layernorm(embed(t)), hidden_norm(h))` (2H wide q/k/v
  projections), residual = h (un-normed), then the usual post-attention norm + MLP.
- `norm` (own final norm) and `lm_head` over the draft vocabulary; `d2t[i]` maps draft id i to
  target id `i + d2t[i]`; `t2d` marks target ids present in the draft vocabulary.
- The next draft step's hidden is the PRE-norm output (vLLM's `hidden_prenorm`).
Aux layers: ours index decoder-layer OUTPUTS (HF hidden_states[i + 1]); vLLM's
`aux_hidden_state_layers` / `eagle_aux_hidden_state_layer_ids` index layer INPUTS, so ours = i - 1.
"""

from __future__ import annotations

import torch
from torch import nn

from speckv.attention import AttentionMetadata, PagedKVCache
from speckv.cache.drafter_policy import DrafterPolicy, drafter_policy
from speckv.drafters.base import Drafter
from speckv.drafters.draft_state import TargetStates
from speckv.drafters.layers import SharedTarget, dense_attention, drafter_layer_config
from speckv.drafters.modules import DraftModule
from speckv.models.common.config import ModelConfig
from speckv.models.common.layers import Linear, RMSNorm
from speckv.models.llama.model import LlamaDecoderLayer


def default_aux_layers(num_target_layers: int) -> tuple[int, int, int]:
    """vLLM's default (2, L // 2, L - 3) layer inputs, as our layer-output indices."""
    return vllm_aux_to_ours((2, num_target_layers // 2, num_target_layers - 3))


def vllm_aux_to_ours(layer_ids: tuple[int, ...] | list[int]) -> tuple[int, int, int]:
    out = tuple(int(i) - 1 for i in layer_ids)
    if len(out) != 3 or min(out) < 0:
        raise ValueError(f"EAGLE3 needs 3 aux layer inputs >= 1, got {list(layer_ids)}")
    return out  # type: ignore[return-value]


class Eagle3Module(DraftModule):
    def __init__(self, config: ModelConfig, target: SharedTarget, draft_vocab_size: int) -> None:
        super().__init__()
        h = config.hidden_size
        assert config.head_dim is not None
        self.target = target
        self.midlayer = LlamaDecoderLayer(config, 0)
        attn = self.midlayer.self_attn
        # q/k/v read cat(embeds, hidden): 2H wide (o_proj stays H).
        d, bias = config.head_dim, config.attention_bias
        attn.q_proj = Linear(2 * h, attn.num_heads * d, bias=bias)
        attn.k_proj = Linear(2 * h, attn.num_kv_heads * d, bias=bias)
        attn.v_proj = Linear(2 * h, attn.num_kv_heads * d, bias=bias)
        self.midlayer.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = Linear(h, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.ones(config.vocab_size, dtype=torch.bool))
        self.target_vocab_size = config.vocab_size

    def _attn_input(self, input_ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        emb = self.midlayer.input_layernorm(self.target.embed(input_ids).to(hidden.dtype))
        return torch.cat((emb, self.midlayer.hidden_norm(hidden)), dim=-1)  # [..., 2H]

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: PagedKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        layer = self.midlayer
        cos_sin = layer._rotary.cos_sin(positions, hidden.dtype)
        r = hidden + layer.self_attn(
            self._attn_input(input_ids, hidden), cos_sin, kv_cache, metadata
        )
        return r + layer.mlp(layer.post_attention_layernorm(r))  # [n, hidden] pre-norm

    def write_kv(self, input_ids, hidden, positions, kv_cache, metadata) -> None:
        layer = self.midlayer
        cos_sin = layer._rotary.cos_sin(positions, hidden.dtype)
        layer.self_attn.write_kv(self._attn_input(input_ids, hidden), cos_sin, kv_cache, metadata)

    def dense_forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        layer = self.midlayer
        a, k, v = dense_attention(
            layer.self_attn, self._attn_input(input_ids, hidden), positions, layer._rotary
        )
        r = hidden + a
        return r + layer.mlp(layer.post_attention_layernorm(r)), k, v

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        draft = self.lm_head(self.norm(hidden)).float()  # [n, draft_vocab]
        out = draft.new_full((hidden.shape[0], self.target_vocab_size), float("-inf"))
        ids = torch.arange(draft.shape[1], device=draft.device) + self.d2t  # target ids
        out[:, ids] = draft
        return out  # [n, target_vocab]

    def draft_token_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        best = self.lm_head(self.norm(hidden)).argmax(-1)  # [n] draft ids
        return best + self.d2t[best]  # [n] target ids


class Eagle3Drafter(Drafter):
    """EAGLE3 head (L = 1); the target must run with `aux_layers=self.target_aux_layers`."""

    @property
    def policy(self) -> DrafterPolicy:
        return drafter_policy("eagle3")

    def __init__(
        self,
        target_config: ModelConfig,
        target: SharedTarget,
        draft_vocab_size: int | None = None,
        aux_layers: tuple[int, int, int] | None = None,
    ) -> None:
        super().__init__()
        assert target_config.head_dim is not None
        self.config = drafter_layer_config(target_config, 1)
        self.draft_vocab_size = draft_vocab_size or target_config.vocab_size
        self.aux_layers = aux_layers or default_aux_layers(target_config.num_hidden_layers)
        for i in self.aux_layers:
            if not 0 <= i < target_config.num_hidden_layers:
                raise ValueError(f"aux layer {i} outside the target's layers")
        h = target_config.hidden_size
        self.num_kv_heads = self.config.num_key_value_heads
        self.head_dim = target_config.head_dim
        self.fc = Linear(3 * h, h, bias=False)
        self.modules_chain = nn.ModuleList(
            [Eagle3Module(self.config, target, self.draft_vocab_size)]
        )

    @property
    def module(self) -> Eagle3Module:
        return self.modules_chain[0]  # type: ignore[return-value]

    @property
    def target_aux_layers(self) -> tuple[int, ...]:
        return self.aux_layers

    def first_hidden(self, target_states: TargetStates) -> torch.Tensor:
        aux = target_states.aux_hidden_states
        if len(aux) != 3:
            raise ValueError(
                f"EAGLE3 needs the target's aux hidden states of layers {self.aux_layers}, "
                f"got {len(aux)} tensors"
            )
        return self.fc(torch.cat([a.to(self.dtype) for a in aux], dim=-1))  # [n, hidden]
