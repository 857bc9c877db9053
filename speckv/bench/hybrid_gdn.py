"""`speckv bench hybrid-gdn`: the GDN-hybrid scenario on tensors, and its speed vs transformers.

Owns (1) the hit-length scenario on a Gated DeltaNet hybrid (RANDOM-init weights,
said in the output): alignment unit 544 (GDN state checkpoint every 544 tokens, KV blocks of
16), a 1,367-token prompt sent twice, cached tokens with no drafter, with MTP and lookahead
hashes, with MTP and the legacy drop; for each, the second request's first logits and the
GDN state at the hit against a cold run on a fresh engine (max |diff|). The state at the hit is
bit-exact: the hit reads the bytes the first request's prefill wrote, and the cold run computes
the same prefill on the same shapes. The logits are equal within fp32 rounding only: the hit
computes the tokens after the hit in one forward, the cold run the whole prompt, and CPU GEMM
kernels round matmuls of different row counts differently. And (2) `--perf`:
prefill and decode tokens/s of the same model vs transformers' Qwen3-Next on the same weights
(same thread count), and the cost of state checkpointing during prefill (a prefill with a
checkpoint every unit vs the same prefill with none).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch
from rich.console import Console
from rich.table import Table

from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import SamplingParams

UNIT, BLOCK, PROMPT_TOKENS = 544, 16, 1367


@dataclass(frozen=True)
class ScenarioRow:
    case: str
    cached_tokens: int
    # the second request's logits at its last prompt token vs cold: within fp32 rounding (the
    # hit's forward has fewer rows than the cold run's)
    logits_max_abs_diff: float
    state_max_abs_diff: float  # GDN conv + recurrent state at the hit vs cold: bit-exact


def _engine(model, drafter=None, legacy: bool = False, unit: int = UNIT) -> LLMEngine:
    spec = {"speculative_method": "mtp", "num_spec_tokens": 1} if drafter is not None else {}
    config = engine_config(block_size=BLOCK, mamba_block_size=unit, num_blocks=600,
                           max_num_batched_tokens=4096, disable_lookahead_block_hashes=legacy,
                           **spec)
    return LLMEngine(model, config, drafter=drafter, detokenize=False)


def _first_step(engine: LLMEngine, prompt: list[int], hit: int | None, unit: int):
    """(cached tokens, logits of the last prompt token [vocab], state at `hit` or the hit)."""
    rid = engine.add_request(prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    captured: list[torch.Tensor] = []
    original = engine.runner.model.compute_logits

    def capture(hidden):
        logits = original(hidden)
        captured.append(logits[-1].clone())
        return logits

    engine.runner.model.compute_logits = capture  # type: ignore[method-assign]
    try:
        engine.step()
    finally:
        del engine.runner.model.compute_logits
    cached = engine.get_request(rid).num_cached_tokens
    length = cached if hit is None else hit
    states = engine.runner.states
    state = torch.zeros(1)
    if length:
        block = engine.runner.block_tables(rid)[states.group][(length - 1) // unit]
        conv, rec = states.cache.snapshot(block)
        state = torch.cat([conv.float().flatten(), rec.flatten()])
    while engine.has_unfinished_requests():
        engine.step()
    return cached, captured[0], state


def run_scenario(model, prompt: list[int], unit: int = UNIT) -> list[ScenarioRow]:
    from speckv.drafters.gated_mtp import random_gated_mtp

    drafter = random_gated_mtp(model)
    rows = []
    for case, d, legacy in (("no drafter", None, False),
                            ("MTP, lookahead hashes", drafter, False),
                            ("MTP, legacy hashes (block drop)", drafter, True)):
        warm = _engine(model, d, legacy, unit)
        _first_step(warm, prompt, 0, unit)
        cached, logits, state = _first_step(warm, prompt, None, unit)
        _, cold_logits, cold_state = _first_step(_engine(model, d, legacy, unit), prompt,
                                                 cached, unit)
        rows.append(ScenarioRow(case, cached, (logits - cold_logits).abs().max().item(),
                                (state - cold_state).abs().max().item()))
    return rows


# ---- performance ------------------------------------------------------------------------------
@dataclass(frozen=True)
class PerfRow:
    engine: str
    prefill_tokens_per_s: float
    decode_tokens_per_s: float


def _best(fns: dict, repeats: int) -> dict:
    """Best wall time of each function, the functions interleaved round by round (a shared,
    noisy CPU then slows all of them alike rather than whichever ran during a spike)."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def run_perf(model, prompt_tokens: int, decode_tokens: int, repeats: int = 3
             ) -> tuple[list[PerfRow], float, float, float]:
    """(rows for speckv and transformers, best prefill seconds with a checkpoint every unit,
    best without any checkpoint, median paired ratio with / without)."""
    vocab = model.config.vocab_size
    prompt = torch.randint(0, vocab, (prompt_tokens,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    params = SamplingParams(max_tokens=decode_tokens, ignore_eos=True)

    engine = LLMEngine(model, engine_config(block_size=BLOCK, mamba_block_size=UNIT,
                                            num_blocks=600, max_num_batched_tokens=4096,
                                            enable_prefix_caching=False), detokenize=False)

    def engine_run(max_tokens: int):  # no prefix caching: every run computes the prompt
        engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()

    hf_prefill, hf_generate = _transformers_peer(model, prompt, decode_tokens)
    times = _best({"ours_prefill": lambda: engine_run(1),
                   "ours_total": lambda: engine_run(params.max_tokens),
                   "hf_prefill": hf_prefill, "hf_total": hf_generate}, repeats)
    ours = PerfRow("speckv engine (paged, GDN state checkpoints)",
                   prompt_tokens / times["ours_prefill"],
                   (decode_tokens - 1) / max(times["ours_total"] - times["ours_prefill"], 1e-9))
    theirs = PerfRow("transformers Qwen3NextForCausalLM (torch fallbacks)",
                     prompt_tokens / times["hf_prefill"],
                     (decode_tokens - 1) / max(times["hf_total"] - times["hf_prefill"], 1e-9))
    with_ckpt, without, ratio = _checkpoint_cost(model, prompt, repeats)
    return [ours, theirs], with_ckpt, without, ratio


def _transformers_peer(model, prompt: list[int], decode_tokens: int):
    """(prefill, generate) callables running transformers' Qwen3-Next on `model`'s weights."""
    import transformers

    hf_cfg = model.config.to_hf_config()
    hf_config = transformers.Qwen3NextConfig(**{k: v for k, v in hf_cfg.items()
                                                if k not in ("architectures", "model_type",
                                                             "torch_dtype")})
    hf = transformers.Qwen3NextForCausalLM(hf_config).eval()
    state = {("model." + k if k != "lm_head.weight" else k): v
             for k, v in model.state_dict().items()}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if not m.endswith("inv_freq")]:
        raise RuntimeError(f"weights did not map onto transformers: {missing} {unexpected}")
    ids = torch.tensor([prompt])

    def hf_prefill():
        with torch.inference_mode():
            hf(ids, use_cache=True)

    def hf_generate():
        with torch.inference_mode():
            hf.generate(ids, max_new_tokens=decode_tokens, min_new_tokens=decode_tokens,
                        do_sample=False)

    return hf_prefill, hf_generate


def _checkpoint_cost(model, prompt: list[int], repeats: int) -> tuple[float, float, float]:
    """The same one-request prefill forward with a state checkpoint every unit and with none:
    (best seconds with, best without, median paired ratio with / without)."""
    from speckv.attention import AttentionMetadata
    from speckv.models.hybrid.model import plan_for

    prompt_tokens = len(prompt)
    kv = model.make_kv_cache(prompt_tokens // BLOCK + 2, BLOCK)
    states = model.make_state_cache(prompt_tokens // UNIT + 2)
    table = list(range(1, prompt_tokens // BLOCK + 2))
    md = AttentionMetadata.build([prompt_tokens], [prompt_tokens], [table], BLOCK)
    ids = torch.tensor(prompt)

    def forward(unit: int):
        state_table = list(range(1, prompt_tokens // unit + 2))
        plan = plan_for(states, [prompt_tokens], [prompt_tokens], [state_table], unit)
        with torch.inference_mode():
            model(ids, md.positions(), kv, md, state=plan)

    big = -(-prompt_tokens // BLOCK) * BLOCK  # one segment: no checkpoint before the end
    # paired rounds, order alternating; the median of the per-round ratios resists the
    # shared CPU's spikes better than either minimum alone
    forward(UNIT)
    forward(big)
    ratios, with_times, without_times = [], [], []
    for round_index in range(4 * repeats):
        order = (UNIT, big) if round_index % 2 == 0 else (big, UNIT)
        timed = {}
        for unit in order:
            start = time.perf_counter()
            forward(unit)
            timed[unit] = time.perf_counter() - start
        with_times.append(timed[UNIT])
        without_times.append(timed[big])
        ratios.append(timed[UNIT] / timed[big])
    return min(with_times), min(without_times), statistics.median(ratios)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--perf", action="store_true",
                        help="also prefill / decode tokens/s vs transformers and the "
                        "checkpointing cost")
    parser.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    parser.add_argument("--perf-prompt-tokens", type=int, default=2176,
                        help="--perf prefill length (default: 4 units)")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--tiers", action="store_true",
                        help="also the hit through the CPU tier, the disk tier and the store "
                        "(embedded Valkey) on a fresh engine, beside the local hit, for "
                        "hybrid-gdn and hybrid-swa (speckv/bench/hybrid_tiers.py)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from speckv.models.hybrid.hybrid_gdn import RANDOM_INIT_NOTE, hybrid_gdn_model

    if args.prompt_tokens < 2:
        raise ValueError("--prompt-tokens must be >= 2")
    torch.set_num_threads(args.threads)
    model = hybrid_gdn_model(vocab_size=4096)
    prompt = torch.randint(1, 4096, (args.prompt_tokens,),
                           generator=torch.Generator().manual_seed(1)).tolist()
    rows = run_scenario(model, prompt)
    result: dict = {"note": RANDOM_INIT_NOTE, "scenario": [asdict(r) for r in rows]}
    if args.perf:
        perf, with_ckpt, without, ratio = run_perf(model, args.perf_prompt_tokens,
                                                   args.decode_tokens)
        result["perf"] = [asdict(r) for r in perf]
        result["checkpoint"] = {"prefill_s_with": with_ckpt, "prefill_s_without": without,
                                "overhead_median_paired": ratio - 1}
    tier_rows = []
    if args.tiers:
        from speckv.bench.hybrid_tiers import run_tier_table

        tier_rows = run_tier_table(model, prompt, UNIT, BLOCK)
        result["tiers"] = [asdict(r) for r in tier_rows]
    if args.json:
        print(json.dumps(result))
        return 0
    console = Console()
    table = Table(title=f"[{RANDOM_INIT_NOTE}] prompt of {args.prompt_tokens} tokens sent twice; "
                        f"GDN state unit {UNIT}, KV block {BLOCK}; second request vs a cold run")
    for column in ("case", "cached tokens", "logits max |diff|", "GDN state at hit max |diff|"):
        table.add_column(column, justify="left" if column == "case" else "right")
    for r in rows:
        table.add_row(r.case, f"{r.cached_tokens:,}", f"{r.logits_max_abs_diff:.3g}",
                      f"{r.state_max_abs_diff:.3g}")
    console.print(table)
    console.print("GDN state at the hit: bit-exact (0 expected: the hit reads the bytes the first "
                  "request wrote, the cold run computes the same prefill). Logits: equal within "
                  "fp32 rounding (0 or ~1e-6: the hit's forward covers only the tokens after "
                  "the hit, the cold run's the whole prompt, and CPU matmul kernels round "
                  "different row counts differently).")
    if tier_rows:
        _print_tiers(console, tier_rows, args.prompt_tokens)
    if args.perf:
        ptable = Table(title=f"tokens/s, {args.perf_prompt_tokens}-token prefill, "
                             f"{args.decode_tokens} decode tokens, batch 1, "
                             f"{args.threads} thread(s), fp32 CPU, same weights")
        for column in ("engine", "prefill tok/s", "decode tok/s"):
            ptable.add_column(column, justify="left" if column == "engine" else "right")
        for r in perf:
            ptable.add_row(r.engine, f"{r.prefill_tokens_per_s:,.0f}",
                           f"{r.decode_tokens_per_s:,.1f}")
        ptable.add_row("ratio speckv / transformers",
                       f"{perf[0].prefill_tokens_per_s / perf[1].prefill_tokens_per_s:.2f}x",
                       f"{perf[0].decode_tokens_per_s / perf[1].decode_tokens_per_s:.2f}x")
        console.print(ptable)
        console.print(f"state checkpointing during prefill ({args.perf_prompt_tokens} tokens, "
                      f"one forward): best {with_ckpt * 1e3:.1f} ms with a checkpoint every "
                      f"{UNIT} tokens vs {without * 1e3:.1f} ms with none; median of paired "
                      f"rounds {(ratio - 1) * 100:+.1f}%")
    return 0


def _print_tiers(console: Console, rows: list, prompt_tokens: int) -> None:
    table = Table(title=f"[RANDOM-INIT weights] a {prompt_tokens}-token prompt: cached tokens "
                        "of the second request (local) and of the same prompt on a fresh "
                        "engine through each tier")
    for column in ("model", "case", "unit", "local", "CPU tier", "disk", "store",
                   "reads vs cold max |diff|"):
        table.add_column(column, justify="left" if column in ("model", "case") else "right")
    for r in rows:
        table.add_row(r.model, r.case, str(r.unit), f"{r.local_tokens:,}", f"{r.cpu_tokens:,}",
                      f"{r.disk_tokens:,}", f"{r.store_tokens:,}", f"{r.max_abs_diff:.3g}")
    console.print(table)
    console.print("reads: the target KV and draft KV over the hit, the sliding window's tail "
                  "and the GDN conv + recurrent state at the hit, against a cold run's "
                  "(0: bit-exact; the tier copies the bytes the first prefill wrote, the cold "
                  "run computes the same prefill on the same shapes).")
