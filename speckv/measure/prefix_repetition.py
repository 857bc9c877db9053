"""vLLM's prefix_repetition workload through the real engine, once per mode, and its summary.

Owns the modes table, the run options, the engine configuration of a mode, driving one
engine through a workload (arrivals, the concurrency cap), summarising what it did into a
`ModeResult`, running every mode in this process (`run_modes`) and the one-row-per-mode table
(`render_compact`) the demo prints. `speckv bench prefix-repetition`
(`speckv/bench/prefix_repetition.py`) renders the full table; `bench/multi_engine.py` runs the
modes on several engine processes with the same configuration and summary.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table
from tqdm import tqdm

from speckv.workloads import (
    WorkloadRequest,
    oracle_hit_tokens,
)

MODES: dict[str, dict[str, bool]] = {
    "no spec": {"speculative": False, "legacy": False, "reuse": False},
    "legacy drop": {"speculative": True, "legacy": True, "reuse": False},
    "lookahead": {"speculative": True, "legacy": False, "reuse": False},
    "lookahead + block reuse": {"speculative": True, "legacy": False, "reuse": True},
}
REUSE_MODE = "lookahead + block reuse"
NO_TIER_MODE = "lookahead, no tier"  # added when the other modes run with a KV tier


@dataclass(frozen=True)
class RunOptions:
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory_bytes: int = 256 * 1024**2
    num_spec_tokens: int = 3
    request_rate: float = float("inf")  # requests/s; inf: all at once
    max_concurrency: int = 8
    max_num_batched_tokens: int = 2048
    seed: int = 0
    progress: bool = True
    # a KV tier under the local cache ("offload", "disk", "offload,disk"; None: none)
    kv_connector: str | None = None
    kv_offload_gib: float = 4.0
    kv_offload_dir: str | None = None  # the disk tier's directory (each mode: a fresh one)
    kv_offload_disk_gib: float = 16.0
    kv_store_url: str = "embedded"  # with --engines > 1: one embedded server for all engines
    kv_store_gib: float = 4.0
    num_engines: int = 1  # engine processes, request i on engine i mod num_engines

    def __post_init__(self) -> None:
        if self.request_rate <= 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.num_engines < 1:
            raise ValueError(f"--engines must be >= 1, got {self.num_engines}")
        if self.kv_connector is not None:
            from speckv.connectors import ConnectorConfig

            ConnectorConfig.parse(self.kv_connector, offload_gib=self.kv_offload_gib,
                                  offload_dir=self.kv_offload_dir,
                                  disk_gib=self.kv_offload_disk_gib,
                                  store_url=self.kv_store_url, store_gib=self.kv_store_gib)


@dataclass
class ModeResult:
    mode: str
    hash_mode: str
    hit_rate: float  # local + tier
    oracle_hit_rate: float
    requests_per_s: float
    output_tokens_per_s: float
    ttft_mean_ms: float
    ttft_median_ms: float
    ttft_p99_ms: float
    tpot_mean_ms: float
    acceptance_rate: float | None
    mean_acceptance_length: float | None
    num_preemptions: int
    duration_s: float
    outputs: list[list[int]] = field(repr=False, default_factory=list)
    tier: str = "-"  # the KV tier under the local cache ("-": none)
    tier_hit_rate: float = 0.0  # of hit_rate, tokens loaded from the tier
    num_engines: int = 1


def arrival_times(num_requests: int, rate: float, seed: int) -> list[float]:
    if rate == float("inf"):
        return [0.0] * num_requests
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num_requests)
    return np.cumsum(gaps).tolist()


def engine_config(model: Any, drafter: Any, mode: str, options: RunOptions,
                  store_url: str | None = None) -> tuple[Any, bool]:
    """(EngineConfig of `mode`, whether it runs the drafter). `store_url`: the store every
    engine of the mode shares (default: `options.kv_store_url`)."""
    from speckv.engine.engine_args import EngineArgs
    from speckv.engine.speculative import speculative_args

    spec = MODES["lookahead" if mode == NO_TIER_MODE else mode]
    mode_drafter = drafter if spec["speculative"] else None
    tier = {} if options.kv_connector is None or mode == NO_TIER_MODE else {
        "kv_connector": options.kv_connector, "kv_offload_gib": options.kv_offload_gib,
        "kv_offload_disk_gib": options.kv_offload_disk_gib,
        "kv_offload_dir": (tempfile.mkdtemp(prefix="mode-", dir=options.kv_offload_dir)
                           if options.kv_offload_dir is not None else None),
        "kv_store_url": store_url or options.kv_store_url, "kv_store_gib": options.kv_store_gib,
    }
    config = EngineArgs(
        block_size=options.block_size,
        num_blocks=options.num_blocks,
        kv_cache_memory_bytes=options.kv_cache_memory_bytes,
        max_num_seqs=options.max_concurrency,
        max_num_batched_tokens=options.max_num_batched_tokens,
        **speculative_args(mode_drafter, options.num_spec_tokens),
        disable_lookahead_block_hashes=spec["legacy"],
        disable_divergent_block_reuse=not spec["reuse"],
        dtype=str(model.dtype),  # EngineArgs drops the "torch." prefix
        device=str(model.device),
        hash_seed="0",
        **tier,
    ).create_engine_config()
    return config, mode_drafter is not None


def run_mode(model: Any, drafter: Any, workload: list[WorkloadRequest], mode: str,
             options: RunOptions) -> ModeResult:
    """One mode on a fresh engine (empty cache) over the whole workload."""
    from speckv.engine.llm_engine import LLMEngine

    config, with_drafter = engine_config(model, drafter, mode, options)
    with LLMEngine(model, config, drafter=drafter if with_drafter else None,
                   detokenize=False) as engine:
        return _drive(engine, workload, mode, options)


def _drive(engine: Any, workload: list[WorkloadRequest], mode: str, options: RunOptions
           ) -> ModeResult:
    from speckv.engine.sampling_params import SamplingParams

    arrivals = arrival_times(len(workload), options.request_rate, options.seed)
    pending = deque(range(len(workload)))
    index_of: dict[str, int] = {}
    first_token: dict[int, float] = {}
    finish: dict[int, float] = {}
    results: dict[int, Any] = {}
    progress = tqdm(total=len(workload), desc=mode, disable=not options.progress, leave=False)
    start = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - start
        while (pending and arrivals[pending[0]] <= now
               and engine.num_unfinished_requests < options.max_concurrency):
            index = pending.popleft()
            request = workload[index]
            params = SamplingParams(max_tokens=request.output_len, ignore_eos=True)
            index_of[engine.add_request(request.prompt_token_ids, params)] = index
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, min(0.05, arrivals[pending[0]] - now)))
            continue
        for output in engine.step():
            index = index_of[output.request_id]
            stamp = time.perf_counter()
            if output.token_ids and index not in first_token:
                first_token[index] = stamp
            if output.finished:
                finish[index] = stamp
                results[index] = output
                progress.update(1)
    duration = time.perf_counter() - start
    progress.close()
    ordered = [results[index] for index in range(len(workload))]
    tpots = [1000 * (finish[i] - first_token[i]) / (len(o.token_ids) - 1)
             for i, o in enumerate(ordered) if len(o.token_ids) > 1]
    tier = engine.connector.name if engine.connector is not None else "-"
    return summarize(mode, engine.hash_mode.label, tier, workload, ordered, tpots, duration,
                     options)


def summarize(mode: str, hash_mode: str, tier: str, workload: list[WorkloadRequest],
              ordered: list[Any], tpots_ms: list[float], duration_s: float,
              options: RunOptions) -> ModeResult:
    """A mode's row from its RequestOutputs (in workload order)."""
    from speckv.engine.outputs import acceptance_stats

    prompt_tokens = sum(len(r.prompt_token_ids) for r in workload)
    ttfts = sorted(1000 * (o.ttft_s or 0.0) for o in ordered)
    acceptance = acceptance_stats(ordered, options.num_spec_tokens)
    return ModeResult(
        mode=mode,
        hash_mode=hash_mode,
        hit_rate=sum(o.num_cached_tokens for o in ordered) / prompt_tokens,
        tier=tier,
        tier_hit_rate=sum(o.num_external_cached_tokens for o in ordered) / prompt_tokens,
        oracle_hit_rate=oracle_hit_tokens(workload, options.block_size) / prompt_tokens,
        requests_per_s=len(workload) / duration_s,
        output_tokens_per_s=sum(len(o.token_ids) for o in ordered) / duration_s,
        ttft_mean_ms=statistics.fmean(ttfts),
        ttft_median_ms=statistics.median(ttfts),
        ttft_p99_ms=ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))],
        tpot_mean_ms=statistics.fmean(tpots_ms) if tpots_ms else 0.0,
        acceptance_rate=acceptance[0] if acceptance else None,
        mean_acceptance_length=acceptance[1] if acceptance else None,
        num_preemptions=sum(o.num_preemptions for o in ordered),
        duration_s=duration_s,
        outputs=[list(o.token_ids) for o in ordered],
        num_engines=options.num_engines,
    )


