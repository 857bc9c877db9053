"""`speckv bench store-soak`: engine processes sharing one store that is restarted mid-run.

The shared store's reliability check (issue 13): `--engines` engine processes (default 2) run
`--requests-per-engine` requests each (default 200; a prefix-repetition workload, request i on
engine i mod N, `--max-concurrency` in flight over all engines) against one embedded Valkey
server that the bench kills (SIGKILL, as a crash) and starts again on the same port
`--restart-store` times (default 2), evenly spread over the run; the store stays down for
`--down-requests` completions each time. Then, per engine: `check_integrity()` with no
request left. Beside it, the same workload on the same engines without a store (the peer):
every request must complete, and greedy outputs must equal the no-store run's.

A restart loses every stored block: lookups miss while the store is down (counted outages,
skipped calls), saves are dropped, a load that meets the dead server fails and its request
recomputes from the first missing block; after the restart the connectors reconnect with
backoff and hit again what was stored since.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from rich.console import Console
from rich.table import Table

from speckv.cluster.engine_pool import (
    EngineSummary,
    EngineWorkers,
    ModelSpec,
    drive_round_robin,
)
from speckv.connectors.embedded_valkey import GIB, EmbeddedValkey
from speckv.workloads import PrefixRepetitionConfig, prefix_repetition

STORE_COUNTERS = ("loaded_blocks", "load_failed_blocks", "saved_blocks", "save_errors",
                  "store_outages", "store_reconnects", "store_errors", "store_skipped_calls")


@dataclass(frozen=True)
class StoreSoakConfig:
    num_engines: int = 2
    requests_per_engine: int = 200
    restarts: int = 2  # kill + start of the store, spread evenly over the run
    down_requests: int = 8  # completions while the store is down, per restart
    prefix_len: int = 96
    suffix_len: int = 16
    num_prefixes: int = 8
    output_len: int = 8
    max_concurrency: int = 4  # in flight over all engines
    block_size: int = 16
    num_spec_tokens: int = 3
    store_gb: float = 1.0
    store_timeout_s: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_engines", "requests_per_engine", "max_concurrency", "down_requests",
                     "num_prefixes", "output_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got "
                                 f"{getattr(self, name)}")
        if self.restarts < 0:
            raise ValueError(f"--restart-store must be >= 0, got {self.restarts}")
        total = self.num_engines * self.requests_per_engine
        if self.restarts * self.down_requests >= total:
            raise ValueError("--restart-store x --down-requests must be fewer than all requests")
        if self.num_prefixes > total:
            raise ValueError("--num-prefixes must be at most the number of requests")

    @property
    def num_requests(self) -> int:
        return self.num_engines * self.requests_per_engine


@dataclass
class StoreSoakResult:
    config: StoreSoakConfig
    completed: int = 0  # requests that finished with the store (of config.num_requests)
    errors: int = 0  # of them, finish reason "error"
    outputs_equal: bool = False  # greedy outputs == the no-store run's, request by request
    mismatched: list[int] = field(default_factory=list)  # workload indices that differ
    restarts_done: int = 0
    hit_rate: float = 0.0  # cached prompt tokens / prompt tokens, with the store
    store_hit_rate: float = 0.0  # of it, loaded from the store
    no_store_hit_rate: float = 0.0
    duration_s: float = 0.0
    no_store_duration_s: float = 0.0
    engines: list[EngineSummary] = field(default_factory=list)  # with the store

    @property
    def integrity_ok(self) -> bool:
        return bool(self.engines) and all(engine.integrity_ok for engine in self.engines)

    @property
    def passed(self) -> bool:
        return (self.completed == self.config.num_requests and self.errors == 0
                and self.outputs_equal and self.integrity_ok
                and self.restarts_done == self.config.restarts)


class _Restarter:
    """Kills the store at evenly spread completion counts and starts it again
    `down_requests` completions later (same port: the engines' URL stays valid)."""

    def __init__(self, server: EmbeddedValkey, config: StoreSoakConfig) -> None:
        self.server = server
        every = config.num_requests / (config.restarts + 1)
        self.kill_at = [round(every * (k + 1)) for k in range(config.restarts)]
        self.down_requests = config.down_requests
        self.start_at: int | None = None
        self.restarts_done = 0

    def __call__(self, completed: int) -> None:
        if self.start_at is not None and completed >= self.start_at:
            self.server.start()
            self.start_at = None
            self.restarts_done += 1
        if self.kill_at and completed >= self.kill_at[0]:
            self.kill_at.pop(0)
            self.server.kill()
            self.start_at = completed + self.down_requests

    def finish(self) -> None:
        if self.start_at is not None:  # the run ended while down: still counts as restarted
            self.server.start()
            self.start_at = None
            self.restarts_done += 1


def _engine_config(model: Any, drafter: Any, config: StoreSoakConfig, store_url: str | None):
    from speckv.engine.engine_args import engine_config
    from speckv.engine.speculative import speculative_args

    tokens_per_request = config.prefix_len + config.suffix_len + config.output_len
    per_engine = -(-config.max_concurrency // config.num_engines)
    # room for the requests in flight and a few prefixes more, not for the whole workload: the
    # local cache evicts, so later requests need the store (or recompute)
    num_blocks = (per_engine + 2) * (tokens_per_request // config.block_size + 2 +
                                     config.num_spec_tokens)
    store = {} if store_url is None else {
        "kv_connector": "store", "kv_store_url": store_url,
        "kv_store_timeout_s": config.store_timeout_s,
    }
    return engine_config(block_size=config.block_size, num_blocks=num_blocks,
                         max_num_seqs=per_engine, dtype=str(model.dtype),
                         device=str(model.device), hash_seed="0",
                         **speculative_args(drafter, config.num_spec_tokens), **store)


def run_store_soak(config: StoreSoakConfig, spec: ModelSpec, model: Any, drafter: Any,
                   vocab_size: int, progress: bool = True) -> StoreSoakResult:
    """`model` and `drafter`: the weights `spec` builds in every engine process (the parent
    needs them only for the engine config)."""
    from tqdm import tqdm

    workload = prefix_repetition(
        PrefixRepetitionConfig(config.prefix_len, config.suffix_len, config.num_prefixes,
                               config.output_len, config.num_requests, config.seed),
        vocab_size)
    prompts = [request.prompt_token_ids for request in workload]
    max_tokens = [request.output_len for request in workload]
    arrivals = [0.0] * len(workload)
    prompt_tokens = sum(map(len, prompts))
    result = StoreSoakResult(config)
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(EmbeddedValkey(int(config.store_gb * GIB)))
        workers = stack.enter_context(EngineWorkers(spec, config.num_engines))

        def run(store_url: str | None, restarter: _Restarter | None, label: str):
            workers.open([_engine_config(model, drafter, config, store_url)] *
                         config.num_engines, drafter is not None, reset_store=False)
            bar = tqdm(total=len(workload), desc=label, disable=not progress, leave=False)

            def on_finished(completed: int) -> None:
                bar.update(1)
                if restarter is not None:
                    restarter(completed)

            try:
                drive = drive_round_robin(workers, prompts, max_tokens, arrivals,
                                          config.max_concurrency, on_finished)
            finally:
                bar.close()
                if restarter is not None:
                    restarter.finish()
            return drive, workers.close_engines()

        reference, _ = run(None, None, "no store")
        restarter = _Restarter(server, config)
        with_store, summaries = run(server.url, restarter, "store, restarted")
    outputs = [output for output in with_store.outputs if output is not None]
    result.completed = sum(output.finished for output in outputs)
    result.errors = sum(output.finish_reason == "error" for output in outputs)
    result.mismatched = [index for index, (ours, peer) in
                         enumerate(zip(with_store.outputs, reference.outputs))
                         if ours is None or ours.token_ids != peer.token_ids]
    result.outputs_equal = not result.mismatched
    result.restarts_done = restarter.restarts_done
    result.hit_rate = sum(o.num_cached_tokens for o in outputs) / prompt_tokens
    result.store_hit_rate = sum(o.num_external_cached_tokens for o in outputs) / prompt_tokens
    result.no_store_hit_rate = sum(o.num_cached_tokens for o in reference.outputs) / prompt_tokens
    result.duration_s = with_store.duration_s
    result.no_store_duration_s = reference.duration_s
    result.engines = summaries
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = StoreSoakConfig()
    parser.add_argument("--model", default="builtin", help="'builtin', an HF dir or a .gguf")
    parser.add_argument("--speculative-model", default="builtin",
                        help="drafter dir, 'builtin' (the EAGLE head) or 'none'")
    parser.add_argument("--engines", type=int, default=defaults.num_engines)
    parser.add_argument("--requests-per-engine", type=int, default=defaults.requests_per_engine)
    parser.add_argument("--restart-store", type=int, default=defaults.restarts,
                        help="times the store is killed and started again (default "
                        "%(default)s)")
    parser.add_argument("--down-requests", type=int, default=defaults.down_requests,
                        help="completions while the store is down, per restart")
    parser.add_argument("--prefix-len", type=int, default=defaults.prefix_len)
    parser.add_argument("--suffix-len", type=int, default=defaults.suffix_len)
    parser.add_argument("--num-prefixes", type=int, default=defaults.num_prefixes)
    parser.add_argument("--output-len", type=int, default=defaults.output_len)
    parser.add_argument("--max-concurrency", type=int, default=defaults.max_concurrency,
                        help="requests in flight over all engines")
    parser.add_argument("--kv-store-timeout", type=float, default=defaults.store_timeout_s)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from speckv.engine.llm import load_model
    from speckv.engine.speculative import load_drafter_model

    config = StoreSoakConfig(num_engines=args.engines,
                             requests_per_engine=args.requests_per_engine,
                             restarts=args.restart_store, down_requests=args.down_requests,
                             prefix_len=args.prefix_len, suffix_len=args.suffix_len,
                             num_prefixes=args.num_prefixes, output_len=args.output_len,
                             max_concurrency=args.max_concurrency,
                             store_timeout_s=args.kv_store_timeout, seed=args.seed)
    if args.threads < 1:
        raise ValueError("--threads must be >= 1")
    import torch

    torch.set_num_threads(args.threads)
    drafter_name = None if args.speculative_model == "none" else args.speculative_model
    model, _ = load_model(args.model, args.dtype, "cpu", progress=not args.json)
    drafter = load_drafter_model(drafter_name, model) if drafter_name else None
    spec = ModelSpec(args.model, args.dtype, drafter_name, threads=args.threads)
    started = time.perf_counter()
    result = run_store_soak(config, spec, model, drafter, model.config.vocab_size,
                            progress=not args.json)
    if args.json:
        print(json.dumps({**asdict(result), "passed": result.passed,
                          "integrity_ok": result.integrity_ok}))
        return 0 if result.passed else 1
    _print(result, time.perf_counter() - started)
    return 0 if result.passed else 1


def _print(result: StoreSoakResult, elapsed_s: float) -> None:
    config = result.config
    table = Table(title=f"store soak: {config.num_engines} engine processes x "
                        f"{config.requests_per_engine} requests, one embedded store killed and "
                        f"restarted {config.restarts}x (down for {config.down_requests} "
                        f"completions each), max concurrency {config.max_concurrency}")
    table.add_column("measure")
    table.add_column("with the store", justify="right")
    table.add_column("no store (peer)", justify="right")
    table.add_row("requests completed", f"{result.completed} / {config.num_requests}",
                  f"{config.num_requests} / {config.num_requests}")
    table.add_row("greedy outputs equal the no-store run",
                  "yes" if result.outputs_equal else
                  f"NO ({len(result.mismatched)} differ)", "-")
    table.add_row("store restarts done", str(result.restarts_done), "-")
    table.add_row("prefix-cache hit rate (of it from the store)",
                  f"{100 * result.hit_rate:.1f}% ({100 * result.store_hit_rate:.1f}%)",
                  f"{100 * result.no_store_hit_rate:.1f}%")
    table.add_row("duration s", f"{result.duration_s:.1f}", f"{result.no_store_duration_s:.1f}")
    engines = " / ".join(f"engine {index}" for index in range(len(result.engines)))
    table.add_row(f"check_integrity() ({engines})", " / ".join(
        "ok" if engine.integrity_ok else f"FAILED: {engine.integrity_error}"
        for engine in result.engines), "-")
    for name in STORE_COUNTERS:
        table.add_row(f"{name} ({engines})", " / ".join(
            str(engine.connector_stats.get("store", {}).get(name, "-"))
            for engine in result.engines), "-")
    Console().print(table)
    verdict = "PASS" if result.passed else "FAIL"
    print(f"verdict: {verdict} in {elapsed_s:.0f} s")
