"""Reference single-request greedy generation over the paged cache (no scheduler).

Owns a minimal, engine-free decode loop used by the built-in model check, the tests and
quick benchmarks: contiguous block table, chunked prefill, then one token per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from speckv.attention import AttentionMetadata
from speckv.models.llama.model import LlamaForCausalLM


@torch.inference_mode()
def greedy_generate(
    model: LlamaForCausalLM,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    block_size: int = 16,
    prefill_chunk_tokens: int = 512,
) -> list[int]:
    """Greedy continuation of `prompt_ids` (returns only the new tokens)."""
    if not prompt_ids:
        raise ValueError("prompt_ids must not be empty")
    total = len(prompt_ids) + max_new_tokens
    num_blocks = -(-total // block_size) + 1
    kv = model.make_kv_cache(num_blocks=num_blocks, block_size=block_size)
    table = list(range(1, num_blocks))  # block 0 stays the null block
    device = model.device
    tokens = list(prompt_ids)
    out: list[int] = []
    done = 0  # tokens whose KV is in the cache
    while len(out) < max_new_tokens:
        new = tokens[done : done + prefill_chunk_tokens]
        seq_len = done + len(new)
        md = AttentionMetadata.build([len(new)], [seq_len], [table], block_size, device)
        ids = torch.tensor(new, dtype=torch.int64, device=device)
        hidden = model(ids, md.positions(), kv, md).hidden_states  # [len(new), hidden]
        done = seq_len
        if done < len(tokens):
            continue  # still prefilling
        nxt = int(model.compute_logits(hidden[-1:]).argmax(-1).item())
        out.append(nxt)
        tokens.append(nxt)
        if nxt in stop_token_ids:
            break
    return out