def modes_for(options: RunOptions, modes: tuple[str, ...]) -> tuple[str, ...]:
    """The modes to run: with a KV tier no block reuse (not under a connector), and lookahead
    also without the tier."""
    if options.kv_connector is not None:
        modes = tuple(mode for mode in modes if mode != REUSE_MODE)  # not under a connector
        if "lookahead" in modes:
            modes = (*modes, NO_TIER_MODE)
    return modes


def run_modes(model: Any, drafter: Any, workload: list[WorkloadRequest], options: RunOptions,
              modes: tuple[str, ...] = tuple(MODES)) -> list[ModeResult]:
    """Every mode (`modes_for`) on a fresh engine in this process."""
    return [run_mode(model, drafter, workload, mode, options)
            for mode in modes_for(options, modes)]


def render_compact(results: list[ModeResult], title: str) -> Table:
    """One row per mode: the headline numbers."""
    table = Table(title=title)
    for column in ("mode", "hit", "oracle", "req/s", "tok/s", "TTFT ms", "acc len"):
        table.add_column(column, justify="left" if column == "mode" else "right",
                         no_wrap=True)
    for r in results:
        accept = "-" if r.mean_acceptance_length is None else f"{r.mean_acceptance_length:.2f}"
        table.add_row(r.mode, f"{100 * r.hit_rate:.1f}%",
                      f"{100 * r.oracle_hit_rate:.1f}%", f"{r.requests_per_s:.2f}",
                      f"{r.output_tokens_per_s:.1f}", f"{r.ttft_mean_ms:.0f}", accept)
    return table


def write_chart(results: list[ModeResult], path: Path, workload: str) -> None:
    """Hit rate (with the oracle line) and output tokens/s per mode, as a PNG."""
    from speckv.measure.charts import BarPanel, bar_pair_figure, save

    save(bar_pair_figure(
        [r.mode for r in results],
        BarPanel([100 * r.hit_rate for r in results], "prefix-cache hit rate (%)", "{:.0f}%",
                 "#4c72b0"),
        BarPanel([r.output_tokens_per_s for r in results], "output tokens/s", "{:.1f}",
                 "#55a868"),
        "prefix-cache hit rate and throughput per hash mode", workload,
        100 * results[0].oracle_hit_rate), path)
