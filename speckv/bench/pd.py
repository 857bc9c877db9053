"""`speckv bench pd`: prefill/decode disaggregation over NIXL on the built-in model (or
`--model hybrid-gdn` / `hybrid-swa`: every KV cache group moves, the GDN state included).

Three engines in one process (a prefill engine `kv_producer`, a decode engine `kv_consumer`,
and a single engine to compare with), the built-in SmolLM2-135M-Instruct with its shipped
EAGLE3 head unless `--speculative-model none` (a hybrid: `--speculative-model random-mtp`), a
`--prompt-tokens` prompt:

    (a) decode-side TTFT after the prefill (the READ of the prompt's target and draft KV over
        NIXL, then the < 1 block the hit leaves, then the first token) beside a local prefix
        hit's TTFT on the single engine and a cold prefill. Target: <= 1.5x the local hit.
    (b) the transfer's GB/s (the decode engine's connector: admit + READ of every layer of
        both caches) beside a raw NIXL READ of the same bytes between two bare agents and a
        torch `copy_` of the same bytes.
    (c) acceptance of the first `--decode-tokens` decoded tokens through P/D vs the single
        engine (equal: the decode engine's first step drafts from the real draft KV).
    (d) legacy hashes (`--disable-lookahead-block-hashes`): the decode engine loads one block
        less and recomputes it, exactly as a local hit would (a hybrid: one alignment unit).
    (e) a hybrid model: the blocks the decode engine pulled, per group (every full block, the
        sliding window's blocks, one GDN state), beside what the prompt's blocks would be.

Every run checks what it relies on: greedy outputs equal through P/D and on the single engine,
and the decode engine's hit came over NIXL (tokens counted). Ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.outputs import RequestOutput
from speckv.engine.sampling_params import SamplingParams
from speckv.engine.speculative import speculative_args

BLOCK = 16


def _engine(model, drafter, role: str | None, num_blocks: int, num_spec_tokens: int,
            **extra: Any) -> LLMEngine:
    transfer = {} if role is None else {"kv_transfer_config": json.dumps(
        {"kv_connector": "nixl", "kv_role": role, "kv_transfer_timeout_s": 60.0})}
    config = engine_config(block_size=BLOCK, num_blocks=num_blocks, dtype=str(model.dtype),
                           device=str(model.device), hash_seed="0", adaptive_speculation=False,
                           **(speculative_args(drafter, num_spec_tokens) if drafter else {}),
                           **transfer, **extra)
    return LLMEngine(model, config, drafter=drafter, detokenize=False)


def _timed(engine: LLMEngine, prompt: list[int], params: SamplingParams
           ) -> tuple[float, RequestOutput]:
    """(seconds to the first token, final output)."""
    start = time.perf_counter()
    request_id = engine.add_request(prompt, params)
    first = None
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id != request_id:
                continue
            if first is None and output.token_ids:
                first = time.perf_counter() - start
            if output.finished:
                final = output
        if final is not None:
            break
    assert first is not None and final is not None
    return first, final


def _prefill(engine: LLMEngine, prompt: list[int]) -> dict[str, Any]:
    _, out = _timed(engine, prompt, SamplingParams(
        max_tokens=1, ignore_eos=True, kv_transfer_params={"do_remote_decode": True}))
    assert out.kv_transfer_params is not None
    return out.kv_transfer_params


def _settle(engine: LLMEngine) -> None:
    deadline = time.monotonic() + 60
    while engine.has_unfinished_requests() and time.monotonic() < deadline:
        engine.step()


def measure(model, drafter, prompt: list[int], decode_tokens: int, repeats: int,
            num_spec_tokens: int = 3, legacy: bool = False) -> dict[str, Any]:
    num_blocks = 2 * (len(prompt) // BLOCK + 8)
    extra = {"disable_lookahead_block_hashes": True} if legacy else {}
    single = _engine(model, drafter, None, num_blocks, num_spec_tokens, **extra)
    producer = _engine(model, drafter, "kv_producer", num_blocks, num_spec_tokens, **extra)
    consumer = _engine(model, drafter, "kv_consumer", num_blocks, num_spec_tokens, **extra)
    greedy = SamplingParams(max_tokens=decode_tokens, ignore_eos=True)
    try:
        for engine in (single, producer, consumer):  # warm up the kernels
            _timed(engine, prompt[:64], SamplingParams(max_tokens=2, ignore_eos=True))
        cold, local, pd = [], [], []
        outs: dict[str, RequestOutput] = {}
        for _ in range(repeats):
            assert single.reset_prefix_cache()
            seconds, outs["cold"] = _timed(single, prompt, greedy)
            cold.append(seconds)
            seconds, outs["local"] = _timed(single, prompt, greedy)  # a local prefix hit
            local.append(seconds)
            params = _prefill(producer, prompt)
            assert consumer.reset_prefix_cache()
            seconds, outs["pd"] = _timed(consumer, prompt, SamplingParams(
                max_tokens=decode_tokens, ignore_eos=True,
                kv_transfer_params=params))
            pd.append(seconds)
            _settle(producer)
            _settle(consumer)
        if outs["pd"].token_ids != outs["cold"].token_ids:
            raise RuntimeError("greedy outputs differ through P/D")
        stats = consumer.kv_connector_stats()["nixl"]
        # the legacy drop serves one unit less than the run, as a local hit does
        dropped = consumer.manager.alignment_tokens if legacy else 0
        if outs["pd"].num_external_cached_tokens != params["num_tokens"] - dropped:
            raise RuntimeError(f"the decode engine's hit did not come over NIXL: {outs['pd']}")
        return {
            "legacy": legacy, "prompt_tokens": len(prompt),
            "ttft_ms": {"cold": 1e3 * statistics.median(cold),
                        "local hit": 1e3 * statistics.median(local),
                        "P/D decode": 1e3 * statistics.median(pd)},
            "cached_tokens": {"local hit": outs["local"].num_cached_tokens,
                              "P/D decode": outs["pd"].num_cached_tokens},
            "transferred_tokens": params["num_tokens"],
            "kv_groups": consumer.layout.describe(),
            "pulled_blocks": stats.loaded_blocks // repeats,
            "prompt_blocks": sum(1 for ids in params["block_ids"] for b in ids if b),
            "loaded_bytes": stats.loaded_bytes, "transfer_s": stats.extra["transfer_s"],
            "acceptance": {name: _acceptance(outs[name]) for name in ("cold", "pd")},
        }
    finally:
        for engine in (single, producer, consumer):
            engine.close()


def _acceptance(output: RequestOutput) -> float:
    return output.num_accepted_tokens / output.num_draft_tokens if output.num_draft_tokens \
        else 0.0


def raw_transfer(model, drafter, num_blocks: int, repeats: int) -> dict[str, float]:
    """GB/s of a bare NIXL READ of `num_blocks` blocks (both caches, two agents, no side
    channel) and of a `copy_` of the same bytes."""
    from speckv.attention import PagedKVCache
    from speckv.connectors.layout import DeviceKV
    from speckv.connectors.nixl.layout_desc import describe_layout
    from speckv.connectors.nixl.params import HashContract
    from speckv.connectors.nixl.transport import NixlTransport

    config = model.config

    def kv() -> DeviceKV:
        target = PagedKVCache(config.num_hidden_layers, num_blocks + 1, BLOCK,
                              config.num_key_value_heads, config.head_dim, dtype=model.dtype)
        draft = (PagedKVCache(drafter.num_kv_layers, num_blocks + 1, BLOCK,
                              config.num_key_value_heads, config.head_dim, dtype=model.dtype)
                 if drafter is not None else None)
        for cache in (target, draft):
            if cache is not None:
                cache.storage.normal_()
        return DeviceKV(target, draft)

    contract = HashContract("sha256", "0", BLOCK, 0, False)
    source, target = kv(), kv()
    a = NixlTransport(source, "bench-src", describe_layout(source, "s", "e", "bench-src",
                                                            contract))
    b = NixlTransport(target, "bench-dst", describe_layout(target, "d", "e", "bench-dst",
                                                            contract))
    try:
        peer = b.add_peer(a.metadata(), a.layout)
        ids = list(range(1, num_blocks + 1))
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            read = b.start_read(peer, [ids], [ids])
            while b.poll(read) == "PROC":
                pass
            assert read.state == "DONE"
            times.append(time.perf_counter() - start)
        for mine, theirs in zip(target.caches, source.caches):
            assert torch.equal(mine.storage[:, :, 1:], theirs.storage[:, :, 1:])
        nbytes = num_blocks * source.layout.nbytes
        src = torch.empty(nbytes, dtype=torch.uint8)
        dst = torch.empty_like(src)
        src.fill_(1)
        copies = []
        for _ in range(repeats):
            start = time.perf_counter()
            dst.copy_(src)
            copies.append(time.perf_counter() - start)
    finally:
        b.shutdown()
        a.shutdown()
    return {"bytes": nbytes, "nixl_gbps": nbytes / statistics.median(times) / 1e9,
            "copy_gbps": nbytes / statistics.median(copies) / 1e9}


def _prompt(tokenizer, vocab_size: int, num_tokens: int) -> list[int]:
    """English text nobody tuned on (this package's own docstrings), so that acceptance
    means something; random token ids without a tokenizer."""
    if tokenizer is None:
        rng = random.Random(0)
        return [rng.randrange(100, vocab_size) for _ in range(num_tokens)]
    import speckv.connectors.base as base
    import speckv.connectors.rules as rules
    import speckv.engine.scheduler as scheduler

    text = "\n\n".join(module.__doc__ or "" for module in (scheduler, base, rules))
    ids = tokenizer.encode(text)
    while len(ids) < num_tokens:
        ids = ids + ids
    return ids[:num_tokens]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="builtin", help="'builtin', an HF dir or a .gguf")
    parser.add_argument("--speculative-model", default="builtin",
                        help="drafter dir, 'builtin' (the shipped EAGLE3 head) or 'none'")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--decode-tokens", type=int, default=32,
                        help="decoded tokens whose acceptance is compared")
    parser.add_argument("--num-spec-tokens", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-legacy", action="store_true", help="skip the legacy-hash run")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from speckv.engine.llm import load_model
    from speckv.engine.speculative import load_drafter_model

    if args.prompt_tokens < 64 or args.prompt_tokens % BLOCK:
        raise ValueError(f"--prompt-tokens must be a multiple of {BLOCK}, at least 64")
    for flag in ("repeats", "decode_tokens", "threads"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(args.model, args.dtype, torch.device("cpu"),
                                  progress=not args.json)
    drafter = (None if args.speculative_model == "none"
               else load_drafter_model(args.speculative_model, model))
    prompt = _prompt(tokenizer, model.config.vocab_size, args.prompt_tokens)
    result: dict[str, Any] = {"prompt_tokens": args.prompt_tokens, "threads": args.threads,
                              "drafter": args.speculative_model, "runs": []}
    for legacy in (False, True) if drafter is not None and not args.no_legacy else (False,):
        result["runs"].append(measure(model, drafter, prompt, args.decode_tokens,
                                      args.repeats, args.num_spec_tokens, legacy))
    blocks = result["runs"][0]["transferred_tokens"] // BLOCK
    # the raw peer copies one paged KV per cache: a hybrid's groups have no such peer here
    result["raw"] = (raw_transfer(model, drafter, blocks, max(3, args.repeats))
                     if model.kv_cache_layout(BLOCK).num_groups == 1 else None)
    result["model"] = args.model
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    _print(result)
    return 0


def _print(result: dict[str, Any]) -> None:
    console = Console()
    table = Table(title=f"P/D over NIXL: {result['model']}, {result['prompt_tokens']}-token "
                        f"prompt, drafter {result['drafter']}, {result['threads']} thread(s); "
                        f"{result['runs'][0]['kv_groups']}")
    for column in ("hashes", "cold TTFT ms", "local hit TTFT ms", "P/D decode TTFT ms",
                   "P/D / local", "cached: local / P/D", "blocks pulled / offered",
                   "accept cold / P/D"):
        table.add_column(column, justify="right")
    for run in result["runs"]:
        t = run["ttft_ms"]
        table.add_row(
            "legacy+drop" if run["legacy"] else "lookahead", f"{t['cold']:.0f}",
            f"{t['local hit']:.0f}", f"{t['P/D decode']:.0f}",
            f"{t['P/D decode'] / t['local hit']:.2f}x",
            f"{run['cached_tokens']['local hit']} / {run['cached_tokens']['P/D decode']}",
            f"{run['pulled_blocks']} / {run['prompt_blocks']}",
            f"{run['acceptance']['cold']:.3f} / {run['acceptance']['pd']:.3f}")
    console.print(table)
    raw = result["raw"]
    if raw is None:
        return
    run = result["runs"][0]
    transfer = Table(title=f"transfer of {raw['bytes'] / 1e6:.1f} MB (target + draft KV)")
    for column in ("path", "GB/s"):
        transfer.add_column(column, justify="right")
    transfer.add_row("nixl connector (admit + READ)",
                     f"{run['loaded_bytes'] / max(run['transfer_s'], 1e-9) / 1e9:.2f}")
    transfer.add_row("raw NIXL READ, same bytes", f"{raw['nixl_gbps']:.2f}")
    transfer.add_row("torch copy_, same bytes", f"{raw['copy_gbps']:.2f}")
    console.print(transfer)
