"""`speckv bench throughput`: the engine on the built-in model vs Hugging Face `transformers`.

Owns three side-by-side measurements on the same weights (the converted built-in
SmolLM2-135M-Instruct) and machine, printed as ratios (absolute times are noise on a shared
CPU):

    (a) prefill tokens/s of a 1,024-token prompt (engine, prefix caching off) vs HF generate
        with max_new_tokens=1                                    target: ratio >= 1
    (b) decode tokens/s of 16 concurrent requests x 128 output tokens (engine) vs HF generating
        the same 16 requests one at a time                        target: ratio >= 4
    (b1) decode tokens/s of one request alone (engine) vs HF's per-request rate of (b)
    (c) time to first token of a prompt whose first 1,024 tokens are cached vs the same prompt
        cold (engine only)                                        reported: cold / cached

`--quick` shortens (b) to 32 output tokens and times HF on 4 of the 16 requests (its rate is
per request, as they run one at a time), with one timed repeat everywhere.

`--model hybrid-swa` runs the same three measurements on the tiny random-init Gemma 3-style
sliding-window model (`models/hybrid_swa.py`) against transformers' `Gemma3ForCausalLM` loaded
from the same weights (written once to a temporary directory).
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
from rich.console import Console
from rich.table import Table
from tqdm.auto import tqdm

from speckv.engine.engine_args import EngineArgs
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import SamplingParams

PREFILL_TOKENS = 1024
NUM_DECODE_REQUESTS = 16
DECODE_PROMPT_TOKENS = 32
CACHED_PREFIX_TOKENS = 1024
SUFFIX_TOKENS = 16


@dataclass(frozen=True)
class ThroughputResult:
    device: str
    dtype: str
    prefill_tokens: int
    prefill_speckv_tok_s: float
    prefill_hf_tok_s: float
    prefill_ratio: float
    decode_requests: int
    decode_output_tokens: int
    decode_speckv_tok_s: float
    decode_hf_sequential_tok_s: float
    decode_hf_requests_timed: int
    decode_ratio: float
    ttft_cold_s: float
    ttft_cached_s: float
    ttft_cached_tokens: int
    ttft_ratio: float
    model: str = "SmolLM2-135M"
    decode1_speckv_tok_s: float = 0.0  # one request alone (HF's rate is per request anyway)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="shorter runs (a few minutes)")
    parser.add_argument("--model", default="builtin", choices=["builtin", "hybrid-swa"],
                        help="builtin (SmolLM2-135M) or hybrid-swa (tiny random-init Gemma 3-"
                        "style sliding-window model vs transformers' Gemma3ForCausalLM)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA)")
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--repeats", type=int, default=None, help="timed repeats (best kept)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads for both engines (default: torch's choice; 1 "
                             "avoids spin-wait stalls on a CPU shared with other jobs)")


def _random_tokens(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    return [rng.randrange(100, vocab_size) for _ in range(n)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _run_engine(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> list:
    for prompt in prompts:
        engine.add_request(prompt, params)
    finals = []
    while engine.has_unfinished_requests():
        finals.extend(o for o in engine.step() if o.finished)
    return finals


def _load_hf(path, dtype: torch.dtype, device: torch.device):
    from transformers import LlamaForCausalLM as HFLlama

    try:
        model = HFLlama.from_pretrained(str(path), dtype=dtype)
    except TypeError:  # transformers < 4.56 spells it torch_dtype
        model = HFLlama.from_pretrained(str(path), torch_dtype=dtype)
    return model.to(device).eval()


@torch.inference_mode()
def _hf_generate(hf, prompt: list[int], new_tokens: int, device: torch.device) -> float:
    ids = torch.tensor([prompt], device=device)
    _sync(device)
    start = time.perf_counter()
    hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    _sync(device)
    return time.perf_counter() - start


def _load_pair(model_name: str, dtype_name: str, device: torch.device, scratch: str):
    """(our model, transformers' model) on the same weights, and a label."""
    if model_name == "hybrid-swa":
        from transformers import Gemma3ForCausalLM

        from speckv.models.gemma.hybrid_swa import hybrid_swa_model
        from speckv.models.gemma.loader import save_gemma_dir

        model = hybrid_swa_model(dtype=dtype_name, device=device)
        save_gemma_dir(scratch, model)
        hf = Gemma3ForCausalLM.from_pretrained(scratch, dtype=getattr(torch, dtype_name))
        hf = hf.to(device).eval()
        _check_same_logits(model, hf, device)
        return model, hf, "hybrid-swa (random-init, SWA 128 + global)"
    from speckv.models.llama.builtin import convert_builtin
    from speckv.models.llama.loader import load_hf_dir

    path = convert_builtin()
    model, _ = load_hf_dir(path, dtype_name, device)
    return model, _load_hf(path, getattr(torch, dtype_name), device), "SmolLM2-135M"


@torch.inference_mode()
def _check_same_logits(model, hf, device: torch.device) -> None:
    """The two models must be the same function: last-position logits of a prompt past the
    window agree (fp32: 1e-3; a half dtype: loosely)."""
    from speckv.models.common.generate import greedy_generate

    prompt = list(range(3, 300))
    ours = greedy_generate(model, prompt, 4)
    theirs = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=4,
                         do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    if model.dtype == torch.float32 and ours != theirs:
        raise RuntimeError(f"transformers' model disagrees with ours: {theirs} vs {ours}")


def measure(quick: bool, dtype: str = "auto", device: str = "auto",
            repeats: int | None = None, model_name: str = "builtin") -> ThroughputResult:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="speckv-throughput-") as scratch:
        return _measure(quick, dtype, device, repeats, model_name, scratch)


