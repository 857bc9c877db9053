"""`speckv bench cache`: per-request cost of prefix lookup + allocation + free.

A long prompt is cached once; then each timed round is what the scheduler does for a repeated
request: `get_computed_blocks` (the hit), `allocate_slots` (touch the hit, allocate the rest),
and `free`, then `step_executed` (the scheduler's end of step: it commits the blocks cached in the
step to the successor index that divergent block reuse reads). Hashing is excluded (requests
are built before timing), so this isolates the cache.
Prints the median per-request cost in microseconds per group layout, single-group rows first,
and each hybrid row's ratio to the single-group row with the same smallest block size.

`--vs-vllm` runs vLLM's KVCacheManager and speckv's on the same requests (one full-attention
group, B = 16, lookahead hashes), a cold miss and a warm hit, and prints the ratios; without
vLLM it prints why and skips (see `vllm_peer.py`).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time

from rich.console import Console
from rich.table import Table

from speckv.bench.vllm_peer import (
    VllmModules,
    init_none_hash,
    load_vllm,
    ratio,
    same_hashes,
    skip_message,
    vllm_manager,
    vllm_request,
)
from speckv.cache import FullAttentionSpec, KVCacheManager
from speckv.cache.drafter_policy import drafter_policy, resolve_hash_mode
from speckv.cache.specs import parse_group_specs
from speckv.engine.request import Request


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
    manager.step_executed()
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
        manager.step_executed()
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


# ---- --vs-vllm: vLLM's KVCacheManager on the same requests ------------------------------------

VS_VLLM_BLOCK_SIZE = 16
VS_VLLM_LOOKAHEAD = 1  # EAGLE's lookahead hashes on both sides


def measure_vs_vllm(vllm: VllmModules, prompt_len: int, num_rounds: int) -> list[dict]:
    """Lookup + allocate + free of one request, one full-attention group of 16-token blocks,
    on vLLM's KVCacheManager and speckv's, side by side (hashing done before timing).

    warm: the prompt was cached once; each round a fresh request repeats it (a full hit).
    cold: each round a prompt neither cache has seen, in a pool whose free blocks hold the
    earlier rounds' cached blocks (so allocating evicts, as in steady state).
    """
    block_size, lookahead = VS_VLLM_BLOCK_SIZE, VS_VLLM_LOOKAHEAD
    seed = init_none_hash(vllm)  # vLLM's NONE_HASH seed: identical hashes on both sides
    hash_mode = resolve_hash_mode(drafter_policy("eagle"))
    num_blocks = 2 * prompt_len // block_size + 16
    rng = random.Random(0)
    prompts = [[rng.randrange(32000) for _ in range(prompt_len)] for _ in range(num_rounds + 1)]
    vllm_hasher = vllm.kv_cache_utils.get_request_block_hasher(block_size, vllm.sha256, lookahead)
    rows = []
    for case in ("cold", "warm"):
        ours = KVCacheManager([FullAttentionSpec(block_size)], num_blocks, hash_mode)
        hashing = ours.block_hashing("sha256", seed)
        theirs = vllm_manager(vllm, block_size, num_blocks, prompt_len + 64, lookahead)
        # cache prompts[0] on both sides
        first = Request("seed", prompts[0], hashing)
        ours.allocate_slots(first, prompt_len)
        first.num_computed_tokens = prompt_len
        ours.finish(first)
        ours.step_executed()
        first_vllm = vllm_request(vllm, "seed", prompts[0], vllm_hasher)
        theirs.allocate_slots(first_vllm, prompt_len)
        first_vllm.num_computed_tokens = prompt_len
        theirs.free(first_vllm)
        if not same_hashes(first.get_block_hashes(lookahead), first_vllm.block_hashes):
            raise AssertionError("speckv and vLLM block hashes differ")
        chosen = [prompts[0]] * num_rounds if case == "warm" else prompts[1:]
        our_requests = [Request(f"r{i}", prompt, hashing) for i, prompt in enumerate(chosen)]
        their_requests = [vllm_request(vllm, f"r{i}", prompt, vllm_hasher)
                          for i, prompt in enumerate(chosen)]
        samples: dict[str, list[float]] = {"vllm": [], "speckv": []}
        hits: dict[str, set[int]] = {"vllm": set(), "speckv": set()}
        was_enabled = gc.isenabled()
        gc.disable()  # as timeit does: no collector pauses inside the timed calls
        try:
            for index in range(num_rounds):
                sides = ("vllm", "speckv") if index % 2 == 0 else ("speckv", "vllm")
                for side in sides:
                    if side == "speckv":
                        seconds, hit = _one_round_speckv(ours, our_requests[index])
                    else:
                        seconds, hit = _one_round_vllm(theirs, their_requests[index])
                    samples[side].append(seconds)
                    hits[side].add(hit)
        finally:
            if was_enabled:
                gc.enable()
        if hits["vllm"] != hits["speckv"] or len(hits["speckv"]) != 1:
            raise AssertionError(f"hit lengths differ: vLLM {hits['vllm']}, "
                                 f"speckv {hits['speckv']}")
        ours.check_integrity()
        vllm_ms = 1e3 * statistics.median(samples["vllm"])
        speckv_ms = 1e3 * statistics.median(samples["speckv"])
        rows.append({"case": case, "prompt_len": prompt_len, "block_size": block_size,
                     "hit_tokens": hits["speckv"].pop(), "vllm_ms": round(vllm_ms, 3),
                     "speckv_ms": round(speckv_ms, 3),
                     "ratio": round(ratio(vllm_ms, speckv_ms), 3)})
    return rows


def _one_round_speckv(manager: KVCacheManager, request: Request) -> tuple[float, int]:
    begin = time.perf_counter()
    hit = manager.get_computed_blocks(request)
    allocation = manager.allocate_slots(request, request.num_tokens - hit.num_computed_tokens,
                                        hit, 3)
    request.num_computed_tokens = request.num_tokens
    manager.free(request)
    manager.step_executed()  # the scheduler's end of step (the successor index commit)
    seconds = time.perf_counter() - begin
    if allocation is None:
        raise AssertionError("speckv could not allocate")
    return seconds, hit.num_computed_tokens


def _one_round_vllm(manager, request) -> tuple[float, int]:
    begin = time.perf_counter()
    blocks, num_hit_tokens, _ = manager.get_computed_blocks(request)
    allocation = manager.allocate_slots(request, request.num_tokens - num_hit_tokens,
                                        num_hit_tokens, blocks, 3)
    request.num_computed_tokens = request.num_tokens
    manager.free(request)
    seconds = time.perf_counter() - begin
    if allocation is None:
        raise AssertionError("vLLM could not allocate")
    return seconds, num_hit_tokens


def run_vs_vllm(args: argparse.Namespace, num_rounds: int) -> int:
    vllm, reason = load_vllm()
    if vllm is None:
        Console(stderr=bool(args.json)).print(skip_message(reason))
        return 0
    rows = measure_vs_vllm(vllm, args.prompt_len, num_rounds)
    if args.json:
        print(json.dumps({"vllm_version": vllm.version, "rows": rows}))
        return 0
    table = Table(title=f"lookup + allocate + free of one {args.prompt_len}-token request, one "
                        f"full-attention group, B={VS_VLLM_BLOCK_SIZE}, lookahead hashes, "
                        f"median of {num_rounds} (ms): vLLM {vllm.version} vs speckv",
                  title_justify="left")
    for column in ("case", "hit tokens", "vLLM", "speckv", "x (vLLM / speckv)"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["case"], str(row["hit_tokens"]), f"{row['vllm_ms']:.2f}",
                      f"{row['speckv_ms']:.2f}", f"{row['ratio']:.2f}x")
    Console().print(table)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-len", type=int, default=128 * 1024)
    parser.add_argument("--groups", nargs="+",
                        default=["full:16", "full:128", "full:1024",
                                 "full:16,swa:1024:16,mamba:2048"],
                        help="group layouts to measure (see speckv bench hit-length --groups)")
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--quick", action="store_true", help="5 rounds")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--vs-vllm", action="store_true",
                        help="also run vLLM's KVCacheManager on the same requests (cold miss and "
                             "warm hit; needs vllm importable, skipped with a message otherwise)")


def run(args: argparse.Namespace) -> int:
    if args.prompt_len < 2 or args.rounds < 1:
        raise ValueError("need --prompt-len >= 2 and --rounds >= 1")
    num_rounds = 5 if args.quick else args.rounds
    if getattr(args, "vs_vllm", False):
        return run_vs_vllm(args, num_rounds)
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
