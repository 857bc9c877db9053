"""`hybrid-gdn`: a small random-init Qwen3-Next-style Gated DeltaNet hybrid that the engine,
`generate`, `LLM` and the benches run like the built-in model, without any download.

Owns its fixed shape and seed and its tokenizer (the built-in SmolLM2 tokenizer when it is
installed, so text prompts work; the vocabulary follows it). The weights are RANDOM (seeded):
its text is noise; it exists to run GDN state checkpoints, prefix caching and speculation end
to end on real tensors. Everything that prints about it says so.

    6 layers: (2 Gated DeltaNet : 1 gated full attention) x 2, hidden 256, dense MLP 512;
    GDN 2 key heads / 4 value heads of 64; attention 4 heads / 2 KV heads of 64, RoPE on 1/4
"""

from __future__ import annotations

import torch

from speckv.models.common.tokenizer import Tokenizer
from speckv.models.hybrid.loader import tiny_hybrid_config
from speckv.models.hybrid.model import HybridForCausalLM
from speckv.models.llama.builtin import builtin_tokenizer

HYBRID_GDN_NAME = "hybrid-gdn"
RANDOM_INIT_NOTE = ("hybrid-gdn: small Qwen3-Next-style Gated DeltaNet hybrid with RANDOM-INIT "
                    "weights (text is noise)")
SEED = 2026
LAYER_TYPES = ("linear_attention", "linear_attention", "full_attention") * 2


def hybrid_gdn_model(vocab_size: int = 49_152, dtype: torch.dtype | str = torch.float32,
                     device: torch.device | str = "cpu", eos_token_ids: tuple[int, ...] = (2,),
                     **overrides: object) -> HybridForCausalLM:
    """The `hybrid-gdn` model (seeded random init), or a variant of its shape."""
    fields: dict[str, object] = dict(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=512,
        num_hidden_layers=len(LAYER_TYPES), layer_types=LAYER_TYPES, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, partial_rotary_factor=0.25,
        max_position_embeddings=32_768, eos_token_ids=eos_token_ids,
    )
    fields.update(overrides)
    torch.manual_seed(SEED)
    return HybridForCausalLM.from_config(tiny_hybrid_config(**fields), dtype, device,
                                         init_std=0.05)


def load_hybrid_gdn(dtype: torch.dtype | str = torch.float32, device: torch.device | str = "cpu",
                    progress: bool = False) -> tuple[HybridForCausalLM, Tokenizer | None]:
    """(model, tokenizer): the built-in model's tokenizer when installed, else None."""
    tokenizer = builtin_tokenizer(progress)
    vocab = tokenizer.vocab_size if tokenizer is not None else 49_152
    eos = tuple(tokenizer.eos_token_ids) if tokenizer is not None else (2,)
    return hybrid_gdn_model(vocab, dtype, device, eos or (2,)), tokenizer
