"""`speckv bench soak`: a long random run of the real scheduler and cache, checked every step.

The cache state machine of the tests, at scale and outside pytest: random requests over a few
shared prefixes, drafts accepted and rejected, chunked prefill under a small token budget,
preemption under block pressure, aborts (waiting, running, mid-speculation) and prefix-cache
resets, driven through `EngineCore` with the toy runner (`speckv.simulation`). After every
operation the pool's integrity is checked (`KVCacheManager.check_integrity`); on every hit the
toy runner checks that each hit slot holds the target KV and draft KV a cold run would write.
Hits are also checked for shape (at most N - 1 tokens, whole alignment units). The first
violation stops the run and is reported with the operation index and seed to replay it.

One operation is one of: add a request, one engine step, abort a request, reset the prefix
cache (weights 30 / 60 / 8 / 2; adds stop while the queue is full).

With `--kv-connector offload|disk|offload,disk` the run also drives the real KV tiers: the toy
runner's symbolic KV lives in real paged tensors (`PagedSymbolicKV`) that the real connector
stores (on its copy thread), evicts (the tiers are small: `--tier-blocks`) and loads back; a
prefix-cache reset sometimes clears the tiers too, and `--fault-rate` fails that share of
block loads (the request recomputes from the first failed block). Checked on top: every block a
tier stores or serves holds the KV its header names, and after every step every scheduled
request's computed positions hold what a cold run writes.

`--copy-mode` says who runs the tiers' stores. `replayable` (the default): no copy thread; the
stores run at the points a schedule seeded from `--seed` picks (between lookups, pins, the
saves of one snapshot pass, fetches), so a violation replays exactly from its seed.
`threaded`: the real copy thread, whose timing no seed fixes; a violation found that way is
looked for again over many seeds in replayable mode.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections.abc import Iterable
from contextlib import ExitStack
from dataclasses import asdict, dataclass

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from speckv.cache import KVCacheManager
from speckv.cache.drafter_policy import drafter_policy, resolve_hash_mode
from speckv.cache.specs import parse_group_specs
from speckv.connectors import ConnectorConfig, KVConnector, TierIdentity, make_connector
from speckv.connectors.copy_schedule import COPY_MODES
from speckv.connectors.host_pool import GIB
from speckv.engine.messages import EngineCoreOutput, FinishReason
from speckv.engine.request import Request
from speckv.engine.speculative import resolve_connector_hash_mode
from speckv.simulation import HitMismatch, PagedSymbolicKV, SymbolicKV, instrument_tiers, toy_core
from speckv.simulation.tiers import CheckedStore
from speckv.simulation.toy_runner import ToyRunner

VOCAB_SIZE = 50  # small: drafts from the toy model are often right, prefixes repeat
OPERATIONS = ("add", "step", "abort", "reset")
WEIGHTS = (30, 60, 8, 2)


@dataclass(frozen=True)
class SoakConfig:
    num_ops: int = 100_000
    seed: int = 0
    groups: str = "full:4"
    drafter: str = "eagle"
    num_modules: int = 1
    legacy: bool = False  # legacy hashes + the drop instead of lookahead hashes
    num_spec_tokens: int = 3
    num_blocks: int = 40  # per group; small on purpose: the run evicts and preempts
    # one pool per group of these sizes ("40,40,12"); None: one pool of num_blocks per group
    group_blocks: str | None = None
    max_num_batched_tokens: int = 24
    max_num_seqs: int = 8
    max_waiting: int = 16
    kv_connector: str | None = None  # "offload", "disk", "offload,disk": real tiers below
    tier_blocks: int = 48  # each tier's capacity in blocks: small, so tiers evict
    fault_rate: float = 0.0  # share of tier block loads that fail (recomputed)
    copy_mode: str = "replayable"  # who runs the tiers' stores: a seeded schedule, or a thread

    def __post_init__(self) -> None:
        if self.copy_mode not in COPY_MODES:
            raise ValueError(f"--copy-mode must be one of {', '.join(COPY_MODES)}, "
                             f"got {self.copy_mode!r}")
        if self.num_ops < 1:
            raise ValueError(f"--ops must be >= 1, got {self.num_ops}")
        if self.kv_connector is not None:
            ConnectorConfig.parse(self.kv_connector, offload_dir="-")
            if not self.groups.startswith("full:"):
                raise ValueError("--kv-connector needs a full-attention group first "
                                 "(--groups full:B,...)")
            if self.tier_blocks < 1:
                raise ValueError(f"--tier-blocks must be >= 1, got {self.tier_blocks}")
        if not 0.0 <= self.fault_rate < 1.0:
            raise ValueError(f"--fault-rate must be in [0, 1), got {self.fault_rate}")
        if self.fault_rate and self.kv_connector is None:
            raise ValueError("--fault-rate needs --kv-connector")
        if self.num_blocks < 8:
            raise ValueError(f"--num-blocks must be >= 8, got {self.num_blocks}")
        drafter_policy(self.drafter, self.num_modules)
        specs = parse_group_specs(self.groups)
        if self.group_blocks is not None:
            counts = self.pool_sizes
            if len(counts) != len(specs) or min(counts) < 4:
                raise ValueError(f"--group-blocks needs one count >= 4 per group of "
                                 f"{self.groups!r}, got {self.group_blocks!r}")
            if self.kv_connector is not None:
                raise ValueError("--group-blocks does not combine with --kv-connector")

    @property
    def pool_sizes(self) -> list[int]:
        try:
            return [int(part) for part in (self.group_blocks or "").split(",")]
        except ValueError:
            raise ValueError(f"--group-blocks must be counts like 40,40,12, got "
                             f"{self.group_blocks!r}") from None


@dataclass
class SoakResult:
    config: SoakConfig
    num_ops: int = 0  # operations run
    num_steps: int = 0
    num_requests: int = 0
    num_finished: int = 0
    num_aborted: int = 0
    num_no_fit: int = 0  # requests that outgrew the cache (finish reason "error")
    num_preemptions: int = 0
    num_hit_tokens_checked: int = 0
    num_resets: int = 0
    # with --kv-connector
    num_external_hit_tokens: int = 0  # prompt tokens loaded from a tier on first schedule
    num_load_failures: int = 0  # requests cut from a step by a failed load (recomputed)
    num_tier_stores_checked: int = 0  # blocks a tier stored, checked against their header
    num_tier_loads_checked: int = 0  # blocks a tier served, checked against their header
    num_tier_evictions: int = 0
    num_tier_resets: int = 0
    num_positions_checked: int = 0  # computed positions checked after every step
    elapsed_s: float = 0.0
    violation: str | None = None  # the first one; None: a clean run

    @property
    def ops_per_s(self) -> float:
        return self.num_ops / self.elapsed_s if self.elapsed_s else 0.0


def _soak_connector(config: SoakConfig, kv: PagedSymbolicKV, directory: str
                    ) -> KVConnector:
    """The configured tiers, sized to `tier_blocks` blocks of the symbolic KV's layout."""
    block_bytes = sum(cache.storage[:, :, 0].numel() * 4
                      for cache in (kv.target_cache, kv.draft_cache))
    size_gib = (config.tier_blocks * block_bytes + block_bytes // 2) / GIB
    assert config.kv_connector is not None
    connector_config = ConnectorConfig.parse(config.kv_connector, offload_gib=size_gib,
                                             offload_dir=directory, disk_gib=size_gib,
                                             max_pending_blocks=16)
    return make_connector(connector_config, TierIdentity("soak", "sha256", "0"))


def run_soak(config: SoakConfig, progress: bool = True) -> SoakResult:
    with ExitStack() as stack:
        return _run_soak(config, progress, stack)


def _random_prompt(rng: random.Random, prefixes: list[list[int]]) -> list[int]:
    """A prompt that starts with part of one of the shared prefixes, then a few random ids."""
    prefix = prefixes[rng.randrange(len(prefixes))]
    return prefix[: rng.randrange(1, len(prefix))] + [
        rng.randrange(1, VOCAB_SIZE) for _ in range(rng.randrange(0, 8))]


def _check_integrity(manager: KVCacheManager, stores: list[CheckedStore]) -> None:
    """After every operation: the pools' invariants, and no tier served or stored a wrong
    block (AssertionError)."""
    manager.check_integrity()
    for store in stores:
        if store.violations:
            raise AssertionError(store.violations[0])


def _count_finished(result: SoakResult, outputs: Iterable[EngineCoreOutput]) -> None:
    """Tally one step's finished requests into `result`."""
    for output in outputs:
        if output.finish_reason is not None:
            result.num_external_hit_tokens += output.num_external_cached_tokens
        if output.finish_reason is FinishReason.ERROR:
            result.num_no_fit += 1
        elif output.finish_reason is not None:
            result.num_finished += 1
        if output.finish_reason is not None:
            result.num_preemptions += output.num_preemptions


def _count_tiers(result: SoakResult, connector: KVConnector, stores: list[CheckedStore],
                 runner: ToyRunner) -> None:
    """After the run: what the tiers stored, loaded and evicted, all checked."""
    connector.flush(timeout_s=60)
    for store in stores:  # what the copy thread stored after the last check
        if store.violations and result.violation is None:
            result.violation = f"after the run: {store.violations[0]}"
    result.num_load_failures = runner.num_cut
    result.num_positions_checked = runner.num_positions_checked
    result.num_tier_stores_checked = sum(store.num_checked_stores for store in stores)
    result.num_tier_loads_checked = sum(store.num_checked_loads for store in stores)
    result.num_tier_evictions = sum(stats.evicted_blocks
                                    for stats in connector.stats().values())


def _run_soak(config: SoakConfig, progress: bool, stack: ExitStack) -> SoakResult:
    """The soak's operation loop: one seeded sequence of adds, steps, aborts, resets and faults,
    kept in one function so the order of operations a seed replays reads top to bottom."""
    rng = random.Random(config.seed)
    policy = drafter_policy(config.drafter, config.num_modules)
    mode = resolve_hash_mode(policy, disable_lookahead_block_hashes=config.legacy)
    specs = parse_group_specs(config.groups)
    num_blocks = len(specs) * config.num_blocks
    depth = policy.draft_kv_lookahead_tokens
    connector: KVConnector | None = None
    stores: list[CheckedStore] = []
    kv: SymbolicKV = SymbolicKV(num_blocks, specs[0].block_size, depth)
    if config.kv_connector is not None:
        kv = PagedSymbolicKV(num_blocks, specs[0].block_size, depth)
        directory = stack.enter_context(tempfile.TemporaryDirectory(prefix="speckv-soak-"))
        connector = _soak_connector(config, kv, directory)
        stack.callback(connector.shutdown)
        mode = resolve_connector_hash_mode(policy, connector=connector,
                                           disable_lookahead_block_hashes=config.legacy)
        stores = instrument_tiers(
            connector, depth, fault_rate=config.fault_rate, seed=config.seed,
            copy_seed=config.seed if config.copy_mode == "replayable" else None)
    pools: int | list[int] = num_blocks
    if config.group_blocks is not None:  # a pool per group: every group's own block ids
        pools = config.pool_sizes
        kv = SymbolicKV(pools[0], specs[0].block_size, depth)
    manager = KVCacheManager(specs, pools, mode)
    hashing = manager.block_hashing("sha256", "0")
    num_spec = config.num_spec_tokens if policy.draft_kv_lookahead_tokens else 0
    block_size = min(spec.block_size for spec in specs)
    core = toy_core(
        manager, num_spec, vocab_size=VOCAB_SIZE, kv=kv,
        check_draft_kv=not mode.drops_last_unit,
        max_num_batched_tokens=max(config.max_num_batched_tokens, 1 + num_spec),
        max_num_seqs=config.max_num_seqs,
        connector=connector, check_computed_kv=connector is not None,
    )
    scheduler = core.scheduler
    prefixes = [[rng.randrange(1, VOCAB_SIZE) for _ in range(16 * block_size)]
                for _ in range(4)]
    result = SoakResult(config)
    start = time.perf_counter()
    bar = tqdm(total=config.num_ops, desc="soak", unit="op", disable=not progress,
               mininterval=0.5)
    try:
        for index in range(config.num_ops):
            operation = rng.choices(OPERATIONS, WEIGHTS)[0]
            if operation == "add" and len(scheduler.waiting) < config.max_waiting:
                prompt = _random_prompt(rng, prefixes)
                result.num_requests += 1
                scheduler.add_request(Request(f"r{result.num_requests}", prompt, hashing,
                                              max_tokens=rng.randrange(1, 12)))
            elif operation == "step" and scheduler.has_unfinished_requests():
                core.runner.num_accept = rng.randrange(0, num_spec + 1)
                _count_finished(result, core.step())
                result.num_steps += 1
            elif operation == "abort" and scheduler.has_unfinished_requests():
                victim = scheduler.requests[rng.choice(sorted(scheduler.requests))]
                result.num_preemptions += victim.num_preemptions
                scheduler.finish_requests([victim.request_id], FinishReason.ABORT)
                result.num_aborted += 1
            elif operation == "reset":
                result.num_resets += manager.reset_prefix_cache()
                if connector is not None and rng.random() < 0.25:
                    result.num_tier_resets += connector.reset_cache()
            _check_integrity(manager, stores)
            result.num_ops = index + 1
            if index % 1024 == 0:
                bar.update(index + 1 - bar.n)
    except (HitMismatch, AssertionError) as error:
        result.violation = (f"operation {result.num_ops + 1} (seed {config.seed}): "
                            f"{type(error).__name__}: {error}")
    finally:
        bar.update(result.num_ops - bar.n)
        bar.close()
    result.num_hit_tokens_checked = core.runner.num_hits_checked
    if connector is not None:
        _count_tiers(result, connector, stores, core.runner)
    result.elapsed_s = time.perf_counter() - start
    return result


def add_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = SoakConfig()
    parser.add_argument("--ops", type=int, default=defaults.num_ops,
                        help="operations to run (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--groups", default=defaults.groups,
                        help="KV cache groups, e.g. full:4,swa:16:4,mamba:16 "
                        "(default: %(default)s)")
    parser.add_argument("--drafter", default=defaults.drafter,
                        help="eagle, eagle3, mtp, none, ... (default: %(default)s)")
    parser.add_argument("--mtp-num-modules", type=int, default=defaults.num_modules)
    parser.add_argument("--mode", choices=("lookahead", "legacy"), default="lookahead")
    parser.add_argument("--num-blocks", type=int, default=defaults.num_blocks,
                        help="KV blocks per group (default: %(default)s)")
    parser.add_argument("--group-blocks", default=None, metavar="N,N,...",
                        help="a KV pool per group of these sizes (e.g. 40,40,12) instead of "
                        "one pool of --num-blocks per group")
    parser.add_argument("--kv-connector", default=None, metavar="NAMES",
                        help="drive real KV tiers too: offload, disk or offload,disk")
    parser.add_argument("--tier-blocks", type=int, default=defaults.tier_blocks,
                        help="each tier's capacity, blocks (default: %(default)s)")
    parser.add_argument("--fault-rate", type=float, default=defaults.fault_rate,
                        help="share of tier block loads that fail (default: %(default)s)")
    parser.add_argument("--copy-mode", choices=COPY_MODES, default=defaults.copy_mode,
                        help="who runs the tiers' stores: replayable (a schedule drawn from "
                        "--seed; a violation replays) or threaded (the real copy thread) "
                        "(default: %(default)s)")
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    config = SoakConfig(num_ops=args.ops, seed=args.seed, groups=args.groups,
                        drafter=args.drafter, num_modules=args.mtp_num_modules,
                        legacy=args.mode == "legacy", num_blocks=args.num_blocks,
                        group_blocks=args.group_blocks,
                        kv_connector=args.kv_connector, tier_blocks=args.tier_blocks,
                        fault_rate=args.fault_rate, copy_mode=args.copy_mode)
    result = run_soak(config, progress=not args.json)
    if args.json:
        print(json.dumps({**asdict(result), "ops_per_s": round(result.ops_per_s, 1)}))
    else:
        pools = f" (pools {config.group_blocks})" if config.group_blocks else ""
        table = Table(title=f"soak: {config.groups}{pools}, {config.drafter}"
                            f"{'' if config.num_modules == 1 else f' x{config.num_modules}'}, "
                            f"{args.mode}, seed {config.seed}"
                            + (f", {config.kv_connector} ({config.copy_mode} copies)"
                               if config.kv_connector is not None else ""))
        table.add_column("measure")
        table.add_column("value", justify="right")
        for label, value in [
            ("operations", f"{result.num_ops:,}"), ("engine steps", f"{result.num_steps:,}"),
            ("requests added", f"{result.num_requests:,}"),
            ("finished / aborted / no fit",
             f"{result.num_finished:,} / {result.num_aborted:,} / {result.num_no_fit:,}"),
            ("preemptions", f"{result.num_preemptions:,}"),
            ("hit tokens checked against a cold run", f"{result.num_hit_tokens_checked:,}"),
            ("prefix-cache resets", f"{result.num_resets:,}"),
        ]:
            table.add_row(label, value)
        if config.kv_connector is not None:
            for label, value in [
                ("tier hit tokens (external)", f"{result.num_external_hit_tokens:,}"),
                ("tier blocks stored / served, checked",
                 f"{result.num_tier_stores_checked:,} / {result.num_tier_loads_checked:,}"),
                ("tier evictions / resets",
                 f"{result.num_tier_evictions:,} / {result.num_tier_resets:,}"),
                ("failed loads recomputed", f"{result.num_load_failures:,}"),
                ("computed positions checked", f"{result.num_positions_checked:,}"),
            ]:
                table.add_row(label, value)
        for label, value in [
            ("operations/s", f"{result.ops_per_s:,.0f}"),
        ]:
            table.add_row(label, value)
        Console().print(table)
    verdict = "0 violations" if result.violation is None else f"VIOLATION at {result.violation}"
    print(f"verdict: {verdict} in {result.num_ops:,} operations")
    if result.violation is not None and config.kv_connector is not None:
        if config.copy_mode == "replayable":
            print("replay: the same command replays it exactly (the copy schedule is drawn "
                  "from --seed)")
        else:
            print("replay: --copy-mode threaded depends on the copy thread's timing; look for "
                  "it with --copy-mode replayable over many seeds")
    return 0 if result.violation is None else 1
