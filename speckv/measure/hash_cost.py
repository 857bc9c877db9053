"""The CPU cost of one whole-prompt block-hashing call, per block-hash format.

Owns the measurement behind `speckv bench hash` and the demo's hashing table: the four formats
of `speckv/hashing/formats.py` (legacy, nested, expanded window, adopted lookahead L=1), each
run through the real `RequestBlockHasher`, plus a naive reference hasher of the adopted format
(per block: build the tuple, `pickle.dumps`, `hashlib.sha256`); the cases (`Case`), the plans
(`FULL`, `QUICK`, `DEMO`, ...), the correctness guard (`check_case`) and the timing rounds
(`measure_case`, `measure`: alternating method order, each round's fastest call, the median
over rounds). `speckv/bench/hash_cost.py` renders it and times vLLM's hasher beside it.
"""

from __future__ import annotations

import hashlib
import pickle
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from speckv.hashing.extra_keys import NO_HASH_INPUTS, HashInputs, MultiModalItem
from speckv.hashing.formats import (
    BlockHashFormat,
    ExpandedWindowFormat,
    LegacyFormat,
    LookaheadFormat,
    NestedFormat,
)
from speckv.hashing.functions import BlockHash, get_hash_algo, make_none_hash
from speckv.hashing.request_hasher import hash_prompt, num_hashable_blocks

ALGO_NAME = "sha256"
VOCAB_SIZE = 151_000  # token ids drawn uniformly from [0, VOCAB_SIZE), like a Qwen vocabulary
IMAGE_TOKENS = 512  # multimodal rows: one image of this many tokens ...
IMAGE_PERIOD_TOKENS = 1024  # ... every this many tokens
SEED = 0

FORMATS: dict[str, BlockHashFormat] = {
    "legacy": LegacyFormat(),
    "nested": NestedFormat(),
    "expanded": ExpandedWindowFormat(),
    "adopted": LookaheadFormat(1),
}
NAIVE = "naive"
VS_VLLM_BLOCK_SIZES = (16, 128)
METHODS = (*FORMATS, NAIVE)
HEADERS = {
    "legacy": "legacy",
    "nested": "nested",
    "expanded": "expanded\nwindow",
    "adopted": "adopted\nL=1",
    NAIVE: "naive\n/ adopted",
}


@dataclass(frozen=True)
class Case:
    input_kind: str  # "text" or "mm"
    prompt_tokens: int
    block_size: int

    @property
    def prompt_label(self) -> str:
        return f"{(self.prompt_tokens - 1) // 1024}K+1"


@dataclass
class Row:
    case: Case
    ms: dict[str, float] = field(default_factory=dict)  # median ms per call, by method
    calls: int = 0  # timed calls per method and round (the fastest one counts)

    def pct_vs_legacy(self, method: str) -> float:
        return 100.0 * (self.ms[method] / self.ms["legacy"] - 1.0)

    @property
    def naive_speedup(self) -> float:
        return self.ms[NAIVE] / self.ms["adopted"]

    def to_json(self) -> dict:
        return {
            "input": self.case.input_kind,
            "prompt_tokens": self.case.prompt_tokens,
            "block_size": self.case.block_size,
            "calls_per_round": self.calls,
            "ms": {method: round(value, 4) for method, value in self.ms.items()},
            "pct_vs_legacy": {
                method: round(self.pct_vs_legacy(method), 2) for method in METHODS
            },
            "naive_over_adopted": round(self.naive_speedup, 3),
        }


@dataclass(frozen=True)
class Plan:
    prompt_tokens: tuple[int, ...]
    block_sizes: tuple[int, ...]
    input_kinds: tuple[str, ...]
    rounds: int
    calls_per_round: int
    description: str


FULL = Plan((32 * 1024 + 1, 128 * 1024 + 1), (16, 128, 1024), ("text", "mm"), 25, 5,
            "prompts 32K+1 and 128K+1; median of 25 rounds, each the best of 5 calls")
QUICK = Plan((32 * 1024 + 1,), (16, 128, 1024), ("text", "mm"), 15, 5,
             "--quick: 32K+1 prompts only; median of 15 rounds, each the best of 5 calls")
VS_VLLM_FULL = Plan((32 * 1024 + 1, 128 * 1024 + 1), VS_VLLM_BLOCK_SIZES, ("text",), 15, 5,
                    "prompts 32K+1 and 128K+1; median of 15 rounds, each the best of 5 calls")
VS_VLLM_QUICK = Plan((32 * 1024 + 1,), VS_VLLM_BLOCK_SIZES, ("text",), 9, 5,
                     "--quick: 32K+1 prompts only; median of 9 rounds, each the best of 5 calls")
DEMO = Plan((32 * 1024 + 1,), (16, 1024), ("text",), 15, 5,
            "demo: text, 32K+1 only; median of 15 rounds, each the best of 5 calls")


def make_tokens(num_tokens: int, seed: int = SEED) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(VOCAB_SIZE) for _ in range(num_tokens)]


