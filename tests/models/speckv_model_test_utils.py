"""Helpers for model tests (uniquely named so it never collides with other test dirs' modules)."""

from __future__ import annotations

import torch

from speckv.attention import AttentionMetadata
from speckv.models.common.decoder import ModelOutput
from speckv.models.llama.model import LlamaForCausalLM
from speckv.models.llama.tiny import tiny_model_config

# The shared tiny shape (speckv.models.llama.tiny) with a larger vocabulary and 3 layers, as
# keyword arguments both our ModelConfig and the transformers configs take.
_SHAPE = tiny_model_config(vocab_size=128, intermediate_size=96, num_hidden_layers=3)
TINY = {name: getattr(_SHAPE, name) for name in (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "max_position_embeddings")}


def prefill(
    model: LlamaForCausalLM, ids: list[int], block_size: int = 4, aux_layers: tuple[int, ...] = ()
) -> ModelOutput:
    """One request, whole prompt in one forward, shuffled (non-contiguous) block table."""
    num_blocks = -(-len(ids) // block_size)
    perm = torch.randperm(num_blocks + 5, generator=torch.Generator().manual_seed(0)) + 1
    table = perm[:num_blocks].tolist()  # block 0 (null) never used
    kv = model.make_kv_cache(num_blocks=num_blocks + 6, block_size=block_size)
    md = AttentionMetadata.build([len(ids)], [len(ids)], [table], block_size)
    with torch.inference_mode():
        return model(torch.tensor(ids), md.positions(), kv, md, aux_layers=aux_layers)


def widen_init(module: torch.nn.Module, std: float = 0.15, seed: int = 0) -> None:
    """Re-init with a larger std so attention patterns and RoPE matter for the logits."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(std * torch.randn(p.shape, generator=gen))
