"""Run inside a vLLM venv: vLLM's own `KVCacheManager` (prefix caching, the EAGLE drop, its
free-block queue) and speckv's `PoolMirror` driven by the same seeded interleaving of requests
scheduled and finished; prints, as JSON, every request whose hit the mirror predicted
differently from vLLM's, and the mirror's corrections from vLLM's BlockRemoved events.

    python tests/router/vllm_pool_driver.py SEED [NUM_STEPS]
"""

from __future__ import annotations

import json
import random
import sys

import torch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request

from speckv.events.schema import BlockRemoved, BlockStored, KVEventBatch, low64
from speckv.router.contract import HitRule
from speckv.router.pool_mirror import PoolMirror, PoolShape

BLOCK_SIZE, NUM_BLOCKS, LOOKAHEAD = 16, 40, 3


def _event(event: object) -> BlockStored | BlockRemoved:
    """One of vLLM's KV events as speckv's schema reads it off the wire."""
    hashes = [low64(h) for h in event.block_hashes]
    if type(event).__name__ == "BlockRemoved":
        return BlockRemoved(block_hashes=hashes, medium=None)
    return BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=event.token_ids,
                       block_size=event.block_size, lora_id=None, medium=None, lora_name=None)


def main(seed: int, num_steps: int) -> dict:
    rng = random.Random(seed)
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["layer.0"], FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=8, dtype=torch.float32))])
    manager = KVCacheManager(config, max_model_len=1024, scheduler_block_size=BLOCK_SIZE,
                             hash_block_size=BLOCK_SIZE, enable_caching=True, use_eagle=True,
                             enable_kv_cache_events=True)
    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK_SIZE, sha256)
    mirror = PoolMirror(PoolShape(NUM_BLOCKS, BLOCK_SIZE, LOOKAHEAD))
    rule = HitRule(BLOCK_SIZE, 0, drops_last_unit=True, prefix_caching=True)
    prefixes = [[rng.randrange(1000) for _ in range(rng.choice((32, 48, 64, 80)))]
                for _ in range(5)]
    running: list[tuple[Request, int]] = []  # (request, output tokens to come)
    mismatches, scheduled = [], 0
    for step in range(num_steps):
        free = manager.block_pool.get_num_free_blocks()
        if running and (rng.random() < 0.45 or free < 12):
            request, num_output = running.pop(rng.randrange(len(running)))
            for _ in range(num_output - 1):  # decode: one token a step, then its slots
                assert manager.allocate_slots(request, 1, num_lookahead_tokens=LOOKAHEAD)
                request.num_computed_tokens += 1
                request.append_output_token_ids(rng.randrange(1000))
            manager.free(request)
            mirror.finish(request.request_id, num_output)
        else:
            prompt = rng.choice(prefixes) + [rng.randrange(1000)
                                             for _ in range(rng.randrange(1, 40))]
            request = Request(f"r{step}", prompt, SamplingParams(max_tokens=64), None,
                              block_hasher=hasher)
            keys = [low64(h) for h in request.block_hashes]
            predicted = rule.cached_tokens(mirror.matched_blocks(keys), len(prompt))
            blocks, num_hit = manager.get_computed_blocks(request)[:2]
            if num_hit != predicted:
                mismatches.append({"step": step, "predicted": predicted, "vllm": num_hit})
            assert manager.allocate_slots(request, len(prompt) - num_hit, num_hit, blocks,
                                          num_lookahead_tokens=LOOKAHEAD)
            request.num_computed_tokens = len(prompt)
            request.append_output_token_ids(rng.randrange(1000))
            mirror.schedule(request.request_id, keys, len(prompt), num_hit)
            running.append((request, rng.randrange(1, 40)))
            scheduled += 1
        mirror.apply_batch(KVEventBatch(ts=0.0, events=[
            _event(event) for event in manager.take_events()]))
    return {"scheduled": scheduled, "mismatches": mismatches,
            "corrections": mirror.corrections}


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 400)))
