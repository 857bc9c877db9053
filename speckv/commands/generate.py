"""`speckv generate "prompt"`: stream one completion to the terminal.

Owns the command's arguments and printing. The chat template is applied for chat models
(unless `--no-chat`); tokens are printed as they are sampled. Speculation follows the
measurement: on the built-in model the shipped EAGLE3 head is on by default only when its
recorded benchmark (`speckv bench spec-decode --record`) shows it faster at batch 1, and the
first stderr line says which drafter runs and what it measured; a summary line (tokens, TTFT,
tokens/s, cached prompt tokens, acceptance per draft position) goes to stderr at the end. With
`--kv-connector`, the engine's hash mode and why are printed first, and the summary says how
many cached tokens came from a tier: a disk tier (`--kv-connector disk --kv-offload-dir DIR`)
serves the next run of the same prompt.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from speckv.engine.cli_args import add_engine_arguments, engine_args_from_cli


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--model", default="builtin",
                        help="'builtin' (SmolLM2-135M-Instruct), 'hybrid-swa' (tiny random-init "
                        "Gemma-3-style sliding-window model), 'hybrid-gdn' (small random-init "
                        "Qwen3-Next-style GDN hybrid), an HF model dir or a .gguf file")
    parser.add_argument("--max-tokens", type=int, default=128, help="output tokens, at most")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    parser.add_argument("--top-k", type=int, default=0, help="0: off")
    parser.add_argument("--seed", type=int, default=None,
                        help="sampling seed (default: a fixed engine seed)")
    parser.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    add_engine_arguments(parser, seed_flag=False)


def run(args: argparse.Namespace) -> int:
    from speckv.engine.llm import LLM, random_init_note
    from speckv.engine.sampling_params import SamplingParams
    from speckv.engine.speculation_choice import choose_speculation

    if not args.prompt:  # one rule with the server's: an empty prompt is refused
        raise ValueError("the prompt is empty: give the text to complete, e.g. "
                         "speckv generate \"What is the capital of France?\"")
    if args.max_tokens < 1:
        raise ValueError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.max_model_len is not None and args.max_model_len < 1:
        raise ValueError(f"--max-model-len must be >= 1, got {args.max_model_len}")
    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
    )
    line = choose_speculation(args.model, args.speculative_method, args.speculative_model,
                              args.num_spec_tokens).summary
    engine_args = engine_args_from_cli(args)  # flag errors before the model loads
    connector = engine_args.kv_connector_config
    persistent = connector is not None and {"disk", "store"} & set(connector.names)
    if persistent and args.hash_seed is None and "PYTHONHASHSEED" not in os.environ:
        raise ValueError(f"--kv-connector {args.kv_connector} needs block hashes another process "
                         "can reproduce: pass --hash-seed (e.g. --hash-seed 0) or set "
                         "PYTHONHASHSEED")
    llm = LLM(args.model, **vars(engine_args))
    # after the engine is built: an error in the flags or the model files comes alone
    print(f"[{line}]", file=sys.stderr, flush=True)
    note = random_init_note(args.model)
    if note is not None:  # say it every time: its text is noise
        print(f"[{note}; KV groups {llm.engine.layout.describe()}]", file=sys.stderr)
    with llm:
        return _generate(llm, args, params, connector is not None)


def _generate(llm, args: argparse.Namespace, params, with_tiers: bool) -> int:
    if with_tiers:
        mode = llm.engine.hash_mode
        print(f"[KV tiers {args.kv_connector}; block hashes {mode.label}: {mode.reason}]",
              file=sys.stderr)
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
        accepted = ""
        if last.num_drafts_by_position:
            steps = last.num_drafts_by_position[0]
            accepted = (f", mean acceptance length {1 + last.num_accepted_tokens / steps:.2f}, "
                        "drafts accepted by position " + " / ".join(
                            f"{j}: {rate:.0%}"
                            for j, rate in enumerate(last.acceptance_by_position, 1))
                        + f" ({llm.engine.hash_mode.label})")
        stats = llm.engine.spec_decode_stats()
        if stats is not None:  # what the adaptive draft length chose
            accepted += (", steps drafting k = 0.." + str(stats.max_spec_tokens) + ": "
                         + "/".join(str(n) for n in stats.steps_by_num_spec_tokens))
            if stats.predicted_speedup is not None:
                accepted += f", predicted {stats.predicted_speedup:.2f}x over no drafts"
        cached = f", cached {last.num_cached_tokens}/{len(last.prompt_token_ids)} prompt tokens"
        if with_tiers:
            cached += f" ({last.num_external_cached_tokens} from the tiers)"
        print(
            f"[{len(last.token_ids)} tokens, finish={last.finish_reason}, TTFT {ttft}, "
            f"{len(last.token_ids) / elapsed:.1f} tokens/s{cached}{accepted}]",
            file=sys.stderr,
        )
    return 0
