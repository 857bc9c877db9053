"""`speckv bench serve`: load-test an OpenAI-compatible server, like `vllm bench serve`.

Streams every request of a workload (vLLM's `prefix_repetition`, or a JSONL file) to
`/v1/completions` (token-id prompts) or `/v1/chat/completions` (the decoded text as the user
message), under a concurrency cap and Poisson arrivals, and reports request throughput,
output tokens/s, TTFT / TPOT / ITL mean, median and p99, the prefix-cache hit rate from the
server's `/metrics` deltas (beside the per-request `cached_tokens` sum and the workload's
oracle) and the drafts' acceptance; a progress bar, a table, `--json`, and a PNG of the TTFT
distribution.

Without `--base-url` it launches `speckv serve` itself (a subprocess, same engine flags) on a
free port. `--compare-in-process` then runs the same prompts through the same engine in this
process, twice: "in-process", a closed loop on `LLMEngine` at the same concurrency and arrivals
(its TTFT, add_request to first token, is comparable to the HTTP client's), and
"LLM.generate" with `max_num_seqs` = the concurrency (throughput only: one call has no
per-request arrival), and adds the server / in-process ratios. Each run starts warm (one
request) with an empty prefix cache; `--repeat N` alternates the runs N times and reports
medians, so a shared machine's background load falls on both sides alike.

    TTFT  arrival -> first content token     TPOT  (latency - TTFT) / (output tokens - 1)
    ITL   gaps between content chunks        hit rate  prefix_cache_hits / _queries deltas
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import subprocess
import sys
import time
from collections import deque
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from speckv.bench.health import wait_healthy
from speckv.bench.serve_client import (
    ENDPOINTS,
    HttpTarget,
    RequestResult,
    Summary,
    arrival_offsets,
    histogram_mean_ms,
    http_get,
    metrics_rates,
    run_http,
    summarize,
)
from speckv.measure.prometheus import metric_totals
from speckv.workloads import (
    PrefixRepetitionConfig,
    WorkloadRequest,
    load_jsonl,
    oracle_hit_tokens,
    prefix_repetition,
)


def run_engine_loop(engine: Any, requests: list[WorkloadRequest], *, request_rate: float,
                    max_concurrency: int, ignore_eos: bool, seed: int, progress: bool
                    ) -> tuple[list[RequestResult], float, tuple[float, float] | None,
                               float | None]:
    """A closed loop on `LLMEngine` with the HTTP client's concurrency cap and arrivals.
    Returns (results, duration, (acceptance rate, mean acceptance length), hit rate) from the
    engine's own per-step stats."""
    from speckv.engine.sampling_params import SamplingParams

    offsets = arrival_offsets(len(requests), request_rate, seed)
    pending = deque(range(len(requests)))
    index_of: dict[str, int] = {}
    added: dict[int, float] = {}
    last: dict[int, float] = {}
    results = [RequestResult(success=False) for _ in requests]
    drafted = accepted = drafts = queries = hits = 0
    bar = tqdm(total=len(requests), desc="in-process", disable=not progress, leave=False)
    start = time.perf_counter()
    in_flight = 0
    while pending or in_flight:
        now = time.perf_counter()
        while pending and in_flight < max_concurrency and offsets[pending[0]] <= now - start:
            index = pending.popleft()
            params = SamplingParams(max_tokens=requests[index].output_len, ignore_eos=ignore_eos)
            request_id = engine.add_request(requests[index].prompt_token_ids, params)
            index_of[request_id] = index
            added[index] = time.perf_counter()
            in_flight += 1
        if not in_flight:
            time.sleep(max(0.0, min(0.05, offsets[pending[0]] - (now - start))))
            continue
        outputs = engine.step()
        stamp = time.perf_counter()
        stats = engine.last_stats
        if stats is not None:
            queries += stats.prefix_cache.num_query_tokens
            hits += stats.prefix_cache.num_hit_tokens
            if stats.spec_decoding is not None:
                drafted += stats.spec_decoding.num_draft_tokens
                accepted += stats.spec_decoding.num_accepted_tokens
                drafts += stats.spec_decoding.num_drafts
        for output in outputs:
            index = index_of[output.request_id]
            result = results[index]
            if output.delta_token_ids:
                if index not in last:
                    result.ttft_s = stamp - added[index]
                else:
                    result.itl_s.append(stamp - last[index])
                last[index] = stamp
            if output.finished:
                in_flight -= 1
                result.success = output.error is None
                result.error = output.error or ""
                result.prompt_tokens = len(output.prompt_token_ids)
                result.output_tokens = len(output.token_ids)
                result.cached_tokens = output.num_cached_tokens
                result.latency_s = stamp - added[index]
                bar.update(1)
    duration = time.perf_counter() - start
    bar.close()
    acceptance = (accepted / drafted, 1 + accepted / drafts) if drafted and drafts else None
    return results, duration, acceptance, (hits / queries if queries else None)


