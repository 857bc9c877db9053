"""Hybrid models for the P/D tests: a tiny Gated DeltaNet hybrid (full attention + GDN state)
and a tiny Gemma 3-style model (full attention + sliding window), each with per-group KV pools
from a memory budget, their drafters, and what a hit reads of every group (target KV, draft
KV, the sliding window, the GDN state) for comparing a transferred hit with a cold run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from speckv.bench.kv_probe import kv_at
from speckv.cache.specs import MambaSpec, SlidingWindowSpec
from speckv.drafters.gated_mtp import random_gated_mtp
from speckv.drafters.loaders import random_drafter
from speckv.models.gemma.gemma3 import GemmaForCausalLM, tiny_gemma_config
from speckv.models.hybrid.loader import tiny_hybrid
from tests.connectors.nixl.pd_helpers import prompt_of

U = 8  # the GDN state unit (alignment unit of the GDN hybrid)
WINDOW = 10  # the sliding window: ceil((W - 1) / B) = 3 blocks before a hit
# per-group pools from a budget (small batch limits: the pools' fixed parts stay small)
POOLS = {"num_blocks": None, "max_num_seqs": 4, "max_num_batched_tokens": 64}


@dataclass(frozen=True)
class Hybrid:
    name: str
    model: Any
    drafters: dict[str, Any]
    engine_options: dict[str, Any]
    vocab: int

    def prompt(self, length: int, seed: int) -> list[int]:
        return prompt_of(length, seed, self.vocab)


def gdn_model(seed: int = 1234):
    return tiny_hybrid(seed)


def swa_model(seed: int = 8):
    torch.manual_seed(seed)
    config = tiny_gemma_config(vocab_size=64, sliding_window=WINDOW)
    return GemmaForCausalLM.from_config(config, init_std=0.1, norm_std=0.2)


def build_hybrids() -> dict[str, Hybrid]:
    gdn = gdn_model()
    swa = swa_model()
    return {
        "gdn": Hybrid("gdn", gdn, {"mtp2": random_gated_mtp(gdn, num_modules=2),
                                   "mtp1": random_gated_mtp(gdn, num_modules=1)},
                      {"mamba_block_size": U, "kv_cache_memory_bytes": 4 << 20, **POOLS}, 96),
        "swa": Hybrid("swa", swa, {
            "mtp2": random_drafter("mtp", swa, init_std=0.3, seed=2, num_modules=2),
            "eagle3": random_drafter("eagle3", swa, init_std=0.3, seed=3, aux_layers=(0, 2, 4)),
            "eagle": random_drafter("eagle", swa, init_std=0.3, seed=3)},
            {"kv_cache_memory_bytes": 2 << 20, **POOLS}, 64),
    }


def blocks_read(engine, num_hit_tokens: int, num_local_tokens: int = 0) -> int:
    """Blocks of every group a hit of `num_hit_tokens` reads beyond a local hit: every full
    block, the window's blocks, the GDN state at the hit."""
    count = 0
    for spec in engine.layout.specs:
        first, end = num_local_tokens // spec.block_size, num_hit_tokens // spec.block_size
        if isinstance(spec, SlidingWindowSpec):
            first = max(first, end - spec.num_window_blocks)
        elif isinstance(spec, MambaSpec):
            first = max(first, end - 1)
        count += max(0, end - first)
    return count


def hit_tensors(engine, request_id: str, num_tokens: int) -> dict[str, torch.Tensor]:
    """What a hit of `num_tokens` reads, by group: each attention group's target KV at the
    positions it reads (a sliding window: the window's blocks only), the drafter's KV, and the
    GDN conv and recurrent state at the hit. Shapes are the same for any engine of the model."""
    runner, layout = engine.runner, engine.layout
    out: dict[str, torch.Tensor] = {}
    tables = engine.manager.get_block_ids(request_id)
    kv = runner.kv_cache
    for g, group in enumerate(layout.groups):
        spec, table = group.spec, tables[g]
        if isinstance(spec, MambaSpec):
            block = table[num_tokens // spec.block_size - 1]
            conv, recurrent = runner.states.cache.snapshot(block)
            out[f"{g}.conv"], out[f"{g}.recurrent"] = conv, recurrent
            continue
        start = 0
        if isinstance(spec, SlidingWindowSpec):
            start = max(0, num_tokens // spec.block_size - spec.num_window_blocks) \
                * spec.block_size
        caches = getattr(kv, "caches", None)
        if caches is not None:  # one paged KV per group (its own layers, local indices)
            out[f"{g}.target"] = kv_at(caches[g], table, num_tokens, spec.block_size,
                                       None, start)
        elif layout.has_state_group:  # the GDN hybrid's paged KV holds its attention group
            out[f"{g}.target"] = kv_at(kv, table, num_tokens, spec.block_size, None, start)
        else:
            out[f"{g}.target"] = kv_at(kv, table, num_tokens, spec.block_size,
                                       group.layer_indices, start)
    if engine.proposer is not None and engine.proposer.kv_cache is not None:
        out["draft"] = kv_at(engine.proposer.kv_cache, tables[runner.draft_group], num_tokens,
                             engine.config.cache.block_size)
    return out
