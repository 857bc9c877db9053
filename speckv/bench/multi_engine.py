"""`speckv bench prefix-repetition --engines N`: the modes on N engine processes.

Owns running each mode of the prefix-repetition bench on `EngineWorkers` (one engine per
process, request i on engine i mod N) and, with `--kv-connector store`, the one store they
share: the embedded Valkey server is started here once for all modes and engines (or the
engines use `--kv-store-url`). Each mode opens fresh engines, deletes its namespace from the
store first, and closes them at the end, checking `check_integrity()` in every engine.
"""

from __future__ import annotations

import contextlib
from typing import Any

from speckv.cluster.engine_pool import EngineWorkers, ModelSpec, drive_round_robin
from speckv.connectors.embedded_valkey import GIB, EmbeddedValkey
from speckv.connectors.shared_store import EMBEDDED
from speckv.measure.prefix_repetition import (
    ModeResult,
    RunOptions,
    arrival_times,
    engine_config,
    summarize,
)
from speckv.workloads import WorkloadRequest


def uses_store(kv_connector: str | None) -> bool:
    return kv_connector is not None and "store" in kv_connector.split(",")


def shared_store_url(stack: contextlib.ExitStack, options: RunOptions) -> str:
    """The URL every engine's store connector uses: the embedded server, started once here
    (stopped with `stack`), or the user's `--kv-store-url`."""
    if options.kv_store_url != EMBEDDED:
        return options.kv_store_url
    server = stack.enter_context(EmbeddedValkey(int(options.kv_store_gib * GIB)))
    return server.url


def run_modes_multi_engine(model: Any, drafter: Any, spec: ModelSpec,
                           workload: list[WorkloadRequest], options: RunOptions,
                           modes: tuple[str, ...]) -> list[ModeResult]:
    from tqdm import tqdm

    prompts = [request.prompt_token_ids for request in workload]
    max_tokens = [request.output_len for request in workload]
    arrivals = arrival_times(len(workload), options.request_rate, options.seed)
    results = []
    with contextlib.ExitStack() as stack:
        url = (shared_store_url(stack, options) if uses_store(options.kv_connector)
               else options.kv_store_url)
        workers = stack.enter_context(EngineWorkers(spec, options.num_engines))
        for mode in modes:
            built = [engine_config(model, drafter, mode, options, url)
                     for _ in range(options.num_engines)]
            opened = workers.open([config for config, _ in built], built[0][1],
                                  reset_store=built[0][0].kv_connector is not None)
            (hash_mode, tier), *others = opened
            assert all(other == (hash_mode, tier) for other in others), opened
            progress = tqdm(total=len(workload), desc=f"{mode} x{options.num_engines}",
                            disable=not options.progress, leave=False)
            try:
                run = drive_round_robin(workers, prompts, max_tokens, arrivals,
                                        options.max_concurrency,
                                        on_finished=lambda _count, bar=progress: bar.update(1))
            finally:
                progress.close()
            summaries = workers.close_engines()
            for index, summary in enumerate(summaries):
                if not summary.integrity_ok:
                    raise RuntimeError(f"{mode}: engine {index} failed check_integrity(): "
                                       f"{summary.integrity_error}")
            results.append(summarize(mode, hash_mode, tier, workload, run.outputs,
                                     run.tpots_ms(), run.duration_s, options))
    return results