def run_llm_generate(llm: Any, requests: list[WorkloadRequest], ignore_eos: bool
                     ) -> tuple[list[RequestResult], float, tuple[float, float] | None]:
    """`LLM.generate` on every prompt at once (its engine caps the batch at max_num_seqs)."""
    from speckv.engine.outputs import acceptance_stats
    from speckv.engine.sampling_params import SamplingParams

    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=ignore_eos) for r in requests]
    start = time.perf_counter()
    outputs = llm.generate([r.prompt_token_ids for r in requests], params)
    duration = time.perf_counter() - start
    results = [RequestResult(success=o.error is None, prompt_tokens=len(o.prompt_token_ids),
                             output_tokens=len(o.token_ids), cached_tokens=o.num_cached_tokens,
                             error=o.error or "")
               for o in outputs]
    num_spec = llm.engine.num_spec_tokens
    return results, duration, acceptance_stats(outputs, num_spec) if num_spec else None


# ---- output -------------------------------------------------------------------------------
ROWS: list[tuple[str, str, str]] = [
    ("successful requests", "num_completed", "d"), ("failed requests", "num_failed", "d"),
    ("duration (s)", "duration_s", ".2f"),
    ("request throughput (req/s)", "request_throughput", ".2f"),
    ("output token throughput (tok/s)", "output_throughput", ".1f"),
    ("total token throughput (tok/s)", "total_token_throughput", ".1f"),
    ("TTFT mean (ms)", "ttft_mean_ms", ".1f"), ("TTFT median (ms)", "ttft_median_ms", ".1f"),
    ("TTFT p99 (ms)", "ttft_p99_ms", ".1f"),
    ("TPOT mean (ms)", "tpot_mean_ms", ".1f"), ("TPOT median (ms)", "tpot_median_ms", ".1f"),
    ("TPOT p99 (ms)", "tpot_p99_ms", ".1f"),
    ("ITL mean (ms)", "itl_mean_ms", ".1f"), ("ITL median (ms)", "itl_median_ms", ".1f"),
    ("ITL p99 (ms)", "itl_p99_ms", ".1f"),
    ("E2E latency mean (ms)", "e2e_mean_ms", ".1f"),
    ("prefix-cache hit rate (/metrics)", "hit_rate_metrics", "%"),
    ("prefix-cache hit rate (cached_tokens)", "hit_rate_usage", "%"),
    ("oracle hit rate", "oracle_hit_rate", "%"),
    ("acceptance rate", "acceptance_rate", ".3f"),
    ("mean acceptance length", "mean_acceptance_length", ".2f"),
    ("server-side TTFT mean (ms, /metrics)", "server_ttft_mean_ms", ".1f"),
    ("server-side queue time mean (ms, /metrics)", "server_queue_mean_ms", ".1f"),
    ("HTTP path overhead (ms): client TTFT - server TTFT", "http_path_overhead_ms", ".1f"),
]
RATIO_ROWS = {"request_throughput", "output_throughput", "total_token_throughput"}


