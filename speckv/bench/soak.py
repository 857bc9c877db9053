"""`speckv bench soak`: a long random run of the real scheduler and cache, checked every step.

The cache state machine of the tests, at scale and outside pytest: random requests over a few
shared prefixes, drafts accepted and rejected, chunked prefill under a small token budget,
preemption under block pressure, aborts (waiting, running, mid-speculation) and prefix-cache
resets, driven through `EngineCore` with the toy runner (`speckv.testing`). After every
operation the pool's integrity is checked (`KVCacheManager.check_integrity`); on every hit the
toy runner checks that each hit slot holds the target KV and draft KV a cold run would write.
Hits are also checked for shape (at most N - 1 tokens, whole alignment units). The first
violation stops the run and is reported with the operation index and seed to replay it.

One operation is one of: add a request, one engine step, abort a request, reset the prefix
cache (weights 30 / 60 / 8 / 2; adds stop while the queue is full).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass

from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from speckv.cache import KVCacheManager
from speckv.cache.specs import parse_group_specs
from speckv.engine.messages import FinishReason
from speckv.engine.request import Request
from speckv.spec.policy import drafter_policy, resolve_hash_mode
from speckv.testing import HitMismatch, SymbolicKV, toy_core

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
    max_num_batched_tokens: int = 24
    max_num_seqs: int = 8
    max_waiting: int = 16

    def __post_init__(self) -> None:
        if self.num_ops < 1:
            raise ValueError(f"--ops must be >= 1, got {self.num_ops}")
        if self.num_blocks < 8:
            raise ValueError(f"--num-blocks must be >= 8, got {self.num_blocks}")
        drafter_policy(self.drafter, self.num_modules)
        parse_group_specs(self.groups)


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
    elapsed_s: float = 0.0
    violation: str | None = None  # the first one; None: a clean run

    @property
    def ops_per_s(self) -> float:
        return self.num_ops / self.elapsed_s if self.elapsed_s else 0.0


def run_soak(config: SoakConfig, progress: bool = True) -> SoakResult:
    rng = random.Random(config.seed)
    policy = drafter_policy(config.drafter, config.num_modules)
    mode = resolve_hash_mode(policy, disable_lookahead_block_hashes=config.legacy)
    specs = parse_group_specs(config.groups)
    num_blocks = len(specs) * config.num_blocks
    manager = KVCacheManager(specs, num_blocks, mode)
    hashing = manager.block_hashing("sha256", "0")
    num_spec = config.num_spec_tokens if policy.draft_kv_lookahead_tokens else 0
    block_size = min(spec.block_size for spec in specs)
    core = toy_core(
        manager, num_spec, vocab_size=VOCAB_SIZE,
        kv=SymbolicKV(num_blocks, specs[0].block_size, policy.draft_kv_lookahead_tokens),
        check_draft_kv=not mode.drops_last_unit,
        max_num_batched_tokens=max(config.max_num_batched_tokens, 1 + num_spec),
        max_num_seqs=config.max_num_seqs,
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
                prefix = prefixes[rng.randrange(len(prefixes))]
                prompt = prefix[: rng.randrange(1, len(prefix))] + [
                    rng.randrange(1, VOCAB_SIZE) for _ in range(rng.randrange(0, 8))]
                result.num_requests += 1
                scheduler.add_request(Request(f"r{result.num_requests}", prompt, hashing,
                                              max_tokens=rng.randrange(1, 12)))
            elif operation == "step" and scheduler.has_unfinished_requests():
                core.runner.num_accept = rng.randrange(0, num_spec + 1)
                for output in core.step():
                    if output.finish_reason is FinishReason.ERROR:
                        result.num_no_fit += 1
                    elif output.finish_reason is not None:
                        result.num_finished += 1
                    if output.finish_reason is not None:
                        result.num_preemptions += output.num_preemptions
                result.num_steps += 1
            elif operation == "abort" and scheduler.has_unfinished_requests():
                victim = scheduler.requests[rng.choice(sorted(scheduler.requests))]
                result.num_preemptions += victim.num_preemptions
                scheduler.finish_requests([victim.request_id], FinishReason.ABORT)
                result.num_aborted += 1
            elif operation == "reset":
                result.num_resets += manager.reset_prefix_cache()
            manager.check_integrity()
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
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    config = SoakConfig(num_ops=args.ops, seed=args.seed, groups=args.groups,
                        drafter=args.drafter, num_modules=args.mtp_num_modules,
                        legacy=args.mode == "legacy", num_blocks=args.num_blocks)
    result = run_soak(config, progress=not args.json)
    if args.json:
        print(json.dumps({**asdict(result), "ops_per_s": round(result.ops_per_s, 1)}))
    else:
        table = Table(title=f"soak: {config.groups}, {config.drafter}"
                            f"{'' if config.num_modules == 1 else f' x{config.num_modules}'}, "
                            f"{args.mode}, seed {config.seed}")
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
            ("operations/s", f"{result.ops_per_s:,.0f}"),
        ]:
            table.add_row(label, value)
        Console().print(table)
    verdict = "0 violations" if result.violation is None else f"VIOLATION at {result.violation}"
    print(f"verdict: {verdict} in {result.num_ops:,} operations")
    return 0 if result.violation is None else 1
