"""`speckv bench route`: N `speckv serve` (or, with `--vllm-venv DIR`, vLLM CPU) engines behind
`speckv router` on loopback, the routing policies side by side on a prefix_repetition workload
with more prefixes than one engine's cache holds.

For each policy (kv, round-robin, least-loaded) the engines' prefix caches are reset
(`POST /reset_prefix_cache`: the router sees AllBlocksCleared), a router with that policy
starts, and the same requests stream through it (`speckv bench serve`'s client: token-id
prompts, Poisson arrivals, a concurrency cap). Reported per policy: the prefix-cache hit rate
(the engines' `usage.cached_tokens` over prompt tokens), TTFT, request and output throughput,
the router's decisions, and its prediction accuracy (requests whose predicted cached tokens
equal the engine's report). Two references: `oracle (1 engine, 2x cache)`, one engine with
all the engines' KV blocks serving the same requests directly (the hit rate a perfect router
could at best reach), and the workload's unbounded-cache oracle. Last, the router's own cost:
TTFT of the same short requests at concurrency 1 sent to an engine directly and through the
kv router, interleaved.

Table, `results.json` and `route.png` under `--output-dir`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from speckv.bench.health import wait_healthy
from speckv.bench.serve_client import HttpTarget, run_http, summarize
from speckv.events.endpoints import LOOPBACK, free_port, loopback_endpoint
from speckv.measure.prometheus import metric_totals
from speckv.router.policy import POLICIES
from speckv.workloads import (
    PrefixRepetitionConfig,
    WorkloadRequest,
    oracle_hit_tokens,
    prefix_repetition,
)

MODEL_NAME = "bench-route"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="builtin",
                        help="what every engine serves (builtin, an HF dir, a .gguf)")
    parser.add_argument("--engines", type=int, default=2, help="engine processes")
    parser.add_argument("--speculative-method", "--drafter", dest="speculative_method",
                        default="eagle3",
                        help="the engines' drafter (eagle3: the built-in head on the built-in "
                        "model; none: no speculation, legacy hashes)")
    parser.add_argument("--speculative-model", default=None, help="the drafter's dir")
    parser.add_argument("--num-spec-tokens", type=int, default=3)
    parser.add_argument("--disable-lookahead-block-hashes", action="store_true",
                        help="legacy hashes + the last-block drop on every engine")
    parser.add_argument("--disable-divergent-block-reuse", action="store_true",
                        help="engines recompute a block cached under another successor "
                        "(the router's predictions then cover every hit)")
    parser.add_argument("--policies", default=",".join(POLICIES),
                        help="comma-separated, of " + ", ".join(POLICIES))
    parser.add_argument("--block-size", type=int, default=None,
                        help="tokens per block (default 16; 32 with --vllm-venv: vLLM's CPU "
                        "attention wants multiples of 32)")
    parser.add_argument("--num-blocks", type=int, default=None,
                        help="KV blocks per engine, default 1,536 tokens' worth (the oracle "
                        "engine gets N times as many)")
    parser.add_argument("--vllm-venv", default=None, metavar="DIR",
                        help="run vLLM engines (DIR/bin/vllm, vLLM's CPU engine) of the "
                        "built-in model instead of speckv serve; --speculative-method eagle3 "
                        "gives them speckv's EAGLE3 head")
    parser.add_argument("--vllm-plugin", action="store_true",
                        help="with --vllm-venv: load speckv's vLLM plugin into the engines "
                        "(lookahead block hashes, no last-block drop)")
    parser.add_argument("--prefix-len", type=int, default=192)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--max-concurrency", type=int, default=4)
    parser.add_argument("--request-rate", type=float, default=float("inf"),
                        help="requests/s (Poisson); inf: as fast as the concurrency allows")
    parser.add_argument("--overhead-requests", type=int, default=16,
                        help="short requests for the router's own TTFT cost (0: skip)")
    parser.add_argument("--no-oracle", action="store_true", help="skip the 1-engine oracle")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    parser.add_argument("--bench-seed", type=int, default=0)
    parser.add_argument("--output-dir", type=Path, default=Path("out/bench-route"))
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


@dataclass(frozen=True)
class PolicyResult:
    name: str
    num_completed: int
    num_failed: int
    hit_rate: float  # cached / prompt tokens, from the engines' usage
    ttft_mean_ms: float | None
    ttft_median_ms: float | None
    ttft_p99_ms: float | None
    request_throughput: float
    output_throughput: float
    prediction_checks: int | None  # requests whose answer reported cached tokens
    prediction_exact: float | None  # of those, the share predicted exactly
    predicted_cached_tokens: int | None
    reported_cached_tokens: int | None
    decisions: dict[str, int] | None  # reason -> requests
    per_engine: dict[str, int] | None  # engine -> requests


class Process:
    def __init__(self, command: list[str], url: str) -> None:
        self.url = url
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.PIPE, text=True)

    def wait_ready(self, timeout_s: float = 600.0) -> None:
        wait_healthy(self.url, self.process, timeout_s, f"{self.process.args[3]} at {self.url}",
                     exit_detail=lambda: f": {self.process.stderr.read()}", poll_s=0.2)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(30)


def engine_command(args: argparse.Namespace, port: int, num_blocks: int) -> list[str]:
    command = [sys.executable, "-m", "speckv.cli", "serve", args.model, "--host", LOOPBACK,
               "--port", str(port), "--served-model-name", MODEL_NAME,
               "--block-size", str(args.block_size), "--num-gpu-blocks-override",
               str(num_blocks), "--hash-seed", "0", "--threads", str(args.threads),
               "--max-num-seqs", str(max(8, args.max_concurrency)),
               "--kv-events-endpoint", loopback_endpoint(),
               "--kv-events-replay-endpoint", loopback_endpoint(),
               "--max-waiting-requests", str(max(256, args.num_prompts))]
    if args.speculative_method != "none":
        command += ["--speculative-method", args.speculative_method,
                    "--num-spec-tokens", str(args.num_spec_tokens)]
        if args.speculative_model:
            command += ["--speculative-model", args.speculative_model]
    else:
        command += ["--speculative-method", "none"]
    if args.disable_lookahead_block_hashes:
        command.append("--disable-lookahead-block-hashes")
    if args.disable_divergent_block_reuse:
        command.append("--disable-divergent-block-reuse")
    return command


def start_engine(args: argparse.Namespace, num_blocks: int) -> Any:
    if args.vllm_venv:
        from speckv.bench.vllm_fleet import VLLMEngine, builtin_model_dir, eagle3_config

        spec = {"none": None, "eagle3": eagle3_config(args.num_spec_tokens)}
        if args.speculative_method not in spec:
            raise ValueError(f"--speculative-method {args.speculative_method} with "
                             "--vllm-venv: eagle3 or none")
        engine = VLLMEngine(Path(args.vllm_venv), builtin_model_dir(), MODEL_NAME,
                          spec[args.speculative_method], args.block_size, num_blocks,
                          plugin=args.vllm_plugin)
        args.output_dir.mkdir(parents=True, exist_ok=True)
        return engine.start(args.output_dir / f"vllm-{engine.port}.log")
    port = free_port()
    return Process(engine_command(args, port, num_blocks), f"http://{LOOPBACK}:{port}")


def start_router(engines: dict[str, Any], policy: str) -> Process:
    port = free_port()
    command = [sys.executable, "-m", "speckv.cli", "router", "--port", str(port),
               "--policy", policy, "--health-interval", "0.25"]
    for name, engine in engines.items():
        command += engine.router_flags(name) if hasattr(engine, "router_flags") \
            else [f"--engine={name}={engine.url}"]
    router = Process(command, f"http://{LOOPBACK}:{port}")
    router.wait_ready(120)
    return router


def reset_caches(engines: list[Process]) -> None:
    for engine in engines:
        response = httpx.post(f"{engine.url}/reset_prefix_cache", timeout=60)
        response.raise_for_status()


def drive(url: str, requests: list[WorkloadRequest], args: argparse.Namespace, name: str,
          progress: bool):
    target = HttpTarget(url, "/v1/completions", MODEL_NAME)
    results, duration = asyncio.run(run_http(
        target, requests, [None] * len(requests), request_rate=args.request_rate,
        max_concurrency=args.max_concurrency, ignore_eos=True, seed=args.bench_seed,
        progress=progress, desc=name))
    return summarize(name, results, duration, hit_rate_metrics=None, oracle_hit_rate=None,
                     acceptance=None), results


def _labelled(text: str, name: str, label: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                key = sample.labels.get(label, "")
                out[key] = out.get(key, 0.0) + sample.value
    return out


def settled_metrics(router_url: str, num_completed: int, timeout_s: float = 15.0) -> str:
    """The router's /metrics once every completed request's usage report is counted. A stream's
    report is counted when the engine closes it, which can come after the client read its last
    chunk (the client's [DONE]); on a loaded machine that gap exceeded a fixed sleep."""
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = httpx.get(f"{router_url}/metrics", timeout=30).text
        checks = metric_totals(metrics).get("speckv_router:prediction_checks_total", 0)
        if checks >= num_completed or time.monotonic() > deadline:
            time.sleep(0.2)  # events of the last blocks settle
            return httpx.get(f"{router_url}/metrics", timeout=30).text
        time.sleep(0.05)


def policy_result(name: str, summary: Any, router_metrics: str | None) -> PolicyResult:
    checks = exact = predicted = reported = None
    decisions = per_engine = None
    if router_metrics is not None:
        totals = metric_totals(router_metrics)
        checks = int(totals.get("speckv_router:prediction_checks_total", 0))
        mismatches = int(totals.get("speckv_router:prediction_mismatches_total", 0))
        exact = (checks - mismatches) / checks if checks else None
        predicted = int(totals.get("speckv_router:predicted_cached_tokens_total", 0))
        reported = int(totals.get("speckv_router:reported_cached_tokens_total", 0))
        decisions = {k: int(v) for k, v in _labelled(
            router_metrics, "speckv_router:requests_total", "reason").items()}
        per_engine = {k: int(v) for k, v in _labelled(
            router_metrics, "speckv_router:requests_total", "engine").items()}
    return PolicyResult(name, summary.num_completed, summary.num_failed,
                        summary.hit_rate_usage, summary.ttft_mean_ms, summary.ttft_median_ms,
                        summary.ttft_p99_ms, summary.request_throughput,
                        summary.output_throughput, checks, exact, predicted, reported,
                        decisions, per_engine)


def measure_overhead(engine: Process, router: Process, requests: list[WorkloadRequest],
                     count: int) -> dict[str, float]:
    """Median TTFT of the same short requests sent directly and through the router,
    interleaved at concurrency 1 (each prompt is sent once to warm it, so both sides hit)."""
    prompts = [r.prompt_token_ids for r in requests[:count]]
    times: dict[str, list[float]] = {"direct": [], "router": []}
    with httpx.Client(timeout=120) as client:
        for prompt in prompts:
            for side, url in (("direct", engine.url), ("router", router.url)) * 2:
                body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 1,
                        "temperature": 0, "stream": True}
                start = time.perf_counter()
                with client.stream("POST", f"{url}/v1/completions", json=body) as response:
                    lines = response.iter_lines()
                    for line in lines:
                        if line.startswith("data:") and '"text"' in line:
                            times[side].append(1000 * (time.perf_counter() - start))
                            break
                    for _ in lines:  # the rest of the stream
                        pass
    # the first pass of each prompt warmed it; keep the second of each side
    direct = times["direct"][1::2]
    routed = times["router"][1::2]
    return {"direct_ttft_median_ms": statistics.median(direct),
            "router_ttft_median_ms": statistics.median(routed),
            "router_overhead_median_ms": statistics.median(
                [r - d for r, d in zip(routed, direct)])}


