"""`speckv bench spec-decode`: decode speed with speculation versus without, same run.

The built-in model with its shipped EAGLE head (or `--speculative-model DIR`), greedy, on held-out
chat prompts, at batch 1 and batch 8: output tokens/s per mode, the ratio, the drafts'
acceptance rate and mean acceptance length, and whether outputs are identical (they must be:
greedy verification is lossless).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict, dataclass

import torch
from rich.console import Console
from rich.table import Table


@dataclass(frozen=True)
class SpecRow:
    batch_size: int
    plain_tokens_per_s: float
    spec_tokens_per_s: float
    speedup: float
    acceptance_rate: float
    mean_acceptance_length: float
    identical_outputs: bool


def _generate(model, tokenizer, drafter, prompts, batch_size, max_tokens, num_spec):
    from speckv.engine.config import EngineConfig
    from speckv.engine.llm_engine import LLMEngine
    from speckv.engine.sampling_params import SamplingParams
    from speckv.engine.speculative import speculative_args

    config = EngineConfig(max_num_seqs=batch_size, num_blocks=512, dtype=str(model.dtype),
                          **speculative_args(drafter, num_spec))
    engine = LLMEngine(model, config, tokenizer, drafter=drafter)
    params = SamplingParams(max_tokens=max_tokens)
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    done = {}
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    elapsed = time.perf_counter() - start
    outputs = [done[i] for i in ids]
    return outputs, sum(len(o.token_ids) for o in outputs) / elapsed


def measure(model, tokenizer, drafter, prompts, batch_size, max_tokens, num_spec) -> SpecRow:
    plain, plain_rate = _generate(model, tokenizer, None, prompts, batch_size, max_tokens,
                                  num_spec)
    spec, spec_rate = _generate(model, tokenizer, drafter, prompts, batch_size, max_tokens,
                                num_spec)
    from speckv.engine.outputs import acceptance_stats

    rate, length = acceptance_stats(spec, num_spec) or (0.0, 1.0)
    return SpecRow(batch_size, plain_rate, spec_rate, spec_rate / plain_rate, rate, length,
                   [o.token_ids for o in plain] == [o.token_ids for o in spec])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--speculative-model", "--draft-model", dest="speculative_model",
                        default="builtin",
                        help="drafter dir (EAGLE / EAGLE3 / MTP) or 'builtin' (EAGLE head); "
                        "--draft-model is a deprecated alias")
    parser.add_argument("--num-spec-tokens", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from speckv.drafters.prompts import eval_prompts
    from speckv.engine.llm import load_model
    from speckv.engine.speculative import load_drafter_model

    batch_sizes = [int(size) for size in args.batch_sizes.split(",")]
    if min(batch_sizes) < 1 or args.num_spec_tokens < 1 or args.num_prompts < 1:
        raise ValueError("--batch-sizes, --num-spec-tokens and --num-prompts must be >= 1")
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model("builtin", "float32", "cpu", progress=not args.json)
    drafter = load_drafter_model(args.speculative_model, model)
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": text}])
               for text in eval_prompts(args.num_prompts)]
    rows = []
    for batch_size in batch_sizes:
        # batch 1 runs fewer prompts: the per-token speed is what matters
        subset = prompts[: max(2, min(len(prompts), batch_size))]
        rows.append(measure(model, tokenizer, drafter, subset, batch_size, args.max_tokens,
                            args.num_spec_tokens))
    if args.json:
        print(json.dumps([asdict(row) for row in rows]))
        return 0
    table = Table(title=f"greedy decode on the built-in model, {args.num_spec_tokens} spec "
                        f"tokens, {args.max_tokens} output tokens per prompt")
    for column in ("batch", "no spec tok/s", "EAGLE tok/s", "speedup", "accept rate",
                   "mean accept len", "same output"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(str(row.batch_size), f"{row.plain_tokens_per_s:.1f}",
                      f"{row.spec_tokens_per_s:.1f}", f"{row.speedup:.2f}x",
                      f"{row.acceptance_rate:.2f}", f"{row.mean_acceptance_length:.2f}",
                      str(row.identical_outputs))
    Console().print(table)
    return 0
