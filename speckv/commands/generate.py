"""`speckv generate "prompt"`: stream one completion to the terminal.

Owns the command's arguments and printing. The chat template is applied for chat models
(unless `--no-chat`); tokens are printed as they are sampled; a summary line (tokens, TTFT,
tokens/s, cached prompt tokens) goes to stderr. With `--kv-connector`, the engine's hash mode
and why are printed first, and the summary says how many cached tokens came from a tier: a
disk tier (`--kv-connector disk --kv-offload-dir DIR`) serves the next run of the same prompt.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from speckv.connectors.config import add_connector_arguments, connector_config_from_args
from speckv.engine.kv_connector import connector_engine_kwargs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompt", help="the prompt text")
    parser.add_argument("--model", default="builtin",
                        help="'builtin' (SmolLM2-135M-Instruct), 'hybrid-swa' (tiny random-init "
                        "Gemma-3-style sliding-window model), 'hybrid-gdn' (small random-init "
                        "Qwen3-Next-style GDN hybrid), an HF model dir or a .gguf file")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0: off")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--no-chat", action="store_true", help="do not apply the chat template")
    parser.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda")
    parser.add_argument("--speculative-method", "--drafter", dest="speculative_method",
                        choices=("none", "ngram", "eagle", "eagle3", "mtp"), default=None,
                        help="speculative decoding (default: eagle with the built-in head "
                        "for the built-in model, none otherwise)")
    parser.add_argument("--speculative-model", "--draft-model", dest="speculative_model",
                        default=None,
                        help="drafter dir (EAGLE / EAGLE3 / MTP) or 'builtin'; --draft-model "
                        "is a deprecated alias")
    parser.add_argument("--num-spec-tokens", type=int, default=3)
    parser.add_argument("--disable-lookahead-block-hashes", action="store_true",
                        help="legacy block hashes and the last-block drop")
    parser.add_argument("--hash-seed", default=None,
                        help="block-hash seed (default: PYTHONHASHSEED, else random; a disk "
                        "tier needs one that another process can reproduce)")
    add_connector_arguments(parser)


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
    method = args.speculative_method
    speculative_model = args.speculative_model
    if method is None:
        method = "eagle" if args.model == "builtin" or speculative_model else "none"
    if method == "mtp" and speculative_model is None and args.model == "hybrid-gdn":
        speculative_model = "random-mtp"  # a random-init MTP drafter on the random hybrid
    if method in ("eagle", "eagle3", "mtp") and speculative_model is None:
        if args.model != "builtin":
            raise ValueError(
                f"--speculative-method {method} needs --speculative-model DIR for this model")
        speculative_model = "builtin"
    speculative = {} if method == "none" else {
        "speculative_method": method, "num_spec_tokens": args.num_spec_tokens,
        "speculative_model": speculative_model if method != "ngram" else None,
    }
    connector = connector_config_from_args(args)  # flag errors before the model loads
    persistent = connector is not None and {"disk", "store"} & set(connector.names)
    if persistent and args.hash_seed is None and "PYTHONHASHSEED" not in os.environ:
        raise ValueError(f"--kv-connector {args.kv_connector} needs block hashes another process "
                         "can reproduce: pass --hash-seed (e.g. --hash-seed 0) or set "
                         "PYTHONHASHSEED")
    tiers = {} if connector is None else connector_engine_kwargs(args.kv_connector, connector)
    llm = LLM(args.model, dtype=args.dtype, device=args.device,
              disable_lookahead_block_hashes=args.disable_lookahead_block_hashes,
              hash_seed=args.hash_seed, **speculative, **tiers)
    if args.model == "hybrid-swa":  # say it every time: its text is noise
        from speckv.models.hybrid_swa import RANDOM_INIT_NOTE

        print(f"[{RANDOM_INIT_NOTE}; KV groups {llm.engine.layout.describe()}]",
              file=sys.stderr)
    if args.model == "hybrid-gdn":  # say it every time: its text is noise
        from speckv.models.hybrid_gdn import RANDOM_INIT_NOTE as GDN_NOTE

        print(f"[{GDN_NOTE}; KV groups {llm.engine.layout.describe()}]", file=sys.stderr)
    with llm:
        return _generate(llm, args, params, connector is not None)


def _generate(llm, args: argparse.Namespace, params, with_tiers: bool) -> int:
    if with_tiers:
        mode = llm.engine.hash_mode
        print(f"[KV tiers {args.kv_connector}: {mode.label} ({mode.reason})]", file=sys.stderr)
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
        if last.num_draft_tokens:
            accepted = (f", drafts accepted {last.num_accepted_tokens}/"
                        f"{last.num_draft_tokens} ({llm.engine.hash_mode.label})")
        cached = f", cached {last.num_cached_tokens}/{len(last.prompt_token_ids)} prompt tokens"
        if with_tiers:
            cached += f" ({last.num_external_cached_tokens} from the tiers)"
        print(
            f"[{len(last.token_ids)} tokens, finish={last.finish_reason}, TTFT {ttft}, "
            f"{len(last.token_ids) / elapsed:.1f} tokens/s{cached}{accepted}]",
            file=sys.stderr,
        )
    return 0
