"""`speckv demo`: the main job, about a minute on a 2-core CPU.

Shows what lookahead block hashes buy (hit lengths with and without them, on the real cache
manager), what they cost (block-hash CPU time per format), the built-in model (EAGLE3
speculation where it pays), a short end-to-end prefix_repetition run in three modes (with its
chart, prefix_repetition.png in --output-dir), and the same
chat request sent twice to `speckv serve` (cached_tokens of both).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from rich.console import Console

from speckv.cache.specs import parse_group_specs
from speckv.measure.hit_length import measure_hit_length, print_table


def _hashing_cost(console: Console) -> None:
    """The hashing-cost mini table, folded to fit 80 columns: one row per format, one column
    per block size (text prompt of 32K+1 tokens)."""
    from rich.table import Table

    from speckv.measure.hash_cost import ALGO_NAME, DEMO, METHODS, NAIVE, measure

    rows = measure(DEMO)
    names = {"legacy": "legacy", "nested": "nested", "expanded": "expanded window",
             "adopted": "adopted (lookahead L=1)", NAIVE: "naive adopted (x = naive/adopted)"}
    table = Table(title=f"hashing a {rows[0].case.prompt_label}-token prompt once, {ALGO_NAME}, "
                        "ms (% vs legacy)", title_justify="left")
    table.add_column("format")
    for row in rows:
        table.add_column(f"B={row.case.block_size}", justify="right")
    for method in METHODS:
        cells = []
        for row in rows:
            ms = row.ms[method]
            if method == "legacy":
                cells.append(f"{ms:.3f}")
            elif method == NAIVE:
                cells.append(f"{ms:.3f} ({row.naive_speedup:.1f}x)")
            else:
                cells.append(f"{ms:.3f} ({row.pct_vs_legacy(method):+.1f}%)")
        table.add_row(names[method], *cells)
    console.print(table)
    console.print(f"[dim]{DEMO.description}; full table: speckv bench hash[/dim]")


def _prefix_repetition(console: Console, output_dir: Path) -> None:
    """A short end-to-end run of vLLM's prefix_repetition workload, three modes."""
    import torch

    from speckv.engine.llm import load_model
    from speckv.engine.speculative import load_drafter_model
    from speckv.measure.prefix_repetition import (
        RunOptions,
        render_compact,
        run_modes,
        write_chart,
    )
    from speckv.workloads import PrefixRepetitionConfig, prefix_repetition

    torch.set_num_threads(1)  # small matmuls on a shared 2-core CPU stall with 2 threads
    model, tokenizer = load_model("builtin", "float32", "cpu", progress=True)
    drafter = load_drafter_model("builtin", model)
    config = PrefixRepetitionConfig(prefix_len=200, suffix_len=30, num_prefixes=3,
                                    output_len=16, num_prompts=12, seed=0)
    block_size = 64
    workload = prefix_repetition(config, model.config.vocab_size, tokenizer)
    results = run_modes(model, drafter, workload,
                        RunOptions(block_size=block_size, max_concurrency=4,
                                   num_spec_tokens=3))
    workload_text = (f"prefix_repetition: {config.num_prefixes} prefixes of "
                     f"{config.prefix_len} tokens x {config.num_prompts // config.num_prefixes} "
                     f"prompts, {config.suffix_len}-token suffixes, {config.output_len} output "
                     f"tokens, block size {block_size}")
    console.print(render_compact(results, workload_text))
    output_dir.mkdir(parents=True, exist_ok=True)
    chart = output_dir / "prefix_repetition.png"
    write_chart(results, chart, workload_text)
    console.print(f"chart: {chart}")
    # the prefix is not block aligned, so its last whole block's successor is still shared
    shared = config.prefix_len // block_size * block_size
    console.print(
        f"Each prompt shares a {config.prefix_len}-token prefix with others. Without "
        f"speculation the cache serves {shared} of them; with an EAGLE3 drafter and legacy "
        f"hashes the engine recomputes the last matched block ({shared - block_size}); "
        f"lookahead hashes keep it ({shared}) and still read exactly the draft KV a cold run "
        "writes. (Random-token prompts: the drafter rarely guesses right, so speculation "
        "itself does not pay off here.)"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--skip-hash-bench", action="store_true",
                        help="skip the hashing-cost table")
    parser.add_argument("--skip-model", action="store_true",
                        help="skip the built-in model (cache tables only)")
    parser.add_argument("--output-dir", type=Path,
                        default=Path(tempfile.gettempdir()) / "speckv-demo",
                        help="where the demo writes its chart (prefix_repetition.png)")


def run(args: argparse.Namespace) -> int:
    console = Console()
    console.rule("[bold]speckv: prefix caching that keeps its hits under speculative decoding")
    console.print(
        "A 1,367-token prompt sent twice to a hybrid model (attention blocks of 16 tokens and "
        "Mamba state every 544, so the cache unit is 544 tokens). An EAGLE/MTP drafter writes "
        "a block's last draft KV from the token after the block; legacy hashes cannot prove "
        "it, so engines drop the last unit. Lookahead hashes put that token in the hash and "
        "keep the unit.\n"
    )
    hybrid = parse_group_specs("full:16,mamba:544")  # attention + Mamba, U = 544
    example = [
        measure_hit_length(1367, 16, drafter, 1, mode, groups=hybrid)
        for drafter, mode in (("none", "lookahead"), ("mtp", "legacy"), ("mtp", "lookahead"))
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
        _hashing_cost(console)
    if not args.skip_model:
        from speckv.commands.demo_model import run_model_demo

        run_model_demo(console)
        _prefix_repetition(console, args.output_dir)
        from speckv.commands.demo_server import run_server_demo

        if not run_server_demo(console):
            return 1
    console.print("More: speckv serve | speckv bench serve | speckv bench hit-length | "
                  "speckv bench hash | speckv bench cache")
    return 0
