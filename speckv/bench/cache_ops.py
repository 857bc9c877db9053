"""`speckv bench cache`: per-request cost of prefix lookup + allocation + free.

A long prompt is cached once; then each timed round is what the scheduler does for a repeated
request: `get_computed_blocks` (the hit), `allocate_slots` (touch the hit, allocate the rest),
and `free`. Hashing is excluded (requests are built before timing), so this isolates the cache.
Prints the median per-request cost in microseconds per group layout, single-group rows first,
and each hybrid row's ratio to the single-group row with the same smallest block size.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

from rich.console import Console
from rich.table import Table

from speckv.cache import KVCacheManager
from speckv.cache.specs import parse_group_specs
from speckv.engine.request import Request
from speckv.spec.policy import drafter_policy, resolve_hash_mode


def measure(prompt_len: int, groups: str, num_rounds: int) -> dict:
    hash_mode = resolve_hash_mode(drafter_policy("eagle"))
    specs = parse_group_specs(groups)
    block_size = min(spec.block_size for spec in specs)
    num_blocks = len(specs) * (2 * prompt_len // block_size + 16)
    manager = KVCacheManager(specs, num_blocks, hash_mode)
    hashing = manager.block_hashing("sha256", "0")
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
    return {"prompt_len": prompt_len, "groups": groups, "block_size": block_size,
            "hit_tokens": hit_tokens,
            "lookup_us": lookup_us, "allocate_us": alloc_us, "free_us": free_us,
            "total_us": lookup_us + alloc_us + free_us}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-len", type=int, default=128 * 1024)
    parser.add_argument("--groups", nargs="+",
                        default=["full:16", "full:128", "full:1024",
                                 "full:16,swa:1024:16,mamba:2048"],
                        help="group layouts to measure (see speckv bench hit-length --groups)")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--quick", action="store_true", help="5 rounds")
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    if args.prompt_len < 2 or args.rounds < 1:
        raise ValueError("need --prompt-len >= 2 and --rounds >= 1")
    num_rounds = 5 if args.quick else args.rounds
    rows = [measure(args.prompt_len, groups, num_rounds) for groups in args.groups]
    # the figure: hit lookup + allocation, hybrid versus one group of the same block
    single = {row["block_size"]: row["lookup_us"] + row["allocate_us"]
              for row in rows if "," not in row["groups"]}
    for row in rows:
        base = single.get(row["block_size"])
        row["vs_single_group"] = (row["lookup_us"] + row["allocate_us"]) / base if base else None
    if args.json:
        print(json.dumps(rows))
        return 0
    table = Table(title=f"one repeated {args.prompt_len}-token request, median of "
                        f"{num_rounds} (µs)")
    for column in ("groups", "hit tokens", "lookup", "allocate", "free", "total",
                   "lookup+alloc vs 1 group"):
        table.add_column(column, justify="right", no_wrap=column == "groups")
    for row in rows:
        ratio = row["vs_single_group"]
        table.add_row(row["groups"], str(row["hit_tokens"]),
                      f"{row['lookup_us']:.0f}", f"{row['allocate_us']:.0f}",
                      f"{row['free_us']:.0f}", f"{row['total_us']:.0f}",
                      f"{ratio:.2f}x" if ratio is not None else "-")
    Console().print(table)
    return 0
