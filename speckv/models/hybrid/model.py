"""Gated DeltaNet hybrid decoder (Qwen3-Next / Qwen3.5 text) over paged KV and paged state.

Owns the model forward of a hybrid: layers interleave Gated DeltaNet linear attention
(`gated_deltanet.py`, state in a `PagedStateCache`) and full gated attention (q/k RMSNorm,
partial RoPE on the first `rotary_dim` dims of each head, an output gate from `q_proj`, KV in a
`PagedKVCache` holding only the attention layers), each followed by a dense SwiGLU MLP. Norms are
zero-centred (`x * (1 + w)`), as in transformers. Same calling convention as
`LlamaForCausalLM` plus a `StatePlan` (`state=`) for the linear layers; parameter names equal
transformers' minus the leading "model." (see `loader.py`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from speckv.attention import (
    AnyAttentionMetadata,
    AttentionBackend,
    PagedKVCache,
    get_attention_backend,
    metadata_for_layer,
)
from speckv.attention.state_cache import PagedStateCache, StatePlan, StateSegment
from speckv.cache.specs import FullAttentionSpec, MambaSpec
from speckv.models.common.decoder import CausalLMBase, ModelOutput
from speckv.models.common.kv_layout import KVCacheGroup, KVCacheLayout
from speckv.models.common.layers import SwiGLUMLP
from speckv.models.common.random_init import random_init
from speckv.models.common.rope import RotaryEmbedding, apply_rope
from speckv.models.hybrid.config import HybridConfig
from speckv.models.hybrid.gated_deltanet import GatedDeltaNet
from speckv.models.hybrid.moe import SparseMoeBlock

DEFAULT_STATE_UNIT_TOKENS = 544


def default_state_block_size(block_size: int) -> int:
    """The smallest multiple of `block_size` that is >= 544 tokens."""
    return -(-DEFAULT_STATE_UNIT_TOKENS // block_size) * block_size


class ZeroCenteredRMSNorm(nn.Module):
    """x / rms(x) * (1 + w) in fp32, cast back (Qwen3NextRMSNorm; w initialised to 0)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GatedAttention(nn.Module):
    """Full attention with an output gate and partial RoPE (Qwen3NextAttention), paged."""

    def __init__(self, config: HybridConfig, layer_idx: int, kv_layer: int,
                 backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_idx = layer_idx  # model layer index (picks its KV cache group's metadata)
        self.kv_layer = kv_layer  # this layer's index in the PagedKVCache
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rotary_dim = config.rotary_dim
        self.scale = self.head_dim**-0.5
        self.backend = backend
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.q_proj = nn.Linear(h, 2 * self.num_heads * d, bias=bias)  # query | gate per head
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(d, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(d, config.rms_norm_eps)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        r = self.rotary_dim
        if r == self.head_dim:
            return apply_rope(x, cos, sin)
        return torch.cat((apply_rope(x[..., :r], cos, sin), x[..., r:]), dim=-1)

    def forward(
        self,
        hidden: torch.Tensor,  # [n, hidden]
        cos_sin: tuple[torch.Tensor, torch.Tensor],  # each [n, 1, rotary_dim]
        kv_cache: PagedKVCache,
        metadata: AnyAttentionMetadata,
    ) -> torch.Tensor:  # [n, hidden]
        metadata = metadata_for_layer(metadata, self.layer_idx)
        n, d = hidden.shape[0], self.head_dim
        q, gate = torch.chunk(self.q_proj(hidden).view(n, self.num_heads, 2 * d), 2, dim=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(hidden).view(n, self.num_kv_heads, d))
        v = self.v_proj(hidden).view(n, self.num_kv_heads, d)
        cos, sin = cos_sin
        q, k = self._rope(q, cos, sin), self._rope(k, cos, sin)
        cache = kv_cache.layer(self.kv_layer)
        self.backend.write_kv(cache, k, v, metadata.slot_mapping)
        o = self.backend.forward(q, cache.key, cache.value, metadata, self.scale, None)
        o = o.reshape(n, self.num_heads * d) * torch.sigmoid(gate.reshape(n, -1))
        return self.o_proj(o)


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: HybridConfig, layer_idx: int, backend: AttentionBackend) -> None:
        super().__init__()
        self.layer_type = config.layer_types[layer_idx]
        if self.layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(
                config, layer_idx, config.linear_layers.index(layer_idx))
        else:
            self.self_attn = GatedAttention(
                config, layer_idx, config.attention_layers.index(layer_idx), backend)
        self.mlp: nn.Module
        if layer_idx in config.moe_layers:
            self.mlp = SparseMoeBlock(config.hidden_size, config.num_experts,
                                      config.num_experts_per_tok, config.moe_intermediate_size,
                                      config.shared_expert_intermediate_size,
                                      config.norm_topk_prob)
        else:
            self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size,
                                                            config.rms_norm_eps)

    def forward(self, hidden, cos_sin, kv_cache, metadata, state: StatePlan | None):
        x = self.input_layernorm(hidden)
        if self.layer_type == "linear_attention":
            if state is None:
                raise ValueError("a Gated DeltaNet layer needs a StatePlan (state=)")
            h = hidden + self.linear_attn(x, state)
        else:
            h = hidden + self.self_attn(x, cos_sin, kv_cache, metadata)
        return h + self.mlp(self.post_attention_layernorm(h))


