"""`speckv bench retention`: the sliding-window retention scenario on the real cache.

Attention + sliding window (full-attention block 32, SWA block 16, window 1,024, so the
alignment unit U = 32), retention interval 8,192, four sequential requests sharing a
16,384-token prefix P, with 64-token suffixes:

    req 1: P + A            the producer
    req 2: P + B            diverges right after the checkpoint at 16,384
    req 3: P + A[:40] + C   diverges inside request 1's suffix
    req 4: P + A            a repeat of request 1

Under the legacy EAGLE drop a hit at checkpoint c is served at c - U, which needs the window
tail before c - U: kept tails must be U // B blocks wider (the fix). Without the fix, or with a
one-block widening, request 2 falls back to the previous checkpoint. Lookahead hashes need the
same widening for a sibling diverging exactly at c (the block ending at c has another successor
there), and gain a unit on requests 3 and 4, where the legacy drop still costs one.

`--model hybrid-swa` / `--model gemma4` runs the same scenario on tensors as well
(`retention_tensors.py`: the real engine on a random-init sliding-window model, Gemma 3 style or
a tiny Gemma 4, with a random-init MTP drafter and, for the gemma4_mtp rows, a random-init
Gemma 4 MTP assistant; default prefix 1,024, window 64, retention 512) beside the simulator at
the same sizes, and checks every hit's KV against a cold run.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass

from rich.console import Console
from rich.table import Table

from speckv.cache import KVCacheManager
from speckv.cache.drafter_policy import drafter_policy, resolve_hash_mode
from speckv.cache.retention import TailWidening
from speckv.cache.specs import FullAttentionSpec, SlidingWindowSpec
from speckv.engine.request import Request
from speckv.simulation import run_to_completion, toy_core


@dataclass(frozen=True)
class RetentionRow:
    label: str
    hash_mode: str
    cached_tokens: list[int]


def run_scenario(drafter: str, legacy: bool, widening: TailWidening, prefix_len: int,
                 retention: int, window: int, num_requests: int = 4) -> RetentionRow:
    policy = drafter_policy(drafter)  # MTP3: one module, 3 speculative tokens
    hash_mode = resolve_hash_mode(policy, disable_lookahead_block_hashes=legacy)
    specs = [FullAttentionSpec(32), SlidingWindowSpec(16, window)]
    manager = KVCacheManager(specs, 8 * prefix_len // 16 + 256, hash_mode,
                             retention_interval=retention, tail_widening=widening)
    hashing = manager.block_hashing("sha256", "0")
    core = toy_core(manager, num_spec_tokens=3 if drafter != "none" else 0)
    core.runner.num_accept = 1
    rng = random.Random(0)
    prefix = [rng.randrange(1, 32000) for _ in range(prefix_len)]

    def fresh(count: int) -> list[int]:
        return [rng.randrange(1, 32000) for _ in range(count)]

    suffix_a = fresh(64)
    prompts = [prefix + suffix_a, prefix + fresh(64), prefix + suffix_a[:40] + fresh(24),
               prefix + suffix_a]
    cached = []
    for index, prompt in enumerate(prompts[:num_requests]):
        request = Request(f"req{index}", prompt, hashing, max_tokens=4)
        run_to_completion(core, [request])
        manager.check_integrity()
        cached.append(request.num_cached_tokens)
    if drafter == "mtp" and legacy:
        label = {TailWidening.UNIT: "MTP3 legacy drop, fix",
                 TailWidening.NONE: "MTP3 legacy drop, no fix",
                 TailWidening.ONE_BLOCK: "MTP3 legacy drop, 1-block"}[widening]
    else:
        label = f"{'MTP3' if drafter == 'mtp' else drafter} {hash_mode.label}"
    return RetentionRow(label, hash_mode.label, cached)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prefix-len", type=int, default=None,
                        help="default 16384 (1024 with --model)")
    parser.add_argument("--retention", type=int, default=None,
                        help="default 8192 (512 with --model)")
    parser.add_argument("--window", type=int, default=None,
                        help="default 1024 (64 with --model)")
    parser.add_argument("--model", default=None, choices=["hybrid-swa", "gemma4"],
                        help="also run the scenario on tensors: the real engine on a random-init "
                        "sliding-window model (hybrid-swa: Gemma 3 style; gemma4: a tiny Gemma "
                        "4) with a random-init MTP drafter, and a random-init Gemma 4 MTP "
                        "assistant for the gemma4_mtp rows")
    parser.add_argument("--without-fix", action="store_true",
                        help="only the rows without the fix (legacy drop, no widening)")
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    small = args.model is not None
    for name, default, tensor_default in (("prefix_len", 16384, 1024), ("retention", 8192, 512),
                                          ("window", 1024, 64)):
        if getattr(args, name) is None:
            setattr(args, name, tensor_default if small else default)
    if args.prefix_len < 64 or args.window < 2:
        raise ValueError("--prefix-len must be >= 64 and --window >= 2")
    common = dict(prefix_len=args.prefix_len, retention=args.retention, window=args.window)
    if args.without_fix:
        variants = [("mtp", True, TailWidening.NONE)]
    else:
        variants = [("mtp", True, TailWidening.NONE), ("mtp", True, TailWidening.ONE_BLOCK),
                    ("mtp", True, TailWidening.UNIT), ("gemma4_mtp", True, TailWidening.UNIT),
                    ("mtp", False, TailWidening.UNIT)]
    rows = [run_scenario(drafter, legacy, widening, **common)
            for drafter, legacy, widening in variants]
    if args.model is not None:
        return _run_on_tensors(args, variants, rows)
    if args.json:
        print(json.dumps([asdict(row) for row in rows]))
        return 0
    table = Table(title=f"cached tokens of 4 sequential requests sharing a {args.prefix_len}-"
                        f"token prefix (full block 32, SWA window {args.window} block 16, "
                        f"U=32, retention {args.retention})")
    table.add_column("setup", no_wrap=True)
    for index in range(len(rows[0].cached_tokens)):
        table.add_column(f"req {index + 1}", justify="right", no_wrap=True)
    for row in rows:
        table.add_row(row.label, *(str(tokens) for tokens in row.cached_tokens))
    console = Console()
    console.print(table)
    console.print("req 2 diverges right after the checkpoint at 16,384; req 3 inside req 1's "
                  "suffix; req 4 repeats req 1.")
    return 0


def _run_on_tensors(args: argparse.Namespace, variants, rows: list[RetentionRow]) -> int:
    import torch

    from speckv.bench.retention_tensors import (
        HIT_KV_ROUNDING,
        run_tensor_scenario,
        scenario_gemma4_model,
        scenario_model,
    )
    from speckv.drafters.gemma4_assistant import random_gemma4_assistant
    from speckv.drafters.loaders import random_drafter
    from speckv.models.gemma.hybrid_swa import RANDOM_INIT_NOTE

    torch.set_num_threads(1)
    if args.model == "gemma4":
        model = scenario_gemma4_model(args.window)
        note = "gemma4: tiny Gemma 4 with RANDOM-INIT weights (5 sliding : 1 global, K = V, " \
               "per-layer inputs, 2 KV-shared layers)"
    else:
        model, note = scenario_model(args.window), RANDOM_INIT_NOTE
    drafters = {"mtp": random_drafter("mtp", model, seed=0, num_modules=1),
                "gemma4_mtp": random_gemma4_assistant(model, seed=0)}  # reads the target KV
    tensor_rows = []
    for (drafter, legacy, widening), row in zip(variants, rows):
        tensor_rows.append(run_tensor_scenario(model, drafters[drafter], legacy, widening,
                                               args.prefix_len, args.retention, row.label))
    if args.json:
        print(json.dumps([{"simulator": asdict(row), "tensors": asdict(tensor_row)}
                          for row, tensor_row in zip(rows, tensor_rows)]))
        return 0
    table = Table(title=f"cached tokens, simulator vs tensors: 4 sequential requests sharing a "
                        f"{args.prefix_len}-token prefix (full block 32, SWA window {args.window}"
                        f" block 16, U=32, retention {args.retention})")
    table.add_column("setup", no_wrap=True)
    for column in ("simulator", "tensors", "same", "hit KV vs cold: target", "draft",
                   "drafts"):
        table.add_column(column, justify="right")
    for row, tensor_row in zip(rows, tensor_rows):
        draft = tensor_row.draft_max_abs_diff
        table.add_row(row.label, " ".join(map(str, row.cached_tokens)),
                      " ".join(map(str, tensor_row.cached_tokens)),
                      "yes" if row.cached_tokens == tensor_row.cached_tokens else "NO",
                      f"{tensor_row.target_max_abs_diff:.3g}",
                      "-" if draft is None else f"{draft:.3g}",
                      str(tensor_row.num_draft_tokens))
    console = Console()
    console.print(table)
    console.print(f"{note}; MTP drafter random-init (1 module, 3 speculative tokens); "
                  "gemma4_mtp: the Gemma 4 MTP assistant, random-init (3 drafts, no draft KV: "
                  "it reads the target's); draft KV compared with lookahead hashes only (the "
                  "legacy drop promises target KV)")
    console.print("hit KV vs cold: equal within fp32 rounding (<= "
                  f"{HIT_KV_ROUNDING:g}), not bit for bit: a hit block may have been written by "
                  "an earlier request's forward from its own hit on, over fewer rows than the "
                  "cold run's, and CPU matmul kernels round different row counts differently")
    same = all(row.cached_tokens == t.cached_tokens for row, t in zip(rows, tensor_rows))
    close = all(t.target_max_abs_diff <= HIT_KV_ROUNDING
                and (t.draft_max_abs_diff or 0) <= HIT_KV_ROUNDING for t in tensor_rows)
    return 0 if same and close else 1