def _fmt(value: Any, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "%":
        return f"{100 * value:.1f}%"
    return format(value, fmt)


def render(summaries: list[Summary], title: str) -> Table:
    """One column per run; with a reference run, the server's ratio to it (throughput) or
    difference (TTFT, ms)."""
    table = Table(title=title)
    table.add_column("metric", no_wrap=True)
    for summary in summaries:
        table.add_column(summary.name, justify="right")
    reference = next((s for s in summaries if s.name == "in-process"), None)
    if reference is not None and summaries[0] is not reference:
        table.add_column("server / in-process", justify="right")
    for label, key, fmt in ROWS:
        cells = [_fmt(getattr(s, key), fmt) for s in summaries]
        if reference is not None and summaries[0] is not reference:
            server, ref = getattr(summaries[0], key), getattr(reference, key)
            if key in RATIO_ROWS and ref:
                cells.append(f"{server / ref:.2f}x")
            elif key.startswith("ttft_") and server is not None and ref is not None:
                cells.append(f"{server - ref:+.1f} ms")
            else:
                cells.append("")
        table.add_row(label, *cells)
    return table


def write_ttft_png(summaries: list[Summary], path: Path, workload: str) -> None:
    from speckv.measure.charts import save, ttft_histogram_figure

    save(ttft_histogram_figure([(s.name, s.ttfts_ms, s.ttft_median_ms) for s in summaries],
                               workload), path)


# ---- command -------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    from speckv.engine.cli_args import add_engine_arguments

    parser.add_argument("--base-url", default=None,
                        help="a running server (default: launch `speckv serve` with the engine "
                        "flags on a free port)")
    parser.add_argument("--endpoint", choices=ENDPOINTS, default="/v1/completions")
    parser.add_argument("--model", default="builtin",
                        help="the model to launch / load in process, and its tokenizer "
                        "('builtin', an HF dir or a .gguf)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model name to send (default: the server's first model)")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--dataset-name", "--dataset", dest="dataset",
                        choices=("prefix_repetition", "jsonl"), default="prefix_repetition")
    parser.add_argument("--dataset-path", type=Path, default=None, help="the JSONL file")
    parser.add_argument("--prefix-repetition-prefix-len", "--prefix-len", dest="prefix_len",
                        type=int, default=256)
    parser.add_argument("--prefix-repetition-suffix-len", "--suffix-len", dest="suffix_len",
                        type=int, default=64)
    parser.add_argument("--prefix-repetition-num-prefixes", "--num-prefixes",
                        dest="num_prefixes", type=int, default=8)
    parser.add_argument("--prefix-repetition-output-len", "--output-len", dest="output_len",
                        type=int, default=64)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests/s, Poisson arrivals (default: all at once)")
    parser.add_argument("--max-concurrency", type=int, default=16)
    parser.add_argument("--ignore-eos", action="store_true",
                        help="generate exactly the requested output length")
    parser.add_argument("--compare-in-process", action="store_true",
                        help="also run the same prompts on the same engine in this process")
    parser.add_argument("--repeat", type=int, default=1,
                        help="alternate the server and in-process runs this many times and "
                        "report medians (a shared CPU's load then hits both alike)")
    parser.add_argument("--output-dir", type=Path, default=Path("out/bench-serve"))
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--bench-seed", type=int, default=0, help="workload and arrivals")
    add_engine_arguments(parser)


def load_tokenizer(model: str) -> Any:
    """The tokenizer alone where possible (the built-in model: its converted copy)."""
    from speckv.models.common.tokenizer import Tokenizer

    if model == "builtin":
        from speckv.models.llama.builtin import convert_builtin

        return Tokenizer.from_dir(convert_builtin(progress=False))
    if Path(model).is_dir():
        return Tokenizer.from_dir(model)
    from speckv.engine.llm import load_model

    _, tokenizer = load_model(model, "float32", "cpu", progress=False)
    return tokenizer


class LaunchedServer:
    """`speckv serve` with the bench's engine flags, as a subprocess on a free port."""

    def __init__(self, args: argparse.Namespace) -> None:
        from speckv.engine.cli_args import engine_flags
        from speckv.events.endpoints import LOOPBACK, free_port

        port = free_port()
        self.base_url = f"http://{LOOPBACK}:{port}"
        command = [sys.executable, "-m", "speckv.cli", "serve", *engine_flags(args),
                   "--host", LOOPBACK, "--port", str(port),
                   "--max-waiting-requests", str(max(256, args.num_prompts))]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL)

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        wait_healthy(self.base_url, self.process, timeout_s, "speckv serve", poll_s=0.2)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(20)
        except subprocess.TimeoutExpired:
            self.process.kill()


