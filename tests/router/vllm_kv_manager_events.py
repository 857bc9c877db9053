"""Run inside vLLM's venv (not a test module): vLLM's own KVCacheManager over a KV cache layout
given on the command line, serving a random prefix workload under block pressure; prints one
JSON line with the layout's hash_block_size, then per request the KV events vLLM published
before its lookup (msgpack as vLLM's ZMQ publisher sends them, hex) and the hit vLLM's
coordinator served. `tests/router/test_vllm_hybrid.py` replays them through the router.

    python vllm_kv_manager_events.py full:16,swa:16:40,mamba:16 SEED [STEPS] [NUM_BLOCKS]
"""

from __future__ import annotations

import json
import math
import random
import sys

import msgspec
import torch
from vllm.distributed.kv_events import KVEventBatch
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request


def group_spec(part: str):
    kind, *rest = part.split(":")
    size = int(rest[0])
    if kind == "mamba":  # mode "all": a state per block, hashed at the block size
        return MambaSpec(block_size=size, shapes=((4,),), dtypes=(torch.float32,),
                         mamba_cache_mode="all")
    common = {"block_size": size, "num_kv_heads": 1, "head_size": 8, "dtype": torch.float32}
    if kind == "swa":
        return SlidingWindowSpec(sliding_window=int(rest[1]), **common)
    return FullAttentionSpec(**common)


def main() -> None:
    layout, seed = sys.argv[1], int(sys.argv[2])
    steps = int(sys.argv[3]) if len(sys.argv) > 3 else 80
    num_blocks = int(sys.argv[4]) if len(sys.argv) > 4 else 40
    specs = [group_spec(part) for part in layout.split(",")]
    sizes = [spec.block_size for spec in specs]
    # vLLM's resolve_kv_cache_block_sizes: the LCM aligns hits; blocks are hashed every GCD
    # tokens, or every LCM with a Mamba group outside "align" mode
    alignment = math.lcm(*sizes)
    hash_unit = alignment if any(isinstance(s, MambaSpec) for s in specs) else math.gcd(*sizes)
    hash_fn = get_hash_fn_by_name("sha256")
    init_none_hash(hash_fn)  # PYTHONHASHSEED from the caller
    config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec([f"layer{i}"], spec) for i, spec in enumerate(specs)])
    manager = KVCacheManager(config, max_model_len=1024, scheduler_block_size=alignment,
                             hash_block_size=hash_unit, enable_caching=True,
                             enable_kv_cache_events=True)
    hasher = get_request_block_hasher(hash_unit, hash_fn)
    encoder = msgspec.msgpack.Encoder()
    print(json.dumps({"hash_block_size": hash_unit, "alignment": alignment}))
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 5000) for _ in range(200)] for _ in range(4)]
    running: list[Request] = []
    for step in range(steps):
        prefix = prefixes[rng.randrange(len(prefixes))]
        prompt = prefix[:rng.randrange(1, 200)] + [rng.randrange(1, 5000)
                                                   for _ in range(rng.randrange(4))]
        request = Request(f"r{step}", prompt, SamplingParams(max_tokens=4), None,
                          block_hasher=hasher)
        events = manager.take_events()
        if events:
            print(json.dumps({"events": encoder.encode(KVEventBatch(ts=0.0,
                                                                    events=events)).hex()}))
        blocks, hit, _ = manager.get_computed_blocks(request)
        print(json.dumps({"prompt": prompt, "hit": hit}))
        if manager.allocate_slots(request, len(prompt) - hit, hit, blocks) is None:
            for done in running:  # out of blocks: everything finishes
                manager.free(done)
            running = []
            continue
        running.append(request)
        while len(running) > rng.randrange(1, 4):  # some finish, freeing their blocks
            manager.free(running.pop(0))


if __name__ == "__main__":
    main()
