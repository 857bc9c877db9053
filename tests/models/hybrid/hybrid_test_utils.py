"""Helpers for GDN hybrid tests: tiny HF configs of both families, one request's forward over
paged KV + paged state (prefill in pieces, decode token by token)."""

from __future__ import annotations

from typing import Any

import torch

from speckv.attention import AttentionMetadata
from speckv.models.hybrid.model import HybridForCausalLM, plan_for

TINY_HF: dict[str, Any] = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    full_attention_interval=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)


def hf_hybrid(family: str, seed: int = 0, **overrides: Any) -> Any:
    """A tiny random transformers model of `family` (qwen3_next | qwen3_5 | qwen3_5_moe; MoE
    via overrides like num_experts=4 for qwen3_next), widened init so
    logits are far from zero, with non-trivial norm weights."""
    import transformers

    params = {**TINY_HF, **overrides}
    if family == "qwen3_next":
        params.setdefault("num_experts", 0)
        config = transformers.Qwen3NextConfig(**params)
        model_cls = transformers.Qwen3NextForCausalLM
    elif family == "qwen3_5_moe":
        params.pop("intermediate_size", None)
        config = transformers.Qwen3_5MoeTextConfig(**params)
        model_cls = transformers.Qwen3_5MoeForCausalLM
    else:
        config = transformers.Qwen3_5TextConfig(**params)
        model_cls = transformers.Qwen3_5ForCausalLM
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log") or name.endswith("dt_bias"):
                continue
            if "norm" in name:
                p.uniform_(-0.3, 0.3) if not name.endswith("linear_attn.norm.weight") \
                    else p.uniform_(0.7, 1.3)
            else:
                p.normal_(0.0, 0.1)
    return model


class OneRequest:
    """One request's paged caches: KV blocks of `block_size`, state blocks of `unit` tokens."""

    def __init__(self, model: HybridForCausalLM, block_size: int = 4, unit: int = 8,
                 num_blocks: int = 256) -> None:
        self.model = model
        self.block_size = block_size
        self.unit = unit
        self.kv = model.make_kv_cache(num_blocks, block_size)
        self.states = model.make_state_cache(num_blocks)
        self.kv_table = list(range(1, num_blocks // 2))
        self.state_table = list(range(num_blocks // 2, num_blocks))
        self.num_computed = 0

    @torch.inference_mode()
    def forward(self, tokens: list[int]):
        q, s = len(tokens), self.num_computed + len(tokens)
        md = AttentionMetadata.build([q], [s], [self.kv_table], self.block_size)
        plan = plan_for(self.states, [q], [s], [self.state_table], self.unit)
        out = self.model(torch.tensor(tokens), md.positions(), self.kv, md, state=plan)
        self.num_computed = s
        return self.model.compute_logits(out.hidden_states)

    def state_block(self, num_tokens: int) -> int:
        """The block holding the state after `num_tokens` tokens."""
        return self.state_table[(num_tokens - 1) // self.unit]
