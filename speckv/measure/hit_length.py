"""How many prompt tokens a repeated request gets from the cache, on the real cache manager.

Owns `measure_hit_length` (request 1 prefills, decodes with drafts, finishes; request 2 sends
the same prompt, or with `diverge` only its first N tokens, and its cached tokens are read),
the expected hit (`expected_hit_tokens`) and the table the demo and `speckv bench hit-length`
print. Modes: `lookahead` (lookahead hashes with block reuse at divergence points),
`lookahead-no-reuse`, `legacy` (legacy hashes + the drop).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from speckv.cache import FullAttentionSpec, KVCacheManager
from speckv.cache.drafter_policy import drafter_policy, resolve_hash_mode
from speckv.cache.hash_mode import HashMode
from speckv.cache.specs import KVCacheSpec, format_group_specs
from speckv.engine.request import Request
from speckv.simulation import run_to_completion, toy_core

NUM_SPEC_TOKENS = 3
NUM_DECODE_TOKENS = 12
MODES = ("lookahead", "lookahead-no-reuse", "legacy")
DIVERGENT_TAIL_TOKENS = 5  # tokens after the shared prefix in --diverge (more than any L)


@dataclass(frozen=True)
class HitLengthResult:
    drafter: str  # eagle, eagle3, mtp, ...
    num_modules: int  # draft modules (mtp may have several)
    mode: str
    prompt_len: int
    block_size: int  # the alignment unit U (the block size for one group)
    hit_tokens: int
    expected_tokens: int
    groups: str = ""
    diverge: bool = False  # request 2 shares only the first prompt_len tokens


def expected_hit_tokens(prompt_len: int, unit_tokens: int, hash_mode: HashMode,
                        reuses_blocks: bool = False, diverge: bool = False) -> int:
    """The expected hit lengths for an alignment unit U (dense retention). Pure.

    repeat (N tokens sent again): the hit ends by N - 1, each block needs L tokens after it;
    diverge (N shared tokens, then others): the hit ends by N, each block needs its L
    successors among the shared tokens. Block reuse (`reuses_blocks`): when the
    no-speculation hit is longer, the hit is it minus L (its last block is copied and its
    last L positions recomputed).
    """
    lookahead, unit = hash_mode.lookahead_tokens, unit_tokens
    limit = prompt_len if diverge else prompt_len - 1  # the no-speculation hit ends by it
    no_spec = max(0, limit) // unit * unit
    hit = max(0, min(limit, prompt_len - lookahead)) // unit * unit
    if hash_mode.drops_last_unit:
        hit = max(0, hit - unit)
    elif reuses_blocks and no_spec > hit:
        hit = no_spec - lookahead
    return hit


def measure_hit_length(
    prompt_len: int, block_size: int, drafter: str, mtp_modules: int = 1,
    mode: str = "lookahead", seed: int = 0, groups: list[KVCacheSpec] | None = None,
    retention_interval: int | None = None, diverge: bool = False,
) -> HitLengthResult:
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
    policy = drafter_policy(drafter, mtp_modules)
    hash_mode = resolve_hash_mode(policy, disable_lookahead_block_hashes=(mode == "legacy"),
                                  reuse_divergent_blocks=(mode == "lookahead"))
    specs = groups if groups is not None else [FullAttentionSpec(block_size)]
    num_spec = NUM_SPEC_TOKENS if policy.name != "none" else 0
    min_block = min(spec.block_size for spec in specs)
    num_blocks = len(specs) * (2 * (prompt_len + DIVERGENT_TAIL_TOKENS + NUM_DECODE_TOKENS
                                    + 2 * num_spec) // min_block + 8)
    manager = KVCacheManager(specs, num_blocks, hash_mode,
                             retention_interval=retention_interval)
    hashing = manager.block_hashing("sha256", "0")
    core = toy_core(manager, num_spec)
    core.runner.num_accept = 1
    rng = random.Random(seed)
    prompt = [rng.randrange(1, 32000) for _ in range(prompt_len)]
    first_prompt = second_prompt = prompt
    if diverge:  # the same N tokens, then two different tails (token ids apart)
        first_prompt = prompt + [32000 + i for i in range(DIVERGENT_TAIL_TOKENS)]
        second_prompt = prompt + [33000 + i for i in range(DIVERGENT_TAIL_TOKENS)]
    run_to_completion(core, [Request("first", first_prompt, hashing,
                                     max_tokens=NUM_DECODE_TOKENS)])
    second = Request("second", second_prompt, hashing, max_tokens=1)
    run_to_completion(core, [second])
    manager.check_integrity()
    unit = manager.alignment_tokens
    label = hash_mode.label + (" + reuse" if manager.reuses_divergent_blocks else "")
    return HitLengthResult(policy.name, policy.num_modules, label, prompt_len,
                           unit, second.num_cached_tokens,
                           expected_hit_tokens(prompt_len, unit, hash_mode,
                                               manager.reuses_divergent_blocks, diverge),
                           format_group_specs(specs) if groups is not None else "", diverge)


def print_table(results: list[HitLengthResult], console: Console) -> None:
    if results[0].groups:
        for groups_text in dict.fromkeys(r.groups for r in results):
            rows = [r for r in results if r.groups == groups_text]
            _print_one_table(rows, console, f"groups {groups_text}, U={rows[0].block_size}")
    else:
        _print_one_table(results, console, f"B={results[0].block_size}")
    if results[0].diverge:
        console.print("Each cell is the expected hit: floor((N - L) / U) * U, or with block "
                      "reuse the no-speculation hit floor(N / U) * U minus L where that is "
                      "longer (one unit less than no speculation with the legacy drop); a cell "
                      "that is not shows (!=expected).")
    else:
        console.print("Each cell is the expected floor((N - max(L, 1)) / U) * U cached tokens, "
                      "or with block reuse floor((N - 1) / U) * U - L where that is longer "
                      "(one unit less with the legacy drop); a cell that is not shows "
                      "(!=expected).")


def _print_one_table(results: list[HitLengthResult], console: Console, label: str) -> None:
    lengths = sorted({r.prompt_len for r in results})
    what = ("N tokens shared, then different tails" if results[0].diverge
            else "prompt of N tokens sent twice")
    table = Table(title=f"{what}: cached tokens of the 2nd request ({label})")
    table.add_column("drafter", no_wrap=True)
    table.add_column("hash mode \\ N", no_wrap=True)
    for prompt_len in lengths:
        table.add_column(str(prompt_len), justify="right", no_wrap=True)
    rows: dict[tuple[str, str], dict[int, HitLengthResult]] = {}
    for r in results:
        label = drafter_policy(r.drafter, r.num_modules).label
        rows.setdefault((label, r.mode), {})[r.prompt_len] = r
    for (drafter, mode), cells in rows.items():
        values = []
        for prompt_len in lengths:
            r = cells[prompt_len]
            mark = "" if r.hit_tokens == r.expected_tokens else f" (!={r.expected_tokens})"
            values.append(f"{r.hit_tokens}{mark}")
        table.add_row(drafter, mode, *values)
    console.print(table)