def _best_run_s(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams,
                repeats: int, device: Any) -> float:
    """The fastest of `repeats` runs of `prompts` to the end, seconds (every request makes
    its `max_tokens`)."""
    best = float("inf")
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        finals = _run_engine(engine, prompts, params)
        _sync(device)
        best = min(best, time.perf_counter() - start)
        assert sum(len(o.token_ids) for o in finals) == len(prompts) * params.max_tokens
    return best


def _ttft(model: Any, args: EngineArgs, rng: random.Random, repeats: int
          ) -> tuple[float, float, int]:
    """(c) TTFT: 1,024 cached prefix tokens + a fresh suffix vs the same prompt cold: the
    fastest cold and cached TTFT, seconds, and the cached tokens."""
    vocab = model.config.vocab_size
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    prefix = _random_tokens(rng, CACHED_PREFIX_TOKENS, vocab)
    cold_times, cached_times, cached_tokens = [], [], 0
    engine = LLMEngine(model, replace(args, max_num_batched_tokens=2048).create_engine_config())
    _run_engine(engine, [_random_tokens(rng, 64, vocab)], one)  # warm up
    for _ in range(repeats):
        engine.manager.reset_prefix_cache()
        cold = _run_engine(engine, [prefix + _random_tokens(rng, SUFFIX_TOKENS, vocab)], one)
        warm = _run_engine(engine, [prefix + _random_tokens(rng, SUFFIX_TOKENS, vocab)], one)
        cold_times.append(cold[0].ttft_s)
        cached_times.append(warm[0].ttft_s)
        cached_tokens = warm[0].num_cached_tokens
    return min(cold_times), min(cached_times), cached_tokens


