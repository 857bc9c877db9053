"""The sliding-window retention scenario of `speckv bench retention` on real tensors.

Owns running `retention.py`'s four requests through the real engine (`LLMEngine`, the real
runner and paged KV) on a `hybrid-swa`-shaped model (random-init Gemma 3 style: global layers
in a full-attention group of block 32, sliding layers in a window group of block 16, window W,
so U = 32), or on a tiny random-init Gemma 4 (`scenario_gemma4_model`), with a random-init
MTP drafter (1 module, 3 speculative tokens) for the MTP rows and a random-init Gemma 4 MTP
assistant (no draft KV: it reads the target's) for the gemma4_mtp rows, and checking every
hit: right after a request's first step, the KV its hit holds (each group's layers over the
blocks the group keeps; the drafter's KV over [0, h)) must equal a cold run of that prompt on
a fresh engine within fp32 rounding (`HIT_KV_ROUNDING`), not bit for bit: a hit block may have
been written by an earlier request's forward from its own hit on (after a fall-back to an
earlier checkpoint, say), over fewer rows than the cold run's forward of the whole prompt, and
CPU matmul kernels round different row counts differently. The cached-token row must equal the
simulator's.

    hit check per request:  target KV max |diff| (both groups), draft KV max |diff|
    draft KV is compared with lookahead hashes only: under the legacy drop, a chain stitched
    from two requests' blocks keeps the first copy's draft KV (the drop promises target KV)
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from speckv.cache.retention import TailWidening
from speckv.cache.specs import FullAttentionSpec, SlidingWindowSpec
from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import SamplingParams
from speckv.models.common.kv_layout import KVCacheGroup, KVCacheLayout
from speckv.simulation.group_kv import max_abs_diff, read_group_kv

FULL_BLOCK = 32
SWA_BLOCK = 16
# max |diff| of a hit's KV vs a cold run's that fp32 rounding explains (KV of magnitude ~1-10;
# a stale or misplaced block is off by O(1))
HIT_KV_ROUNDING = 1e-4


@dataclass(frozen=True)
class TensorRetentionRow:
    label: str
    hash_mode: str
    cached_tokens: list[int]
    target_max_abs_diff: float  # over every hit of the row, both groups
    draft_max_abs_diff: float | None  # None: not compared (legacy drop)
    num_hit_blocks_checked: int
    num_draft_tokens: int = 0  # drafts the drafter proposed over the four requests


def scenario_prompts(prefix_len: int, num_requests: int = 4) -> list[list[int]]:
    """The simulator's prompts (same seed, same draws): P + A, P + B, P + A[:40] + C, P + A."""
    rng = random.Random(0)
    prefix = [rng.randrange(1, 32000) for _ in range(prefix_len)]

    def fresh(count: int) -> list[int]:
        return [rng.randrange(1, 32000) for _ in range(count)]

    suffix_a = fresh(64)
    prompts = [prefix + suffix_a, prefix + fresh(64), prefix + suffix_a[:40] + fresh(24),
               prefix + suffix_a]
    return prompts[:num_requests]


def scenario_model(window: int):
    """The `hybrid-swa` shape with window `window` (random init; vocabulary 32,000)."""
    from speckv.models.gemma.hybrid_swa import hybrid_swa_model

    return hybrid_swa_model(vocab_size=32000, sliding_window=window)


def scenario_gemma4_model(window: int):
    """A tiny random-init Gemma 4 (vocabulary 32,000): 12 layers, 5 sliding : 1 global, global
    layers of another head size with K = V, per-layer inputs, the last 2 layers KV-shared."""
    from speckv.models.common.config import ModelConfig
    from speckv.models.gemma.gemma4 import Gemma4Config, Gemma4ForCausalLM

    kinds = (("sliding_attention",) * 5 + ("full_attention",)) * 2
    base = ModelConfig(vocab_size=32000, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=len(kinds), num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, architecture="gemma4",
                       rope_theta=1_000_000.0, max_position_embeddings=8192, qk_norm=True,
                       sliding_window=window, layer_types=kinds, eos_token_ids=(1,))
    config = Gemma4Config(base=base, global_head_dim=32, global_kv_heads=1,
                          attention_k_eq_v=True, global_partial_rotary_factor=0.25,
                          hidden_size_per_layer_input=8, vocab_size_per_layer_input=32000,
                          num_kv_shared_layers=2, final_logit_softcapping=30.0)
    torch.manual_seed(1515)
    return Gemma4ForCausalLM.from_config(config, init_std=0.05)


def scenario_layout(model) -> KVCacheLayout:
    """The model's own groups (KV-owning layers only) with blocks of 32 (full) and 16 (SWA)."""
    groups = []
    for group in model.kv_cache_layout(FULL_BLOCK).groups:
        window = getattr(group.spec, "sliding_window", None)
        spec = FullAttentionSpec(FULL_BLOCK) if window is None else SlidingWindowSpec(
            SWA_BLOCK, window)
        groups.append(KVCacheGroup(spec, group.layer_indices))
    return KVCacheLayout(tuple(groups))


def _engine(model, drafter, legacy: bool, widening: TailWidening, prefix_len: int,
            retention: int) -> LLMEngine:
    spec = {} if drafter is None else {
        "speculative_method": drafter.speculative_method,
        "num_spec_tokens": 3, "adaptive_speculation": False}  # MTP3: 3 drafts every step
    config = engine_config(block_size=FULL_BLOCK, num_blocks=8 * prefix_len // 16 + 256,
                           max_num_batched_tokens=1 << 20, hash_seed="0",
                           disable_lookahead_block_hashes=legacy, **spec)
    return LLMEngine(model, config, drafter=drafter, detokenize=False,
                     layout=scenario_layout(model), retention_interval=retention,
                     tail_widening=widening)


@torch.inference_mode()
def run_tensor_scenario(model, drafter, legacy: bool, widening: TailWidening, prefix_len: int,
                        retention: int, label: str) -> TensorRetentionRow:
    """The four requests, one after the other, on one engine; each hit checked against a
    cold run on a fresh engine."""
    engine = _engine(model, drafter, legacy, widening, prefix_len, retention)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    cached, target_diff, draft_diff, checked, drafts = [], 0.0, 0.0, 0, 0
    # the Gemma 4 assistant has no draft KV to compare
    check_draft = drafter is not None and not legacy and drafter.num_kv_layers > 0
    for index, prompt in enumerate(scenario_prompts(prefix_len)):
        request_id = f"req{index}"
        engine.add_request(prompt, params, request_id)
        engine.step()
        num_hit = engine.get_request(request_id).num_cached_tokens
        cached.append(num_hit)
        if num_hit:
            hit = read_group_kv(engine, engine.manager.get_block_ids(request_id), num_hit)
            cold = _engine(model, drafter, legacy, widening, prefix_len, retention)
            cold.add_request(prompt, params, "cold")
            cold.step()
            cold_kv = read_group_kv(cold, cold.runner.block_tables("cold"), num_hit,
                                    hit.block_indices)
            target, draft = max_abs_diff(hit, cold_kv)
            target_diff = max(target_diff, target)
            if check_draft:
                draft_diff = max(draft_diff, draft)
            checked += sum(len(indices) for indices in hit.block_indices)
        while engine.has_unfinished_requests():
            drafts += sum(out.num_draft_tokens for out in engine.step() if out.finished)
        engine.manager.check_integrity()
    return TensorRetentionRow(label, engine.hash_mode.label, cached, target_diff,
                              draft_diff if check_draft else None, checked, drafts)
