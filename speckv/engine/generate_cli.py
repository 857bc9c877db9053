"""`speckv generate "prompt"`: stream one completion to the terminal.

Owns the command's arguments and printing. The chat template is applied for chat models
(unless `--no-chat`); tokens are printed as they are sampled; a summary line (tokens, TTFT,
tokens/s) goes to stderr.
"""

from __future__ import annotations

import argparse
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--model", default="builtin",
                        help="'builtin' (SmolLM2-135M-Instruct), an HF model dir or a .gguf file")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0: off")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda")


def run(args: argparse.Namespace) -> int:
    from speckv.engine.llm import LLM
    from speckv.engine.sampling_params import SamplingParams

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    llm = LLM(args.model, dtype=args.dtype, device=args.device)
    prompt = args.prompt if args.no_chat else llm.chat_prompt(args.prompt)
    start = time.perf_counter()
    last = None
    for output in llm.stream([prompt], params):
        if output.error:
            raise ValueError(output.error)
        sys.stdout.write(output.delta_text)
        sys.stdout.flush()
        last = output
    sys.stdout.write("\n")
    if last is not None:
        elapsed = time.perf_counter() - start
        ttft = f"{last.ttft_s * 1e3:.0f} ms" if last.ttft_s is not None else "-"
        print(
            f"[{len(last.token_ids)} tokens, finish={last.finish_reason}, TTFT {ttft}, "
            f"{len(last.token_ids) / elapsed:.1f} tokens/s]",
            file=sys.stderr,
        )
    return 0