ROWS = (("completed / failed", None, None), ("hit rate", "hit_rate", "%"),
        ("TTFT mean (ms)", "ttft_mean_ms", ".0f"), ("TTFT median (ms)", "ttft_median_ms", ".0f"),
        ("TTFT p99 (ms)", "ttft_p99_ms", ".0f"),
        ("requests/s", "request_throughput", ".2f"),
        ("output tokens/s", "output_throughput", ".1f"),
        ("prediction exact", "prediction_exact", "%"))


def render(results: list[PolicyResult], title: str) -> Table:
    table = Table(title=title)
    table.add_column("metric", no_wrap=True)
    for result in results:
        table.add_column(result.name, justify="right")
    for label, key, fmt in ROWS:
        if key is None:
            cells = [f"{r.num_completed} / {r.num_failed}" for r in results]
        else:
            cells = []
            for result in results:
                value = getattr(result, key)
                cells.append("-" if value is None else
                             f"{100 * value:.1f}%" if fmt == "%" else format(value, fmt))
        table.add_row(label, *cells)
    table.add_row("predicted / reported cached", *[
        "-" if r.predicted_cached_tokens is None
        else f"{r.predicted_cached_tokens} / {r.reported_cached_tokens}" for r in results])
    table.add_row("decisions", *[
        "-" if not r.decisions else ", ".join(f"{k} {v}" for k, v in sorted(r.decisions.items()))
        for r in results])
    table.add_row("requests per engine", *[
        "-" if not r.per_engine else ", ".join(f"{k} {v}" for k, v in sorted(r.per_engine.items()))
        for r in results])
    return table


