"""`speckv demo`: the main job, readable in a terminal in a few seconds.

Shows what lookahead block hashes buy (hit lengths with and without them, on the real cache
manager) and what they cost (block-hash CPU time per format).
"""

from __future__ import annotations

import argparse

from rich.console import Console

from speckv.bench.hit_length import measure_hit_length, print_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--skip-hash-bench", action="store_true",
                        help="skip the hashing-cost table")
    parser.add_argument("--skip-model", action="store_true",
                        help="skip the built-in model (cache tables only)")


def run(args: argparse.Namespace) -> int:
    console = Console()
    console.rule("[bold]speckv: prefix caching that keeps its hits under speculative decoding")
    console.print(
        "A 1,367-token prompt sent twice, cache unit 544 tokens (the user documents' hybrid "
        "model). An EAGLE/MTP drafter writes a block's last draft KV from the token after the "
        "block; legacy hashes cannot prove it, so engines drop the last unit. Lookahead hashes "
        "put that token in the hash and keep the unit.\n"
    )
    example = [
        measure_hit_length(1367, 544, "none"),
        measure_hit_length(1367, 544, "mtp", 1, "legacy"),
        measure_hit_length(1367, 544, "mtp", 1, "lookahead"),
    ]
    print_table(example, console)
    results = [
        measure_hit_length(prompt_len, 16, drafter, modules, mode)
        for drafter, modules in (("eagle", 1), ("mtp", 4))
        for mode in ("legacy", "lookahead")
        for prompt_len in (17, 48, 49, 136)
    ]
    print_table(results, console)
    if not args.skip_hash_bench:
        from speckv.bench.hash_cost import quick_table

        quick_table(console)
    if not args.skip_model:
        from speckv.engine.demo_section import run_model_demo

        run_model_demo(console)
    console.print("More: speckv bench hit-length | speckv bench hash | speckv bench cache")
    return 0
