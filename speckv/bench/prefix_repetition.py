"""`speckv bench prefix-repetition`: vLLM's prefix_repetition workload end to end on the engine.

Runs one `prefix_repetition` workload (or a JSONL file) through the real engine once per mode:

    no spec      no speculative decoding
    legacy drop  the drafter with legacy block hashes: the last matched block is recomputed
    lookahead    the drafter with lookahead block hashes, without block reuse
    lookahead + block reuse   the engine's default: lookahead hashes, and a block cached
                 under another successor (prompts diverging at a block boundary) is copied
                 and only its last L positions recomputed

and reports, per mode: prefix-cache hit rate (cached prompt tokens / prompt tokens) beside the
workload's oracle for the block size, requests/s, output tokens/s, TTFT mean / median / p99,
TPOT, drafts' acceptance, and whether greedy outputs are identical across modes. Requests
arrive all at once or as a Poisson process, under a concurrency cap.

With `--kv-connector offload` (or `disk`, `offload,disk`) every mode runs with that KV tier
(except "lookahead + block reuse": block reuse does not run under a KV connector)
under the local cache, and one more mode runs lookahead without it ("lookahead, no tier"). Give
a local cache too small to hold the prefixes (`--num-blocks`): the hit rate is then local +
tier (both shown), and with lookahead it reaches the oracle through the tier, as no spec does;
the legacy drop loses one block per hit; without a tier, evicted prefixes are recomputed.

With `--engines N` every mode runs on N engines in N processes
(`speckv/cluster/engine_pool.py`), request i on engine i mod N, one concurrency cap over all of
them. With `--kv-connector store` they share one store: the bench starts the embedded Valkey
server once and points every engine at its URL (or at `--kv-store-url`), and each mode begins by
deleting its namespace from the store. The lookahead hit rate then reaches the single-engine
oracle although no engine saw the other's requests; the legacy drop loses one block per hit;
"lookahead, no tier" (N engines, no store) misses every prefix the other engine computed. Greedy
outputs are identical across modes.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from speckv.bench.multi_engine import run_modes_multi_engine
from speckv.connectors import add_connector_arguments, connector_config_from_args
from speckv.measure.prefix_repetition import (
    MODES,
    ModeResult,
    RunOptions,
    modes_for,
    run_modes,
    write_chart,
)
from speckv.workloads import (
    PrefixRepetitionConfig,
    WorkloadRequest,
    load_jsonl,
    prefix_repetition,
)


def run_benchmark(model: Any, drafter: Any, workload: list[WorkloadRequest],
                  options: RunOptions, modes: tuple[str, ...] = tuple(MODES),
                  model_spec: Any = None) -> list[ModeResult]:
    """Every mode on a fresh engine (`run_modes`); with `options.num_engines` > 1, on that
    many engine processes built from `model_spec` (`engine_workers.ModelSpec`: the same
    weights as `model` and `drafter`)."""
    if options.num_engines == 1:
        return run_modes(model, drafter, workload, options, modes)
    if model_spec is None:
        raise ValueError("--engines > 1 needs a ModelSpec to build the engines' processes")
    return run_modes_multi_engine(model, drafter, model_spec, workload, options,
                                  modes_for(options, modes))


def outputs_identical(results: list[ModeResult]) -> bool:
    return all(r.outputs == results[0].outputs for r in results[1:])


def render(results: list[ModeResult], title: str) -> Table:
    table = Table(title=title)
    table.add_column("metric", no_wrap=True)
    for result in results:
        tier = "" if result.tier == "-" else f"\n+ {result.tier} tier"
        table.add_column(f"{result.mode}\n{result.hash_mode}{tier}", justify="right")

    def row(name: str, fmt, key: str) -> None:
        table.add_row(name, *(fmt(getattr(r, key)) for r in results))

    pct = lambda v: f"{100 * v:.1f}%"  # noqa: E731
    num = lambda v: f"{v:.2f}"  # noqa: E731
    ms = lambda v: f"{v:.0f}"  # noqa: E731
    opt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    row("prefix-cache hit rate", pct, "hit_rate")
    if any(r.tier != "-" for r in results):
        table.add_row("  of it from the local cache",
                      *(pct(r.hit_rate - r.tier_hit_rate) for r in results))
        table.add_row("  of it from the KV tier", *(pct(r.tier_hit_rate) for r in results))
    row("oracle hit rate", pct, "oracle_hit_rate")
    row("requests/s", num, "requests_per_s")
    row("output tokens/s", lambda v: f"{v:.1f}", "output_tokens_per_s")
    row("TTFT mean (ms)", ms, "ttft_mean_ms")
    row("TTFT median (ms)", ms, "ttft_median_ms")
    row("TTFT p99 (ms)", ms, "ttft_p99_ms")
    row("TPOT mean (ms)", ms, "tpot_mean_ms")
    row("acceptance rate", opt, "acceptance_rate")
    row("mean acceptance length", opt, "mean_acceptance_length")
    row("preemptions", str, "num_preemptions")
    return table




def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="builtin", help="'builtin', an HF dir or a .gguf")
    parser.add_argument("--speculative-model", "--draft-model", dest="speculative_model",
                        default="builtin",
                        help="drafter dir (EAGLE / EAGLE3 / MTP) or 'builtin' (the built-in "
                        "model's EAGLE3 head); --draft-model is a deprecated alias")
    parser.add_argument("--prefix-len", type=int, default=200)
    parser.add_argument("--suffix-len", type=int, default=40)
    parser.add_argument("--num-prefixes", type=int, default=4)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=24)
    parser.add_argument("--jsonl", type=Path, help="prompts from a JSONL file instead")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-shuffle", action="store_true")
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests/s, Poisson arrivals (default: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=8)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--kv-cache-mb", type=int, default=256)
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="local KV cache size in blocks (overrides --kv-cache-mb)")
    parser.add_argument("--num-spec-tokens", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES),
                        help=f"comma-separated subset of: {', '.join(MODES)}")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch CPU threads (per engine process with --engines)")
    parser.add_argument("--engines", type=int, default=1,
                        help="engine processes, request i on engine i mod N; with "
                        "--kv-connector store they share one store (default: %(default)s)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--output-dir", type=Path, default=Path("out/prefix-repetition"))
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    add_connector_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import torch

    from speckv.engine.llm import load_model
    from speckv.engine.speculative import load_drafter_model

    modes = tuple(mode.strip() for mode in args.modes.split(","))
    unknown = [mode for mode in modes if mode not in MODES]
    if unknown:
        raise ValueError(f"unknown mode(s) {unknown}; choose from {list(MODES)}")
    if args.threads < 1:
        raise ValueError("--threads must be >= 1")
    if args.engines < 1:
        raise ValueError("--engines must be >= 1")
    torch.set_num_threads(args.threads)
    # every argument is checked before the model loads (seconds)
    config = None
    if args.jsonl is None:
        config = PrefixRepetitionConfig(args.prefix_len, args.suffix_len, args.num_prefixes,
                                        args.output_len, args.num_prompts, args.seed,
                                        not args.no_shuffle)
    elif not args.jsonl.is_file():
        raise FileNotFoundError(f"--jsonl {args.jsonl}: no such file")
    connector = connector_config_from_args(args)
    offload_dir = args.kv_offload_dir
    scratch = None
    if connector is not None and "disk" in connector.names and offload_dir is None:
        scratch = tempfile.TemporaryDirectory(prefix="speckv-prefix-repetition-")
        offload_dir = scratch.name
    options = _run_options(args, connector, offload_dir)
    model, tokenizer = load_model(args.model, args.dtype, "cpu", progress=not args.json)
    if config is None:
        if tokenizer is None:
            raise ValueError("--jsonl with text prompts needs a model with a tokenizer")
        workload = load_jsonl(args.jsonl, tokenizer, args.output_len)
        shape = f"{len(workload)} prompts from {args.jsonl}"
    else:
        workload = prefix_repetition(config, model.config.vocab_size, tokenizer)
        shape = (f"prefix {args.prefix_len} + suffix {args.suffix_len} tokens, "
                 f"{args.num_prefixes} prefixes x {args.num_prompts // args.num_prefixes} "
                 f"prompts, {args.output_len} output tokens")
    drafter = None
    speculative = any(MODES[mode]["speculative"] for mode in modes)
    if speculative:
        drafter = load_drafter_model(args.speculative_model, model)
    from speckv.cluster.engine_pool import ModelSpec

    model_spec = ModelSpec(args.model, args.dtype,
                           args.speculative_model if speculative else None,
                           threads=args.threads)
    try:
        results = run_benchmark(model, drafter, workload, options, modes, model_spec)
    finally:
        if scratch is not None:
            scratch.cleanup()
    identical = outputs_identical(results)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    payload = {"workload": shape, "block_size": args.block_size,
               "kv_connector": args.kv_connector, "num_blocks": args.num_blocks,
               "engines": args.engines,
               "greedy_outputs_identical": identical,
               "modes": [{k: v for k, v in asdict(r).items() if k != "outputs"}
                         for r in results]}
    (args.output_dir / "results.json").write_text(json.dumps(payload, indent=2))
    chart = args.output_dir / "chart.png"
    write_chart(results, chart, f"prefix_repetition: {shape}; B={args.block_size}")
    if args.json:
        print(json.dumps(payload))
        return 0
    console = Console()
    engines = "" if args.engines == 1 else (
        f"; {args.engines} engine processes, requests alternating")
    console.print(render(results, f"prefix_repetition: {shape}; B={args.block_size}, "
                                  f"{args.num_spec_tokens} spec tokens{engines}"))
    console.print(f"greedy outputs identical across modes: {identical}")
    console.print(f"wrote {args.output_dir / 'results.json'} and {chart}")
    return 0


def _run_options(args: argparse.Namespace, connector: Any, offload_dir: str | None
                 ) -> RunOptions:
    """The bench's run options from its flags (`connector`: the parsed `--kv-connector`)."""
    return RunOptions(block_size=args.block_size, num_blocks=args.num_blocks,
                      kv_cache_memory_bytes=args.kv_cache_mb * 1024**2,
                      num_spec_tokens=args.num_spec_tokens, request_rate=args.request_rate,
                      max_concurrency=args.max_concurrency, seed=args.seed,
                      progress=not args.json, kv_connector=args.kv_connector,
                      kv_offload_gib=args.kv_offload_gib, kv_offload_dir=offload_dir,
                      kv_offload_disk_gib=args.kv_offload_disk_gib,
                      kv_store_url=connector.store_url if connector else "embedded",
                      kv_store_gib=connector.store_gib if connector else 4.0,
                      num_engines=args.engines)
