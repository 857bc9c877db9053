"""`speckv bench hit-length`: how many prompt tokens a repeated request gets from the cache.

Drives the real KV cache manager: request 1 prefills, decodes a few steps with drafts (some
accepted, some rejected) and finishes; request 2 then arrives with the same prompt and we read
its cached tokens. With `--diverge`, request 2 shares only the first N tokens of request 1's
prompt and then goes on differently (a shared system prompt of N tokens). Without
`--prompt-len` it prints the whole table, both scenarios.

Modes: `lookahead` (lookahead hashes with block reuse at divergence points, the default),
`lookahead-no-reuse` (lookahead hashes alone), `legacy` (legacy hashes + the drop). The
measurement and its table: `speckv/measure/hit_length.py`.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict

from rich.console import Console

from speckv.cache.drafter_policy import DRAFTER_NAMES, drafter_policy
from speckv.cache.specs import parse_group_specs
from speckv.measure.hit_length import (
    MODES,
    HitLengthResult,
    measure_hit_length,
    print_table,
)


def full_table(block_size: int, diverge: bool = False) -> list[HitLengthResult]:
    lengths = sorted({1, block_size // 2, block_size, block_size + 1, 3 * block_size,
                      3 * block_size + 1, 3 * block_size + 2, 4 * block_size + 3,
                      8 * block_size + block_size // 2} - {0})
    drafters = [(name, 1) for name in DRAFTER_NAMES if name != "mtp"]
    drafters += [("mtp", 1), ("mtp", 2), ("mtp", 4)]
    results = []
    for name, modules in drafters:
        modes = MODES if drafter_policy(name, modules).draft_kv_lookahead_tokens else MODES[:1]
        for mode in modes:
            for prompt_len in lengths:
                results.append(measure_hit_length(prompt_len, block_size, name, modules, mode,
                                                  diverge=diverge))
    return results


HYBRID_ROWS = ("full:16,mamba:544", "full:16,swa:128:16", "full:16,swa:64:16,mamba:64")


def hybrid_table() -> list[HitLengthResult]:
    """A hybrid attention + Mamba model (U = 544) and mixes with sliding windows."""
    results = []
    for groups_text in HYBRID_ROWS:
        specs = parse_group_specs(groups_text)
        unit = math.lcm(*(spec.block_size for spec in specs))
        lengths = (1367,) if unit == 544 else (unit + 1, 3 * unit, 5 * unit + 7)
        for name, modules, mode in (("none", 1, "lookahead"), ("mtp", 1, "legacy"),
                                    ("mtp", 1, "lookahead"), ("mtp", 3, "lookahead")):
            for prompt_len in lengths:
                results.append(measure_hit_length(prompt_len, 16, name, modules, mode,
                                                  groups=specs))
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompt-len", type=int, help="N; omit for the whole table")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--drafter", default="eagle", choices=DRAFTER_NAMES)
    parser.add_argument("--mtp-num-modules", type=int, default=1,
                        help="draft modules of --drafter mtp (default: %(default)s)")
    parser.add_argument("--mode", choices=MODES, default="lookahead",
                        help="lookahead: with block reuse at divergence points; "
                        "lookahead-no-reuse: without it; legacy = disable_lookahead_block_hashes")
    parser.add_argument("--diverge", action="store_true",
                        help="the 2nd request shares only the first N tokens, then differs")
    parser.add_argument("--groups", help="hybrid KV cache groups, e.g. "
                        "full:16,swa:1024:16,mamba:544 (kind:block_size, swa:window:block_size)")
    parser.add_argument("--retention", type=int, default=None,
                        help="retention interval R for sliding-window / Mamba tails "
                        "(omit: dense; 0: only the prompt's boundary)")
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    if args.block_size <= 0:
        raise ValueError(f"--block-size must be > 0, got {args.block_size}")
    groups = parse_group_specs(args.groups) if args.groups else None
    if args.prompt_len is not None:
        if args.prompt_len <= 0:
            raise ValueError(f"--prompt-len must be > 0, got {args.prompt_len}")
        result = measure_hit_length(args.prompt_len, args.block_size, args.drafter,
                                    args.mtp_num_modules, args.mode, groups=groups,
                                    retention_interval=args.retention, diverge=args.diverge)
        if args.json:
            print(json.dumps(asdict(result)))
        else:
            print_table([result], Console())
        return 0
    results = full_table(args.block_size)
    diverging = full_table(args.block_size, diverge=True)
    hybrid = hybrid_table()
    if args.json:
        print(json.dumps([asdict(r) for r in results + diverging + hybrid]))
    else:
        console = Console()
        print_table(results, console)
        print_table(diverging, console)
        print_table(hybrid, console)
    return 0 if all(r.hit_tokens == r.expected_tokens
                    for r in results + diverging + hybrid) else 1
