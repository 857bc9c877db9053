"""`speckv bench hash`: the CPU cost of one whole-prompt block-hashing call, per format.

Owns the hash-cost table (what each candidate block-hash layout costs per prompt): the four
formats of `speckv/hashing/formats.py` (legacy, nested, expanded window, adopted lookahead L=1),
each run through the real `RequestBlockHasher` (so only the format differs), plus a *naive*
reference hasher of the adopted format (per block: build the tuple, `pickle.dumps`,
`hashlib.sha256`), on prompts of 32K+1 and 128K+1 random token ids, block sizes 16/128/1024,
text and multimodal (a 512-token image every 1,024 tokens), algorithm sha256.

Measurement: a fresh hasher per call (`hash_prompt`), rounds in alternating method order (the
order rotates, and reverses every other round, so drift and cache warmth are shared evenly);
each round times every method's calls one by one and keeps the fastest (a burst of host noise
then costs one sample, not a cell); a cell is the median of those over all rounds.
Before timing, every format's hashes are checked against the plain `pickle.dumps` path and the
naive hasher's against the adopted format's (a correctness guard: a fast wrong hasher would
otherwise win). `quick_table(console)` is the ~5 s version that `speckv demo` prints.

`--vs-vllm` instead times vLLM's own request block hasher against speckv's on the same text
prompts (B = 16 and 128, legacy and lookahead L=1) in this process, after checking the two hash
chains are byte-identical; without vLLM it prints why and skips (see `vllm_peer.py`).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from functools import partial

from rich.console import Console
from rich.table import Table

from speckv.bench.vllm_peer import (
    VllmModules,
    init_none_hash,
    load_vllm,
    ratio,
    same_hashes,
    skip_message,
    time_side_by_side,
    vllm_prompt_hasher,
)
from speckv.hashing.formats import (
    format_for,
)
from speckv.hashing.functions import get_hash_algo, make_none_hash
from speckv.hashing.request_hasher import hash_prompt, native_available
from speckv.measure.hash_cost import (
    ALGO_NAME,
    DEMO,
    FULL,
    HEADERS,
    IMAGE_PERIOD_TOKENS,
    IMAGE_TOKENS,
    METHODS,
    NAIVE,
    QUICK,
    VOCAB_SIZE,
    VS_VLLM_BLOCK_SIZES,
    VS_VLLM_FULL,
    VS_VLLM_QUICK,
    Plan,
    Row,
    make_tokens,
    measure,
)


def _cell(row: Row, method: str) -> str:
    ms = row.ms[method]
    if method == "legacy":
        return f"{ms:.3f} ms"
    if method == NAIVE:
        return f"{ms:.3f} ms\n{row.naive_speedup:.2f}x"
    return f"{ms:.3f} ms\n({row.pct_vs_legacy(method):+.1f}%)"


def render_table(rows: list[Row], title: str) -> Table:
    table = Table(title=title, show_lines=True, title_justify="left", width=100)
    table.add_column("input")
    table.add_column("prompt")
    table.add_column("B", justify="right")
    for method in METHODS:
        table.add_column(HEADERS[method], justify="right")
    for row in rows:
        table.add_row(row.case.input_kind, row.case.prompt_label, str(row.case.block_size),
                      *(_cell(row, method) for method in METHODS))
    return table


def _title() -> str:
    return (f"One whole-prompt hashing call, {ALGO_NAME}, ms (% vs legacy); naive: "
            "per-block tuple + pickle.dumps + sha256 of the adopted format (x = naive / adopted)")


def quick_table(console: Console) -> list[Row]:
    """The ~5 s mini version for `speckv demo`: text, 32K+1 tokens, B = 16 and 1024."""
    rows = measure(DEMO)
    console.print(render_table(rows, _title()))
    console.print(f"[dim]{DEMO.description}; full table: speckv bench hash[/dim]")
    return rows


# ---- --vs-vllm: vLLM's request block hasher on the same prompts -------------------------------

def measure_vs_vllm(vllm: VllmModules, plan: Plan) -> list[dict]:
    """vLLM's and speckv's whole-prompt hashing, legacy and lookahead L=1, text prompts: the
    hashes are checked byte-identical, then both are timed alternately in this process."""
    algo = get_hash_algo(ALGO_NAME)
    none_hash = make_none_hash(algo, seed=init_none_hash(vllm))  # vLLM's seed: same block 0
    rows = []
    for prompt_tokens in plan.prompt_tokens:
        token_ids = make_tokens(prompt_tokens)
        for block_size in VS_VLLM_BLOCK_SIZES:
            calls: dict[str, Callable[[], object]] = {}
            for lookahead in (0, 1):
                fmt = format_for(lookahead)
                ours = partial(hash_prompt, algo, none_hash, block_size, fmt, token_ids)
                theirs = vllm_prompt_hasher(vllm, block_size, lookahead, token_ids)
                if not same_hashes(ours(), theirs()):
                    raise AssertionError(f"speckv and vLLM hashes differ: {prompt_tokens} tokens, "
                                         f"B={block_size}, L={lookahead}")
                calls[f"vllm/L{lookahead}"] = theirs
                calls[f"speckv/L{lookahead}"] = ours
            ms = time_side_by_side(calls, plan.rounds, plan.calls_per_round)
            rows.append({
                "prompt_tokens": prompt_tokens, "block_size": block_size,
                "ms": {name: round(value, 4) for name, value in ms.items()},
                "ratio_legacy": round(ratio(ms["vllm/L0"], ms["speckv/L0"]), 3),
                "ratio_lookahead": round(ratio(ms["vllm/L1"], ms["speckv/L1"]), 3),
                "speckv_lookahead_overhead_pct": round(
                    100 * (ms["speckv/L1"] / ms["speckv/L0"] - 1), 2),
                "vllm_lookahead_overhead_pct": round(100 * (ms["vllm/L1"] / ms["vllm/L0"] - 1), 2),
                "hashes_identical": True,
            })
    return rows


def render_vs_vllm(rows: list[dict], version: str) -> Table:
    table = Table(title=f"One whole-prompt hashing call, {ALGO_NAME}, text, ms: vLLM {version} "
                        "vs speckv in one process (hashes checked identical; x = vLLM / speckv)",
                  show_lines=True, title_justify="left")
    for column in ("prompt", "B", "vLLM\nlegacy", "speckv\nlegacy", "x", "vLLM\nL=1",
                   "speckv\nL=1", "x", "L=1 vs legacy\nvLLM / speckv"):
        table.add_column(column, justify="right")
    for row in rows:
        ms = row["ms"]
        table.add_row(
            f"{(row['prompt_tokens'] - 1) // 1024}K+1", str(row["block_size"]),
            f"{ms['vllm/L0']:.3f}", f"{ms['speckv/L0']:.3f}", f"{row['ratio_legacy']:.2f}x",
            f"{ms['vllm/L1']:.3f}", f"{ms['speckv/L1']:.3f}", f"{row['ratio_lookahead']:.2f}x",
            f"{row['vllm_lookahead_overhead_pct']:+.1f}% / "
            f"{row['speckv_lookahead_overhead_pct']:+.1f}%",
        )
    return table


def run_vs_vllm(args: argparse.Namespace, plan: Plan) -> int:
    console = Console(stderr=bool(args.json))
    vllm, reason = load_vllm()
    if vllm is None:
        console.print(skip_message(reason))
        return 0
    path = "native chain" if native_available() else "numpy path (native chain not built)"
    with console.status(f"hashing with vLLM {vllm.version} and speckv ({path})..."):
        rows = measure_vs_vllm(vllm, plan)
    if args.json:
        print(json.dumps({"algorithm": ALGO_NAME, "vllm_version": vllm.version,
                          "speckv_path": path, "plan": plan.description, "rows": rows}))
        return 0
    console.print(render_vs_vllm(rows, vllm.version))
    console.print(f"[dim]{plan.description}; speckv: {path}; token ids uniform in "
                  f"[0, {VOCAB_SIZE}).[/dim]")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help="32K+1 prompts only, fewer rounds (about 20 s)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object with every cell instead of the table")
    parser.add_argument("--vs-vllm", action="store_true",
                        help="time vLLM's request block hasher on the same prompts in this "
                             "process (needs vllm importable; skipped with a message otherwise)")


def run(args: argparse.Namespace) -> int:
    plan = QUICK if args.quick else FULL
    if getattr(args, "vs_vllm", False):
        return run_vs_vllm(args, VS_VLLM_QUICK if args.quick else VS_VLLM_FULL)
    console = Console(stderr=bool(args.json))
    if not args.json:
        console.print(f"[dim]{plan.description}; MM = a {IMAGE_TOKENS}-token image every "
                      f"{IMAGE_PERIOD_TOKENS} tokens; token ids uniform in [0, {VOCAB_SIZE})."
                      "[/dim]")
    with console.status("hashing (correctness guard, then timing)...") as status:
        rows = measure(plan, on_row=lambda row: status.update(
            f"done: {row.case.input_kind} {row.case.prompt_label} B={row.case.block_size}"))
    if args.json:
        print(json.dumps({
            "algorithm": ALGO_NAME,
            "plan": plan.description,
            "vocab_size": VOCAB_SIZE,
            "image_tokens": IMAGE_TOKENS,
            "image_period_tokens": IMAGE_PERIOD_TOKENS,
            "guard": "every format's fast hashes == plain pickle; naive == adopted",
            "rows": [row.to_json() for row in rows],
        }))
        return 0
    console.print(render_table(rows, _title()))
    return 0