def write_png(results: list[PolicyResult], oracle: float, path: Path, workload: str) -> None:
    from speckv.measure.charts import BarPanel, bar_pair_figure, save

    save(bar_pair_figure(
        [r.name for r in results],
        BarPanel([100 * r.hit_rate for r in results], "prefix-cache hit rate (%)", "{:.0f}%",
                 "tab:blue"),
        BarPanel([r.ttft_median_ms or 0 for r in results], "median TTFT (ms)", "{:.0f}",
                 "tab:orange"),
        "speckv bench route", workload, 100 * oracle, "unbounded-cache oracle"), path)


def run(args: argparse.Namespace) -> int:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = sorted(set(policies) - set(POLICIES))
    if unknown or not policies:
        raise ValueError(f"--policies: {unknown or 'none given'}; choose from "
                         f"{', '.join(POLICIES)}")
    if args.vllm_venv:
        from speckv.bench.vllm_fleet import check_venv

        check_venv(args.vllm_venv)
        if args.model != "builtin":
            raise ValueError("--vllm-venv runs the built-in model: leave --model out")
    if args.block_size is None:
        args.block_size = 32 if args.vllm_venv else 16
    if args.num_blocks is None:
        args.num_blocks = max(2, 1536 // args.block_size)
    if args.engines < 1 or args.num_blocks < 2 or args.max_concurrency < 1:
        raise ValueError("--engines, --max-concurrency must be >= 1 and --num-blocks >= 2")
    from speckv.router.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model)
    vocab = tokenizer.vocab_size if tokenizer is not None else 96
    config = PrefixRepetitionConfig(args.prefix_len, args.suffix_len, args.num_prefixes,
                                    args.output_len, args.num_prompts, args.bench_seed)
    requests = prefix_repetition(config, vocab, tokenizer)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    unbounded = oracle_hit_tokens(requests, args.block_size) / prompt_tokens
    blocks_per_prefix = -(-args.prefix_len // args.block_size)
    description = (f"prefix_repetition: {len(requests)} prompts, {args.num_prefixes} prefixes "
                   f"of {args.prefix_len} (+{args.suffix_len}) tokens = "
                   f"{args.num_prefixes * blocks_per_prefix} prefix blocks; {args.engines} "
                   f"{'vLLM ' if args.vllm_venv else ''}"
                   f"{'+ speckv plugin ' if args.vllm_plugin else ''}engines of {args.num_blocks} "
                   f"blocks of {args.block_size}; drafter "
                   f"{args.speculative_method}"
                   f"{', legacy hashes' if args.disable_lookahead_block_hashes else ''}; "
                   f"concurrency {args.max_concurrency}, {args.output_len} output tokens")
    progress = not args.json
    engines = {chr(ord("a") + i): start_engine(args, args.num_blocks)
               for i in range(args.engines)}
    oracle_engine = None if args.no_oracle else start_engine(
        args, args.num_blocks * args.engines)
    results: list[PolicyResult] = []
    overhead: dict[str, float] | None = None
    router: Process | None = None
    try:
        everyone = [*engines.values(), *([oracle_engine] if oracle_engine else [])]
        with ThreadPoolExecutor(len(everyone)) as pool:
            list(pool.map(lambda p: p.wait_ready(), everyone))
        warm = requests[0].prompt_token_ids[:8]
        for engine in everyone:  # first-request costs out of the measurement
            httpx.post(f"{engine.url}/v1/completions", timeout=300, json={
                "model": MODEL_NAME, "prompt": warm, "max_tokens": 2}).raise_for_status()
        for policy in policies:
            reset_caches(list(engines.values()))
            router = start_router(engines, policy)
            summary, _ = drive(router.url, requests, args, policy, progress)
            metrics = settled_metrics(router.url, summary.num_completed)
            results.append(policy_result(policy, summary, metrics))
            if policy == "kv" and args.overhead_requests > 0:
                overhead = measure_overhead(engines["a"], router, requests,
                                            args.overhead_requests)
            router.stop()
            router = None
        if oracle_engine is not None:
            reset_caches([oracle_engine])
            summary, _ = drive(oracle_engine.url, requests, args,
                               f"oracle (1 engine, {args.engines}x cache)", progress)
            results.append(policy_result(summary.name, summary, None))
    finally:
        if router is not None:
            router.stop()
        for engine in [*engines.values(), *([oracle_engine] if oracle_engine else [])]:
            engine.stop()
    return report(args, results, description, unbounded, overhead)


def report(args: argparse.Namespace, results: list[PolicyResult], description: str,
           unbounded: float, overhead: dict[str, float] | None) -> int:
    args.output_dir.mkdir(parents=True, exist_ok=True)
    by_name = {r.name: r for r in results}
    ratios: dict[str, float | None] = {}
    kv = by_name.get("kv")
    oracle = next((r for r in results if r.name.startswith("oracle")), None)
    rr = by_name.get("round-robin")
    if kv is not None and oracle is not None and oracle.hit_rate:
        ratios["kv_hit_rate_vs_oracle"] = kv.hit_rate / oracle.hit_rate
    if kv is not None and rr is not None and rr.hit_rate:
        ratios["kv_hit_rate_vs_round_robin"] = kv.hit_rate / rr.hit_rate
    payload = {"workload": description, "unbounded_oracle_hit_rate": unbounded,
               "runs": [asdict(r) for r in results], "ratios": ratios,
               "router_overhead": overhead}
    (args.output_dir / "results.json").write_text(json.dumps(payload, indent=2))
    chart = args.output_dir / "route.png"
    write_png(results, unbounded, chart, description)
    if args.json:
        print(json.dumps(payload))
        return 0
    console = Console(width=max(Console().width, 120))
    console.print(render(results, description))
    console.print(f"unbounded-cache oracle hit rate {100 * unbounded:.1f}%; "
                  + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()))
    if overhead is not None:
        console.print(f"router overhead at concurrency 1: median TTFT "
                      f"{overhead['direct_ttft_median_ms']:.1f} ms direct, "
                      f"{overhead['router_ttft_median_ms']:.1f} ms through the router "
                      f"(median difference {overhead['router_overhead_median_ms']:+.1f} ms)")
    console.print(f"wrote {args.output_dir / 'results.json'} and {chart}")
    return 0
