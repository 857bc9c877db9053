"""`speckv bench cache`: per-request cost of prefix lookup + allocation + free.

A long prompt is cached once; then each timed round is what the scheduler does for a repeated
request: `get_computed_blocks` (the hit), `allocate_slots` (touch the hit, allocate the rest),
and `free`. Hashing is excluded (requests are built before timing), so this isolates the cache.
Prints the median per-request cost in microseconds per block size.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from rich.console import Console
from rich.table import Table

from speckv.cache import FullAttentionSpec, KVCacheManager
from speckv.engine.request import BlockHashing, Request
from speckv.hashing.functions import get_hash_algo, make_none_hash
from speckv.spec.policy import make_drafter_policy, resolve_hash_mode


def measure(prompt_len: int, block_size: int, num_rounds: int) -> dict[str, float]:
    hash_mode = resolve_hash_mode(make_drafter_policy("eagle"))
    algo = get_hash_algo("sha256")
    hashing = BlockHashing(algo, make_none_hash(algo, "0"), block_size,
                           [hash_mode.lookahead_tokens])
    num_blocks = 2 * prompt_len // block_size + 16
    manager = KVCacheManager([FullAttentionSpec(block_size)], num_blocks, hash_mode)
    rng = random.Random(0)
    prompt = [rng.randrange(32000) for _ in range(prompt_len)]
    first = Request("warm", prompt, hashing, max_tokens=4)
    first.append_output_token_ids([1])  # the first sampled token completes the last block
    manager.allocate_slots(first, prompt_len)
    first.num_computed_tokens = prompt_len
    manager.finish(first)
    requests = [Request(f"r{i}", prompt, hashing) for i in range(num_rounds)]
    lookups, allocs, frees = [], [], []
    hit_tokens = 0
    for request in requests:
        t0 = time.perf_counter()
        hit = manager.get_computed_blocks(request)
        t1 = time.perf_counter()
        allocation = manager.allocate_slots(
            request, request.num_tokens - hit.num_computed_tokens, hit, 3
        )
        t2 = time.perf_counter()
        request.num_computed_tokens = request.num_tokens
        manager.free(request)
        t3 = time.perf_counter()
        assert allocation is not None
        hit_tokens = hit.num_computed_tokens
        lookups.append(t1 - t0)
        allocs.append(t2 - t1)
        frees.append(t3 - t2)
    manager.check_integrity()
    lookup_us = statistics.median(lookups) * 1e6
    alloc_us = statistics.median(allocs) * 1e6
    free_us = statistics.median(frees) * 1e6
    return {"prompt_len": prompt_len, "block_size": block_size, "hit_tokens": hit_tokens,
            "lookup_us": lookup_us, "allocate_us": alloc_us, "free_us": free_us,
            "total_us": lookup_us + alloc_us + free_us}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-len", type=int, default=128 * 1024)
    parser.add_argument("--block-sizes", default="16,128,1024")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    block_sizes = [int(size) for size in args.block_sizes.split(",")]
    if args.prompt_len < 2 or any(size <= 0 for size in block_sizes) or args.rounds < 1:
        raise ValueError("need --prompt-len >= 2, positive --block-sizes and --rounds >= 1")
    rows = [measure(args.prompt_len, size, args.rounds) for size in block_sizes]
    if args.json:
        print(json.dumps(rows))
        return 0
    table = Table(title=f"one repeated {args.prompt_len}-token request, median of "
                        f"{args.rounds} (µs)")
    for column in ("block size", "hit tokens", "lookup", "allocate", "free", "total"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(str(row["block_size"]), str(row["hit_tokens"]),
                      f"{row['lookup_us']:.0f}", f"{row['allocate_us']:.0f}",
                      f"{row['free_us']:.0f}", f"{row['total_us']:.0f}")
    Console().print(table)
    return 0