class HybridForCausalLM(CausalLMBase, nn.Module):
    """The GDN hybrid target. Build with `from_config` (random init) or `hybrid.loader`; its
    layout has a state group (`KVCacheLayout.has_state_group`)."""

    def __init__(self, config: HybridConfig, backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = config
        self.attn_backend = backend or get_attention_backend()
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta, None,
                                      config.max_position_embeddings)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(HybridDecoderLayer(config, i, self.attn_backend)
                                    for i in range(config.num_hidden_layers))
        self.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @classmethod
    def from_config(cls, config: HybridConfig, dtype: torch.dtype | str = torch.float32,
                    device: torch.device | str = "cpu", init_std: float = 0.02
                    ) -> HybridForCausalLM:
        """Random init as transformers does (normal(0, init_std) weights, norms 0 in the
        zero-centred form, gated norm 1, dt_bias 1, A_log = log U(0.01, 16)); seed first."""
        return random_init(cls(config), init_std, dtype, device, [
            ("linear_attn.norm.weight", lambda p: p.fill_(1.0)),
            ("dt_bias", lambda p: p.fill_(1.0)),
            ("norm.weight", lambda p: p.zero_()),
            ("A_log", lambda p: p.copy_(torch.empty_like(p).uniform_(0.01, 16).log_())),
        ])

    @property
    def num_kv_layers(self) -> int:
        return len(self.config.attention_layers)

    def kv_cache_layout(self, block_size: int, state_block_size: int | None = None
                        ) -> KVCacheLayout:
        """Two groups: full attention (blocks of `block_size` tokens) and the GDN state
        (`MambaSpec`: one checkpoint every `state_block_size` tokens, the alignment unit;
        default: the smallest multiple of `block_size` >= 544, vLLM's unit for Qwen3-Next)."""
        unit = state_block_size or default_state_block_size(block_size)
        if unit % block_size:
            raise ValueError(f"the GDN state block size ({unit} tokens) must be a multiple of "
                             f"the KV block size ({block_size})")
        groups = []
        if self.config.attention_layers:
            groups.append(KVCacheGroup(FullAttentionSpec(block_size),
                                       self.config.attention_layers))
        groups.append(KVCacheGroup(MambaSpec(unit), self.config.linear_layers))
        return KVCacheLayout(tuple(groups))

    def kv_cache_bytes_per_block(self, block_size: int) -> int:
        """What one block id costs (the engine's KV budget): the K/V of `block_size` tokens of
        every attention layer plus one conv + recurrent state of every linear layer (every
        block id has both rows; see state_cache.py)."""
        c = self.config
        elem = torch.empty((), dtype=self.dtype).element_size()
        kv = 2 * len(c.attention_layers) * block_size * c.num_key_value_heads * c.head_dim * elem
        state = len(c.linear_layers) * (
            c.conv_dim * (c.linear_conv_kernel_dim - 1) * elem
            + c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4)
        return kv + state

    def kv_cache_group_bytes(self, layout: KVCacheLayout) -> list[int]:
        """What one block id costs in each group of `layout`, its own layers only: the K/V of
        a block of the attention layers, one conv + recurrent state of the linear layers."""
        c = self.config
        elem = torch.empty((), dtype=self.dtype).element_size()
        state = len(c.linear_layers) * (
            c.conv_dim * (c.linear_conv_kernel_dim - 1) * elem
            + c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim * 4)
        return [state if isinstance(group.spec, MambaSpec) else
                2 * len(c.attention_layers) * group.spec.block_size * c.num_key_value_heads
                * c.head_dim * elem for group in layout.groups]

    def make_layout_kv_cache(self, layout: KVCacheLayout, num_blocks: int | Sequence[int]
                             ) -> PagedKVCache:
        """The engine's paged KV for `layout`: the full-attention group's blocks (the state
        group's blocks live in `make_state_cache`). `num_blocks`: one count for a shared pool,
        or one per group (the attention group's is used)."""
        attention = [(g.spec.block_size, n) for g, n in zip(
            layout.groups, [num_blocks] * layout.num_groups if isinstance(num_blocks, int)
            else num_blocks) if not isinstance(g.spec, MambaSpec)]
        sizes = {size for size, _ in attention}
        if len(sizes) != 1:
            raise ValueError(f"a GDN hybrid needs exactly one attention block size, got {sizes}")
        return self.make_kv_cache(attention[0][1], sizes.pop())

    def make_kv_cache(self, num_blocks: int, block_size: int) -> PagedKVCache:
        """KV blocks for the full-attention layers only."""
        return PagedKVCache(max(1, self.num_kv_layers), num_blocks, block_size,
                            self.config.num_key_value_heads, self.config.head_dim,
                            self.dtype, self.device)

    def make_state_cache(self, num_blocks: int) -> PagedStateCache:
        """One conv + recurrent state per linear layer and block id."""
        c = self.config
        return PagedStateCache(max(1, len(c.linear_layers)), num_blocks, c.conv_dim,
                               c.linear_conv_kernel_dim, c.linear_num_value_heads,
                               c.linear_key_head_dim, c.linear_value_head_dim, self.dtype,
                               self.device)

    def plan_state(self, cache: PagedStateCache, query_lens: Sequence[int],
                   seq_lens: Sequence[int], state_tables: Sequence[Sequence[int]], unit: int,
                   record: Sequence[bool] | None = None) -> StatePlan:
        """The linear layers' plan of one forward (`plan_for`)."""
        return plan_for(cache, query_lens, seq_lens, state_tables, unit, record)

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens] int64
        positions: torch.Tensor,  # [num_tokens] int64
        kv_cache: PagedKVCache,
        metadata: AnyAttentionMetadata,
        aux_layers: Sequence[int] = (),
        inputs_embeds: torch.Tensor | None = None,  # [num_tokens, hidden]
        state: StatePlan | None = None,
    ) -> ModelOutput:
        h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos_sin = self.rotary.cos_sin(positions, h.dtype)  # each [n, 1, rotary_dim]
        return self.decode(h, aux_layers,
                           lambda _i, layer, x: layer(x, cos_sin, kv_cache, metadata, state))


def plan_for(cache: PagedStateCache, query_lens: Sequence[int], seq_lens: Sequence[int],
             state_tables: Sequence[Sequence[int]], unit: int,
             record: Sequence[bool] | None = None) -> StatePlan:
    """The StatePlan of a batch laid out as `AttentionMetadata` (request r computes positions
    [seq_lens[r] - query_lens[r], seq_lens[r])), from each request's Mamba-group block table
    (block i covers tokens [i * unit, (i + 1) * unit)). See state_cache.py for the rule."""
    segments: list[StateSegment] = []
    row = 0
    for r, (q, s, table) in enumerate(zip(query_lens, seq_lens, state_tables)):
        start = s - q
        read = table[(start - 1) // unit] if start > 0 else None
        if record is not None and record[r]:
            segments.append(StateSegment(row, q, read, (), True))
        else:
            points = [b for b in range(start // unit * unit + unit, s, unit) if b > start]
            checkpoints = [(b - start, table[b // unit - 1]) for b in points]
            checkpoints.append((q, table[(s - 1) // unit]))
            segments.append(StateSegment(row, q, read, tuple(checkpoints)))
        row += q
    return StatePlan(cache, segments)