def _measure(quick: bool, dtype: str, device: str, repeats: int | None, model_name: str,
             scratch: str) -> ThroughputResult:
    """Every timed section of the bench in the order it runs (the peer's and ours
    alternated; the cached TTFT in `_ttft`)."""
    args = EngineArgs(dtype=dtype, device=device)
    base = args.create_engine_config()
    torch_device = base.resolved_device()
    dtype_name = base.resolved_dtype()
    repeats = repeats or (1 if quick else 3)
    output_tokens = 32 if quick else 128
    hf_requests = 4 if quick else NUM_DECODE_REQUESTS
    model, hf, label = _load_pair(model_name, dtype_name, torch_device, scratch)
    vocab = model.config.vocab_size
    rng = random.Random(0)
    bar = tqdm(total=4, desc="bench throughput", unit="phase")

    # (a) prefill of a 1,024-token prompt, cold (prefix caching off) vs HF
    prompt = _random_tokens(rng, PREFILL_TOKENS, vocab)
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    engine = LLMEngine(model, replace(args, enable_prefix_caching=False,
                                      max_num_batched_tokens=PREFILL_TOKENS
                                      ).create_engine_config())
    ours, theirs = [], []
    for index in range(repeats + 1):  # the first round warms up both
        _sync(torch_device)
        start = time.perf_counter()
        _run_engine(engine, [prompt], one)
        _sync(torch_device)
        if index:
            ours.append(time.perf_counter() - start)
        elapsed = _hf_generate(hf, prompt, 1, torch_device)
        if index:
            theirs.append(elapsed)
    prefill_ours = PREFILL_TOKENS / min(ours)
    prefill_hf = PREFILL_TOKENS / min(theirs)
    bar.update(1)

    # (b) decode: 16 concurrent requests vs HF one at a time
    prompts = [_random_tokens(rng, DECODE_PROMPT_TOKENS, vocab)
               for _ in range(NUM_DECODE_REQUESTS)]
    params = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
    engine = LLMEngine(model, replace(args, enable_prefix_caching=False).create_engine_config())
    _run_engine(engine, prompts[:2], SamplingParams(max_tokens=4, ignore_eos=True))  # warm up
    best = _best_run_s(engine, prompts, params, repeats, torch_device)
    decode_ours = NUM_DECODE_REQUESTS * output_tokens / best
    # one request alone: per-token overhead vs HF's own loop
    decode1_ours = output_tokens / _best_run_s(engine, prompts[:1], params, repeats,
                                               torch_device)
    bar.update(1)
    _hf_generate(hf, prompts[0], 4, torch_device)  # warm up
    hf_time = 0.0
    for prompt_ids in tqdm(prompts[:hf_requests], desc="HF one at a time", unit="req",
                           leave=False):
        hf_time += _hf_generate(hf, prompt_ids, output_tokens, torch_device)
    decode_hf = hf_requests * output_tokens / hf_time
    bar.update(1)

    ttft_cold, ttft_cached, cached_tokens = _ttft(model, args, rng, repeats)
    bar.update(1)
    bar.close()
    return ThroughputResult(
        device=str(torch_device), dtype=dtype_name,
        prefill_tokens=PREFILL_TOKENS, prefill_speckv_tok_s=prefill_ours,
        prefill_hf_tok_s=prefill_hf, prefill_ratio=prefill_ours / prefill_hf,
        decode_requests=NUM_DECODE_REQUESTS, decode_output_tokens=output_tokens,
        decode_speckv_tok_s=decode_ours, decode_hf_sequential_tok_s=decode_hf,
        decode_hf_requests_timed=hf_requests, decode_ratio=decode_ours / decode_hf,
        ttft_cold_s=ttft_cold, ttft_cached_s=ttft_cached, ttft_cached_tokens=cached_tokens,
        ttft_ratio=ttft_cold / ttft_cached, model=label, decode1_speckv_tok_s=decode1_ours,
    )


def render(result: ThroughputResult, console: Console) -> None:
    table = Table(title=f"speckv vs transformers — {result.model}, {result.device}, {result.dtype}"
                        f", {torch.get_num_threads()} CPU threads")
    table.add_column("measurement")
    table.add_column("speckv", justify="right")
    table.add_column("transformers", justify="right")
    table.add_column("ratio", justify="right")
    table.add_column("target", justify="right")
    table.add_row(
        f"(a) prefill, {result.prefill_tokens}-token prompt (tokens/s)",
        f"{result.prefill_speckv_tok_s:,.0f}", f"{result.prefill_hf_tok_s:,.0f}",
        f"{result.prefill_ratio:.2f}x", ">= 1x",
    )
    table.add_row(
        f"(b) decode, {result.decode_requests} concurrent x {result.decode_output_tokens} "
        f"tokens (tokens/s; HF one at a time, {result.decode_hf_requests_timed} timed)",
        f"{result.decode_speckv_tok_s:,.1f}", f"{result.decode_hf_sequential_tok_s:,.1f}",
        f"{result.decode_ratio:.2f}x", ">= 4x",
    )
    table.add_row(
        f"(b1) decode, 1 request x {result.decode_output_tokens} tokens (tokens/s)",
        f"{result.decode1_speckv_tok_s:,.1f}", f"{result.decode_hf_sequential_tok_s:,.1f}",
        f"{result.decode1_speckv_tok_s / result.decode_hf_sequential_tok_s:.2f}x", "",
    )
    table.add_row(
        f"(c) TTFT, {result.ttft_cached_tokens} cached tokens vs cold (ms)",
        f"{result.ttft_cached_s * 1e3:,.1f}", f"cold {result.ttft_cold_s * 1e3:,.1f}",
        f"{result.ttft_ratio:.2f}x faster", "",
    )
    console.print(table)


def run(args: argparse.Namespace) -> int:
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    result = measure(args.quick, args.dtype, args.device, args.repeats, args.model)
    if args.json:
        print(json.dumps(asdict(result), indent=1))
    else:
        render(result, Console())
    return 0