def build_workload(args: argparse.Namespace, tokenizer: Any) -> tuple[list[WorkloadRequest],
                                                                       str, float | None]:
    """(requests, description, oracle hit rate for the block size)."""
    if args.dataset == "jsonl":
        if args.dataset_path is None:
            raise ValueError("--dataset-name jsonl needs --dataset-path FILE")
        requests = load_jsonl(args.dataset_path, tokenizer, args.output_len)[: args.num_prompts]
        return requests, f"{len(requests)} prompts from {args.dataset_path}", None
    config = PrefixRepetitionConfig(args.prefix_len, args.suffix_len, args.num_prefixes,
                                    args.output_len, args.num_prompts, args.bench_seed)
    requests = prefix_repetition(config, tokenizer.vocab_size, tokenizer)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    oracle = oracle_hit_tokens(requests, args.block_size) / prompt_tokens
    description = (f"prefix_repetition: {len(requests)} prompts, {args.num_prefixes} prefixes "
                   f"of {args.prefix_len} + {args.suffix_len}-token suffixes, "
                   f"{args.output_len} output tokens")
    return requests, description, oracle


def run_server_once(target: HttpTarget, args: argparse.Namespace,
                    requests: list[WorkloadRequest], texts: list[str | None],
                    oracle: float | None, progress: bool) -> tuple[Summary, list[str]]:
    """One warm run on an empty prefix cache; (summary, distinct error messages)."""
    warmup = [WorkloadRequest(requests[0].prompt_token_ids[:8], 4)]
    asyncio.run(run_http(target, warmup, texts[:1], request_rate=math.inf, max_concurrency=1,
                         ignore_eos=True, seed=0, progress=False))
    http_get(target.base_url, "/reset_prefix_cache", target.api_key, method="POST")
    before = metric_totals(http_get(target.base_url, "/metrics").text)
    results, duration = asyncio.run(run_http(
        target, requests, texts, request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos,
        seed=args.bench_seed, progress=progress))
    after = metric_totals(http_get(target.base_url, "/metrics").text)
    hit_rate, acceptance = metrics_rates(before, after)
    summary = summarize("server", results, duration, hit_rate_metrics=hit_rate,
                        oracle_hit_rate=oracle, acceptance=acceptance)
    server_ttft = histogram_mean_ms(before, after, "vllm:time_to_first_token_seconds")
    server_queue = histogram_mean_ms(before, after, "vllm:request_queue_time_seconds")
    overhead = None
    if server_ttft is not None and summary.ttft_mean_ms:
        # the server's TTFT runs from the request's HTTP arrival and includes its queueing:
        # what the client sees beyond it is the HTTP path alone
        overhead = summary.ttft_mean_ms - server_ttft
    summary = replace(summary, server_ttft_mean_ms=server_ttft,
                      server_queue_mean_ms=server_queue, http_path_overhead_ms=overhead)
    return summary, sorted({r.error for r in results if not r.success})


def median_summary(runs: list[Summary]) -> Summary:
    """Several repeats of one run as one: medians of the rates and latencies, summed request
    counts, every TTFT (for the chart)."""
    if len(runs) == 1:
        return runs[0]
    fields: dict[str, Any] = {}
    for key, first in asdict(runs[0]).items():
        values = [getattr(r, key) for r in runs]
        if key == "name":
            fields[key] = first
        elif key == "ttfts_ms":
            fields[key] = [t for v in values for t in v]
        elif key in ("num_completed", "num_failed"):
            fields[key] = sum(values)
        else:
            present = [v for v in values if v is not None]
            fields[key] = statistics.median(present) if present else None
    return Summary(**fields)


def run(args: argparse.Namespace) -> int:
    if args.num_prompts < 1 or args.max_concurrency < 1 or args.repeat < 1:
        raise ValueError("--num-prompts, --max-concurrency and --repeat must be >= 1")
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {args.request_rate}")
    progress = not args.json
    tokenizer = load_tokenizer(args.model)
    requests, description, oracle = build_workload(args, tokenizer)
    chat = args.endpoint.endswith("chat/completions")
    texts = [tokenizer.decode(r.prompt_token_ids) if chat else None for r in requests]
    launched = LaunchedServer(args) if args.base_url is None else None
    runs: dict[str, list[Summary]] = {}
    errors: set[str] = set()
    try:
        base_url = launched.base_url if launched is not None else args.base_url.rstrip("/")
        in_process = InProcess(args, requests, oracle, progress) if args.compare_in_process \
            else None
        if launched is not None:
            launched.wait_ready()
        model = args.served_model_name or http_get(base_url, "/v1/models",
                                                   args.api_key).json()["data"][0]["id"]
        target = HttpTarget(base_url, args.endpoint, model, args.api_key)
        # repeats alternate server and in-process runs: load from elsewhere hits both alike
        for _ in range(args.repeat):
            summary, run_errors = run_server_once(target, args, requests, texts, oracle,
                                                  progress)
            runs.setdefault(summary.name, []).append(summary)
            errors.update(run_errors)
            for summary in in_process.run_once() if in_process is not None else []:
                runs.setdefault(summary.name, []).append(summary)
    finally:
        if launched is not None:
            launched.stop()
    summaries = [median_summary(repeats) for repeats in runs.values()]
    return report(args, summaries, description, sorted(errors),
                  [r for repeats in zip(*runs.values()) for r in repeats])


