"""`hybrid-swa`: a tiny random-init Gemma 3-style model (sliding-window + global layers) that
the engine, `generate` and the benches run like the built-in model, without any download.

Owns its fixed shape and seed and its tokenizer (the built-in SmolLM2 tokenizer when it is
installed, so text prompts and the chat template work; the vocabulary follows it). The weights
are RANDOM (seeded): its text is noise; it exists to run sliding-window KV groups, prefix
caching and speculation end to end on real tensors. Everything that prints about it says so.

    12 layers: (5 sliding, window 128 : 1 global) x 2, hidden 256, 4 heads / 2 KV heads of 64
"""

from __future__ import annotations

import torch

from speckv.models.common.tokenizer import Tokenizer
from speckv.models.gemma.gemma3 import GemmaForCausalLM, tiny_gemma_config
from speckv.models.llama.builtin import builtin_tokenizer

HYBRID_SWA_NAME = "hybrid-swa"
RANDOM_INIT_NOTE = "hybrid-swa: tiny Gemma-3-style model with RANDOM-INIT weights (text is noise)"
SEED = 1515
WINDOW = 128
LAYER_TYPES = (("sliding_attention",) * 5 + ("full_attention",)) * 2


def hybrid_swa_model(
    vocab_size: int = 49_152,
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    eos_token_ids: tuple[int, ...] = (2,),
    **overrides: object,
) -> GemmaForCausalLM:
    """The `hybrid-swa` model (seeded random init), or a variant of its shape."""
    fields: dict[str, object] = dict(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=1024, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, sliding_window=WINDOW, layer_types=LAYER_TYPES,
        num_hidden_layers=len(LAYER_TYPES), max_position_embeddings=8192,
        eos_token_ids=eos_token_ids, final_logit_softcapping=30.0,
    )
    fields.update(overrides)
    torch.manual_seed(SEED)
    # norms random too (Gemma's (1 + w)): exercises every weight, not an identity
    return GemmaForCausalLM.from_config(tiny_gemma_config(**fields), dtype, device,
                                        init_std=0.05, norm_std=0.1)


def load_hybrid_swa(
    dtype: torch.dtype | str = torch.float32,
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> tuple[GemmaForCausalLM, Tokenizer | None]:
    """(model, tokenizer): the built-in model's tokenizer when installed, else None (token-id
    prompts only)."""
    tokenizer = builtin_tokenizer(progress)
    vocab = tokenizer.vocab_size if tokenizer is not None else 49_152
    eos = tuple(tokenizer.eos_token_ids) if tokenizer is not None else (2,)
    return hybrid_swa_model(vocab, dtype, device, eos or (2,)), tokenizer
