"""`speckv bench kv-connector`: what the KV tiers cost and save, on the built-in model.

Three side-by-side measurements on the real engine (the built-in SmolLM2-135M-Instruct with
its EAGLE head unless `--speculative-model none`), each against a real peer, for the tiers of
`--tiers` (default offload, disk, store):

    (a) time to first token of a `--prompt-tokens` prompt (max_tokens=1): cold (nothing cached)
        vs a local prefix-cache hit vs a hit loaded from the CPU tier, the disk tier, the
        shared store (the engine's embedded Valkey server on loopback) (the local prefix
        cache reset before every tier run, the tier settled; the disk tier reads through the
        page cache). Targets: CPU tier <= 2x local and >= 5x faster than cold; disk tier
        <= 4x local; store <= 3x local and >= 4x faster than cold.
    (b) load throughput of each tier (target + draft KV of the same prompt through the
        connector), in GB/s beside its limit: a plain `tensor.copy_` of the same bytes for
        the CPU and disk tiers (`speckv bench kv-tiers`), a redis-py loop of one `GET` per
        block of the same values for the store (`speckv bench kv-store`).
    (c) engine step time on a decode-heavy run (`--decode-requests` requests with short
        prompts and `--decode-tokens` output tokens each; their blocks are stored as they
        fill) with the CPU tier, CPU + disk, and the store, vs no connector. Target: <= +5%.
        Engines alternate over `--repeats` rounds and each keeps its median, so drift on a
        shared machine hits every side alike.

Every run checks what it relies on: the tier runs' hits really come from the tier (tokens
counted), and greedy outputs are identical with and without tiers.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from speckv.engine.config import EngineConfig
from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import SamplingParams
from speckv.engine.speculative import speculative_args

TIERS = ("offload", "disk", "store")
TIER_CASES = {"offload": "CPU tier hit", "disk": "disk tier hit", "store": "store hit"}
TTFT_CASES = ("cold", "local hit", *TIER_CASES.values())
# the step-time engines: a connector runs when all of its tiers are in --tiers
STEP_CONNECTORS = ("offload", "offload,disk", "store")


@dataclass(frozen=True)
class TTFTRow:
    case: str
    ttft_ms: float  # median over repeats
    cached_tokens: int  # of the prompt, served by a cache (local or tier)
    tier_tokens: int  # of them, loaded from a tier


@dataclass(frozen=True)
class StepRow:
    connector: str  # "none", "offload", "offload,disk"
    step_ms: float  # median over rounds of the mean step time
    steps: int  # per round
    stored_blocks: int  # blocks the tiers stored over all rounds
    vs_none: float  # step_ms / the no-connector step_ms


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _config(model, drafter, kv_connector: str | None, directory: str, num_blocks: int,
            num_spec_tokens: int, **extra: Any) -> EngineConfig:
    tiers = {} if kv_connector is None else {
        "kv_connector": kv_connector, "kv_offload_gib": 2.0, "kv_offload_disk_gib": 2.0,
        "kv_offload_dir": directory if "disk" in kv_connector else None,
        "kv_store_gib": 2.0,  # the engine's own embedded Valkey server on loopback
    }
    return engine_config(block_size=16, num_blocks=num_blocks, dtype=str(model.dtype),
                         device=str(model.device), hash_seed="0",
                         **speculative_args(drafter, num_spec_tokens), **tiers, **extra)


def _first_token(engine: LLMEngine, prompt: list[int]) -> tuple[float, Any]:
    """(seconds from add_request to the first token, the final output) for one request."""
    device = engine.runner.device
    _sync(device)
    start = time.perf_counter()
    engine.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final = output
    _sync(device)
    return time.perf_counter() - start, final


def measure_ttft(model, drafter, prompt: list[int], repeats: int, directory: str,
                 num_spec_tokens: int = 3, tiers: tuple[str, ...] = TIERS) -> list[TTFTRow]:
    """TTFT of `prompt`: cold, local hit, then a hit from each of `tiers` (medians)."""
    num_blocks = 2 * (len(prompt) // 16 + 8)
    rows = []
    cases = [("cold", None), ("local hit", None)] + [(TIER_CASES[t], t) for t in tiers]
    for case, tier in cases:
        engine = LLMEngine(model, _config(model, drafter, tier, directory, num_blocks,
                                          num_spec_tokens),
                           drafter=drafter, detokenize=False)
        with engine:
            _first_token(engine, prompt[:64])  # warm up the kernels
            times, final = [], None
            if case != "cold":
                _first_token(engine, prompt)  # stores it (locally; in the tier too)
                assert engine.flush_kv_connector(timeout_s=600), "the tier did not settle"
            for _ in range(repeats):
                if case != "local hit":
                    assert engine.reset_prefix_cache(), "could not reset the prefix cache"
                seconds, final = _first_token(engine, prompt)
                times.append(seconds)
            assert final is not None
            if case != "cold":
                assert final.num_cached_tokens == (len(prompt) - 1) // 16 * 16, final
            if tier is not None:
                assert final.num_external_cached_tokens == final.num_cached_tokens, final
            rows.append(TTFTRow(case, 1e3 * statistics.median(times), final.num_cached_tokens,
                                final.num_external_cached_tokens))
    return rows


def measure_steps(model, drafter, prompts: list[list[int]], output_tokens: int, rounds: int,
                  directory: str, num_spec_tokens: int = 3, tiers: tuple[str, ...] = TIERS
                  ) -> list[StepRow]:
    """Mean step time of a decode-heavy batch per connector, median over alternating rounds."""
    connectors = (None, *(name for name in STEP_CONNECTORS
                          if set(name.split(",")) <= set(tiers)))
    num_blocks = len(prompts) * ((max(map(len, prompts)) + output_tokens) // 16 + 2) + 8
    engines = [LLMEngine(model, _config(model, drafter, name, directory, num_blocks,
                                        num_spec_tokens, max_num_seqs=len(prompts)),
                         drafter=drafter, detokenize=False) for name in connectors]
    params = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
    per_engine: list[list[float]] = [[] for _ in engines]
    steps = [0] * len(engines)
    outputs: list[list[list[int]]] = [[] for _ in engines]
    try:
        for engine in engines:  # warm up
            _run_batch(engine, [prompt[:16] for prompt in prompts[:2]],
                       SamplingParams(max_tokens=4, ignore_eos=True))
        for _ in range(rounds):
            for index, engine in enumerate(engines):
                # the same batch every round, from scratch: the local cache and the tiers
                # reset, so every round prefills, decodes and stores the same blocks
                assert engine.reset_prefix_cache(reset_connector=True)
                seconds, num_steps, finals = _run_batch(engine, prompts, params)
                per_engine[index].append(seconds / num_steps)
                steps[index] = num_steps
                outputs[index] = finals
        stored = [sum(stats.saved_blocks for stats in engine.kv_connector_stats().values())
                  for engine in engines]
    finally:
        for engine in engines:
            engine.close()
    if any(out != outputs[0] for out in outputs[1:]):
        raise RuntimeError("greedy outputs differ with and without KV tiers")
    base = statistics.median(per_engine[0])
    return [StepRow(name or "none", 1e3 * statistics.median(times), count, saved,
                    statistics.median(times) / base)
            for name, times, count, saved in zip(connectors, per_engine, steps, stored)]


def _run_batch(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
               ) -> tuple[float, int, list[list[int]]]:
    device = engine.runner.device
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    finals: dict[str, list[int]] = {}
    num_steps = 0
    _sync(device)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output.token_ids
        num_steps += 1
    _sync(device)
    return time.perf_counter() - start, num_steps, [finals[request_id] for request_id in ids]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="builtin", help="'builtin', an HF dir or a .gguf")
    parser.add_argument("--speculative-model", default="builtin",
                        help="drafter dir, 'builtin' (the EAGLE head) or 'none'")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats per TTFT case")
    parser.add_argument("--decode-requests", type=int, default=8)
    parser.add_argument("--decode-prompt-tokens", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3, help="alternating step-time rounds")
    parser.add_argument("--parts", default="ttft,load,steps",
                        help="comma-separated: ttft, load, steps (default %(default)s)")
    parser.add_argument("--tiers", default=",".join(TIERS),
                        help="comma-separated tiers to measure: offload, disk, store "
                        "(default %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--dir", default=None, help="disk tier directory (default: a temp dir)")
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from speckv.bench import kv_store, kv_tiers
    from speckv.engine.llm import load_model
    from speckv.engine.speculative import load_drafter_model

    parts = {part.strip() for part in args.parts.split(",")}
    if not parts <= {"ttft", "load", "steps"}:
        raise ValueError("--parts: choose from ttft, load, steps")
    tiers = tuple(tier.strip() for tier in args.tiers.split(",") if tier.strip())
    if not tiers or not set(tiers) <= set(TIERS) or len(set(tiers)) != len(tiers):
        raise ValueError(f"--tiers: choose from {', '.join(TIERS)} (comma-separated)")
    if args.prompt_tokens < 64 or args.prompt_tokens % 16:
        raise ValueError("--prompt-tokens must be a multiple of 16, at least 64")
    for flag in ("repeats", "rounds", "decode_requests", "decode_tokens", "threads"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    model, _ = load_model(args.model, args.dtype, device, progress=not args.json)
    drafter = None
    if args.speculative_model != "none":
        drafter = load_drafter_model(args.speculative_model, model)
    vocab = model.config.vocab_size
    rng = random.Random(0)
    prompt = [rng.randrange(100, vocab) for _ in range(args.prompt_tokens)]
    decode_prompts = [[rng.randrange(100, vocab) for _ in range(args.decode_prompt_tokens)]
                      for _ in range(args.decode_requests)]
    result: dict[str, Any] = {"device": str(device), "dtype": args.dtype,
                              "threads": args.threads, "prompt_tokens": args.prompt_tokens,
                              "drafter": args.speculative_model, "tiers": list(tiers)}
    with tempfile.TemporaryDirectory(prefix="speckv-kv-connector-") as scratch:
        directory = args.dir or scratch
        if "ttft" in parts:
            ttft = measure_ttft(model, drafter, prompt, args.repeats,
                                tempfile.mkdtemp(dir=directory), tiers=tiers)
            result["ttft"] = [asdict(row) for row in ttft]
        if "load" in parts:
            repeats = max(args.repeats, 3)
            result["load"] = [
                _store_load_row(kv_store.measure_embedded(args.dtype, args.prompt_tokens, 16,
                                                          repeats, device))
                if tier == "store" else
                _copy_load_row(kv_tiers.measure(tier, args.dtype, args.prompt_tokens, 16,
                                                repeats, device, tempfile.mkdtemp(dir=directory)))
                for tier in tiers
            ]
        if "steps" in parts:
            steps = measure_steps(model, drafter, decode_prompts, args.decode_tokens,
                                  args.rounds, tempfile.mkdtemp(dir=directory), tiers=tiers)
            result["steps"] = [asdict(row) for row in steps]
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    _print(result, args)
    return 0


def _copy_load_row(row: dict[str, Any]) -> dict[str, Any]:
    return {"tier": row["tier"], "mb": row["mb"], "load_ms": row["load_ms"],
            "load_gbps": row["load_gbps"], "peer": "copy_", "peer_gbps": row["copy_gbps"]}


def _store_load_row(row: dict[str, Any]) -> dict[str, Any]:
    return {"tier": "store", "mb": row["mb"], "load_ms": row["load_ms"],
            "load_gbps": row["load_gbps"], "peer": "redis-py GET loop",
            "peer_gbps": row["get_gbps"]}


def _print(result: dict[str, Any], args: argparse.Namespace) -> None:
    console = Console()
    where = f"{result['device']}, {result['dtype']}, {result['threads']} thread(s)"
    if "ttft" in result:
        rows = result["ttft"]
        by_case = {row["case"]: row for row in rows}
        local = by_case["local hit"]["ttft_ms"]
        cold = by_case["cold"]["ttft_ms"]
        table = Table(title=f"TTFT of a {result['prompt_tokens']}-token prompt, built-in model "
                            f"+ {result['drafter']} drafter ({where}; median of "
                            f"{args.repeats})")
        for column in ("case", "TTFT ms", "cached tokens", "from tier", "vs local hit",
                       "cold / this"):
            table.add_column(column, justify="left" if column == "case" else "right")
        for row in rows:
            table.add_row(row["case"], f"{row['ttft_ms']:.1f}", str(row["cached_tokens"]),
                          str(row["tier_tokens"]), f"{row['ttft_ms'] / local:.2f}x",
                          f"{cold / row['ttft_ms']:.1f}x")
        console.print(table)
    if "load" in result:
        table = Table(title=f"Tier loads of the same prompt's target + draft KV ({where}); "
                            "the peer is the limit: copy_ of the bytes, or the store's values "
                            "by a redis-py GET loop")
        for column in ("tier", "MB", "load ms", "load GB/s", "peer", "peer GB/s",
                       "load / peer"):
            table.add_column(column, justify="right")
        for row in result["load"]:
            table.add_row(row["tier"], f"{row['mb']:.1f}", f"{row['load_ms']:.2f}",
                          f"{row['load_gbps']:.2f}", row["peer"], f"{row['peer_gbps']:.2f}",
                          f"{row['load_gbps'] / row['peer_gbps']:.2f}x")
        console.print(table)
    if "steps" in result:
        table = Table(title=f"Step time, {args.decode_requests} requests x "
                            f"{args.decode_tokens} output tokens ({where}; median of "
                            f"{args.rounds} alternating rounds)")
        for column in ("connector", "step ms", "steps", "blocks stored", "vs none"):
            table.add_column(column, justify="left" if column == "connector" else "right")
        for row in result["steps"]:
            table.add_row(row["connector"], f"{row['step_ms']:.2f}", str(row["steps"]),
                          str(row["stored_blocks"]), f"{100 * (row['vs_none'] - 1):+.1f}%")
        console.print(table)