class InProcess:
    """The server's engine (same flags) in this process, `max_num_seqs` = the concurrency."""

    def __init__(self, args: argparse.Namespace, requests: list[WorkloadRequest],
                 oracle: float | None, progress: bool) -> None:
        import torch

        from speckv.engine.cli_args import engine_args_from_cli
        from speckv.engine.llm import LLM
        from speckv.server.cli import serve_threads

        # the server's thread count, so the two runs compare the same engine
        torch.set_num_threads(serve_threads(args.threads, torch.get_num_threads()))
        engine_args = replace(engine_args_from_cli(args),
                              max_num_seqs=min(args.max_num_seqs, args.max_concurrency),
                              kv_events_endpoint=None, kv_events_replay_endpoint=None)
        self.llm = LLM(args.model, progress=False, **vars(engine_args))
        self.args = args
        self.requests = requests
        self.oracle = oracle
        self.progress = progress

    def run_once(self) -> list[Summary]:
        from speckv.engine.sampling_params import SamplingParams

        args, requests, engine = self.args, self.requests, self.llm.engine
        self.llm.generate([requests[0].prompt_token_ids[:8]], SamplingParams(max_tokens=4))
        engine.manager.reset_prefix_cache()
        results, duration, acceptance, hit_rate = run_engine_loop(
            engine, requests, request_rate=args.request_rate,
            max_concurrency=args.max_concurrency, ignore_eos=args.ignore_eos,
            seed=args.bench_seed, progress=self.progress)
        loop = summarize("in-process", results, duration, hit_rate_metrics=hit_rate,
                         oracle_hit_rate=self.oracle, acceptance=acceptance)
        engine.manager.reset_prefix_cache()
        results, duration, acceptance = run_llm_generate(self.llm, requests, args.ignore_eos)
        generate = summarize("LLM.generate", results, duration, hit_rate_metrics=None,
                             oracle_hit_rate=self.oracle, acceptance=acceptance, timed=False)
        return [loop, generate]


def report(args: argparse.Namespace, summaries: list[Summary], description: str,
           errors: list[str], every_run: list[Summary]) -> int:
    args.output_dir.mkdir(parents=True, exist_ok=True)
    payload = {"workload": description, "endpoint": args.endpoint,
               "max_concurrency": args.max_concurrency, "request_rate": args.request_rate,
               "repeat": args.repeat,
               "runs": [{k: v for k, v in asdict(s).items() if k != "ttfts_ms"}
                        for s in summaries]}
    if args.repeat > 1:
        payload["every_run"] = [{k: v for k, v in asdict(s).items() if k != "ttfts_ms"}
                                for s in every_run]
    payload["server_errors"] = errors[:10]
    (args.output_dir / "results.json").write_text(json.dumps(payload, indent=2))
    chart = args.output_dir / "ttft.png"
    write_ttft_png(summaries, chart, f"{description}; concurrency {args.max_concurrency}")
    if args.json:
        print(json.dumps(payload))
        return 0
    console = Console(width=max(Console().width, 110))
    repeats = f", median of {args.repeat} alternating runs" if args.repeat > 1 else ""
    console.print(render(summaries, f"{description}; concurrency {args.max_concurrency}, "
                                    f"{args.endpoint}{repeats}"))
    for error in errors[:5]:
        console.print(f"[red]failed:[/] {error}")
    console.print(f"wrote {args.output_dir / 'results.json'} and {chart}")
    return 0