def make_inputs(input_kind: str, num_tokens: int) -> HashInputs:
    if input_kind == "text":
        return NO_HASH_INPUTS
    if input_kind != "mm":
        raise ValueError(f"input kind must be 'text' or 'mm', got {input_kind!r}")
    items = tuple(
        MultiModalItem(identifier=f"img{index}", offset=offset, length=IMAGE_TOKENS)
        for index, offset in enumerate(range(0, num_tokens - IMAGE_TOKENS, IMAGE_PERIOD_TOKENS))
    )
    return HashInputs(mm_items=items)


def naive_adopted_hashes(none_hash: BlockHash, block_size: int, token_ids: Sequence[int],
                         inputs: HashInputs) -> list[BlockHash]:
    """The reference hasher: per block, the adopted tuple, `pickle.dumps`, `hashlib.sha256`."""
    hashes: list[BlockHash] = []
    parent = none_hash
    # text: E is None, written as a literal like the reference in the task (no call per block)
    extra_keys = None if inputs.is_empty else inputs.extra_keys
    for start in range(0, num_hashable_blocks(len(token_ids), block_size, 1) * block_size,
                       block_size):
        end = start + block_size
        extra = None if extra_keys is None else extra_keys(start, end + 1)
        key = (parent, tuple(token_ids[start:end]), (extra, token_ids[end]))
        parent = hashlib.sha256(pickle.dumps(key, protocol=5)).digest()
        hashes.append(parent)
    return hashes


def plain_hashes(fmt: BlockHashFormat, none_hash: BlockHash, block_size: int,
                 token_ids: Sequence[int], inputs: HashInputs) -> list[BlockHash]:
    """Every block through `algo(fmt.key(...))`: plain pickle, no fast path (the guard)."""
    algo = get_hash_algo(ALGO_NAME)
    hashes: list[BlockHash] = []
    parent = none_hash
    num_blocks = num_hashable_blocks(len(token_ids), block_size, fmt.lookahead_tokens)
    for start in range(0, num_blocks * block_size, block_size):
        parent = algo(fmt.key(parent, token_ids, start, start + block_size, inputs))
        hashes.append(parent)
    return hashes


def _callables(case: Case, token_ids: list[int], none_hash: BlockHash
               ) -> dict[str, Callable[[], list[BlockHash]]]:
    algo = get_hash_algo(ALGO_NAME)
    inputs = make_inputs(case.input_kind, case.prompt_tokens)
    calls: dict[str, Callable[[], list[BlockHash]]] = {
        name: (lambda fmt=fmt: hash_prompt(algo, none_hash, case.block_size, fmt, token_ids,
                                           inputs))
        for name, fmt in FORMATS.items()
    }
    calls[NAIVE] = lambda: naive_adopted_hashes(none_hash, case.block_size, token_ids, inputs)
    return calls


def check_case(case: Case, token_ids: list[int], none_hash: BlockHash) -> None:
    """Raise AssertionError unless every fast hash equals the plain-pickle one."""
    inputs = make_inputs(case.input_kind, case.prompt_tokens)
    calls = _callables(case, token_ids, none_hash)
    for name, fmt in FORMATS.items():
        expected = plain_hashes(fmt, none_hash, case.block_size, token_ids, inputs)
        if calls[name]() != expected:
            raise AssertionError(f"{name} fast hashes differ from plain pickle for {case}")
    if calls[NAIVE]() != calls["adopted"]():
        raise AssertionError(f"naive and adopted hashes differ for {case}")


def measure_case(case: Case, plan: Plan, token_ids: list[int], none_hash: BlockHash) -> Row:
    calls = _callables(case, token_ids, none_hash)
    samples: dict[str, list[float]] = {method: [] for method in METHODS}
    for fn in calls.values():  # warm-up: imports, encoder tables, scratch buffers
        fn()
    for round_index in range(plan.rounds):
        shift = round_index % len(METHODS)
        order = list(METHODS[shift:] + METHODS[:shift])
        if round_index % 2:
            order.reverse()
        for method in order:
            fn = calls[method]
            best = float("inf")
            for _ in range(plan.calls_per_round):
                begin = time.perf_counter()
                fn()
                best = min(best, time.perf_counter() - begin)
            samples[method].append(best)
    row = Row(case, calls=plan.calls_per_round)
    row.ms = {method: 1e3 * statistics.median(values) for method, values in samples.items()}
    return row


def measure(plan: Plan, on_row: Callable[[Row], None] | None = None) -> list[Row]:
    algo = get_hash_algo(ALGO_NAME)
    none_hash = make_none_hash(algo, seed="speckv-bench-hash")
    rows: list[Row] = []
    for prompt_tokens in plan.prompt_tokens:
        token_ids = make_tokens(prompt_tokens)
        for input_kind in plan.input_kinds:
            for block_size in plan.block_sizes:
                case = Case(input_kind, prompt_tokens, block_size)
                check_case(case, token_ids, none_hash)
                row = measure_case(case, plan, token_ids, none_hash)
                rows.append(row)
                if on_row is not None:
                    on_row(row)
    return rows
