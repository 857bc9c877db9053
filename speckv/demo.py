"""`speckv demo`: the main job, readable in a terminal in a few seconds.

Shows what lookahead block hashes buy (hit lengths with and without them, on the real cache
manager) and what they cost (block-hash CPU time per format).
"""

from __future__ import annotations

import argparse

from rich.console import Console

from speckv.bench.hit_length import measure_hit_length, print_table


def _prefix_repetition(console: Console) -> None:
    """A short end-to-end run: the user documents' prefix_repetition workload, three modes."""
    import torch

    from speckv.bench.prefix_repetition import RunOptions, render_compact, run_benchmark
    from speckv.bench.workload import PrefixRepetitionConfig, prefix_repetition
    from speckv.engine.llm import load_model
    from speckv.engine.speculative import load_drafter_model

    torch.set_num_threads(1)  # small matmuls on a shared 2-core CPU stall with 2 threads
    model, tokenizer = load_model("builtin", "float32", "cpu", progress=True)
    drafter = load_drafter_model("builtin", model)
    config = PrefixRepetitionConfig(prefix_len=200, suffix_len=30, num_prefixes=3,
                                    output_len=16, num_prompts=12, seed=0)
    workload = prefix_repetition(config, model.config.vocab_size, tokenizer)
    results = run_benchmark(model, drafter, workload,
                            RunOptions(block_size=64, max_concurrency=4, num_spec_tokens=3))
    console.print(render_compact(
        results, "prefix_repetition: 3 prefixes of 200 tokens x 4 prompts, 30-token suffixes, "
                 "16 output tokens, block size 64"))
    console.print(
        "Each prompt shares a 200-token prefix with three others. Without speculation the "
        "cache serves 192 of them (3 blocks of 64); with an EAGLE drafter and legacy hashes "
        "the engine recomputes the last matched block (128); lookahead hashes keep it (192) "
        "and still read exactly the draft KV a cold run writes. (Random-token prompts: the "
        "drafter rarely guesses right, so speculation itself does not pay off here.)"
    )


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
        _prefix_repetition(console)
    console.print("More: speckv bench hit-length | speckv bench hash | speckv bench cache")
    return 0
