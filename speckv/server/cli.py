"""`speckv serve [MODEL]`: the OpenAI-compatible server, with `vllm serve`'s flag names where
vLLM has them.

Owns the command's server flags; the engine flags are `speckv.engine.cli_args`'s (shared with
`speckv generate` and `speckv bench serve`, which launches this command and builds the same
engine in process for its comparison). MODEL defaults to the built-in model, which
gets EAGLE speculation with its shipped head unless `--drafter` says otherwise (as in
`speckv generate`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

from speckv.engine.cli_args import add_engine_arguments, engine_args_from_cli, parse_size

__all__ = ["add_arguments", "build_server", "parse_size", "run", "serve_prefill_threads",
           "serve_threads"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", default="builtin",
                        help="'builtin' (SmolLM2-135M-Instruct), 'hybrid-swa' (tiny random-init "
                        "Gemma-3-style sliding-window model), 'hybrid-gdn' (small random-init "
                        "Qwen3-Next-style GDN hybrid), an HF model dir or a .gguf file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None,
                        help="the model name clients send (default: MODEL)")
    parser.add_argument("--api-key", default=os.environ.get("SPECKV_API_KEY"),
                        help="require 'Authorization: Bearer KEY' (default: $SPECKV_API_KEY)")
    parser.add_argument("--max-waiting-requests", type=int, default=256,
                        help="waiting requests before new ones get 503 + Retry-After")
    parser.add_argument("--max-request-body-bytes", type=parse_size, default="8M",
                        help="larger bodies get 413")
    parser.add_argument("--uvicorn-log-level", default="warning",
                        choices=("critical", "error", "warning", "info", "debug", "trace"))
    add_engine_arguments(parser)


def build_server(args: argparse.Namespace, progress: bool = True):
    """The engine and server the flags describe (loads the model)."""
    from speckv.engine.llm import LLM
    from speckv.server.app import OpenAIServer, ServerConfig

    cores = _torch_default_threads()
    threads = serve_threads(args.threads, cores)
    config = ServerConfig(served_model_name=args.served_model_name or args.model,
                          api_key=args.api_key,
                          max_waiting_requests=args.max_waiting_requests,
                          max_request_body_bytes=args.max_request_body_bytes)
    engine_args = dataclasses.replace(
        engine_args_from_cli(args), threads=threads,
        prefill_threads=serve_prefill_threads(args.prefill_threads, threads, cores))
    llm = LLM(args.model, progress=progress, **vars(engine_args))
    return OpenAIServer(llm.engine, config, model_path=args.model)


@functools.cache
def _torch_default_threads() -> int:
    """torch's thread count before any engine of this process set it: its physical cores."""
    import torch

    return torch.get_num_threads()


def serve_threads(requested: int | None, torch_default: int) -> int:
    """The engine's compute threads: `--threads`, else one fewer than torch's default (its
    physical cores), at least 1. As vLLM's CPU engine does, one core is left to the HTTP
    server and the event loop: with every core computing, the server's work preempts a compute
    thread and the others wait for it at each op's barrier (the README's "speckv vs vLLM on
    CPU" gives the measured effect)."""
    if requested is not None:
        if requested < 1:
            raise ValueError(f"--threads must be >= 1, got {requested}")
        return requested
    return max(1, torch_default - 1)


def serve_prefill_threads(requested: int | None, threads: int, torch_default: int) -> int:
    """The compute threads of prefill-sized steps: `--prefill-threads`, else every core
    (torch's default), the server's too. Such a step runs torch's GEMMs for hundreds of
    milliseconds while the server has little to do; a decode step, which speckv's one-thread
    kernels compute, keeps `threads` (speckv.engine.step_threads). The engine's config
    refuses a count below 1."""
    return requested if requested is not None else max(threads, torch_default)


def run(args: argparse.Namespace) -> int:
    import torch

    from speckv.engine.cli_args import speculation_choice
    from speckv.engine.llm import random_init_note
    from speckv.server.launch import bind_socket, serve_forever

    # bound before the model loads: a busy port fails first, and --port 0 has its port to print
    sock = bind_socket(args.host, args.port)
    try:
        server = build_server(args)
    except BaseException:
        sock.close()
        raise
    engine = server.engine
    port = sock.getsockname()[1]
    host = f"[{args.host}]" if ":" in args.host else args.host
    note = random_init_note(args.model)
    if note is not None:  # say it every time: its text is noise
        print(f"[{note}]", file=sys.stderr, flush=True)
    print(f"speckv serve: {server.config.served_model_name} on http://{host}:{port} "
          f"({engine.model.device}, {engine.num_blocks} KV blocks of "
          f"{engine.config.cache.block_size}"
          f", {engine.hash_mode.label} block hashes"
          + (f", {engine.num_spec_tokens} draft tokens" if engine.num_spec_tokens else "")
          + ", " + (engine.step_threads.describe() if engine.step_threads is not None
                    else f"{torch.get_num_threads()} compute thread(s)") + ")", flush=True)
    print(f"speckv serve: KV budget: {engine.kv_budget.describe()}", flush=True)
    choice, _ = speculation_choice(args.model, args.speculative_method, args.speculative_model,
                                   args.num_spec_tokens, args.speculative_config)
    print(f"speckv serve: {choice.summary}", flush=True)
    for line in engine.connector.startup_lines() if engine.connector is not None else ():
        print(f"speckv serve: {line}", flush=True)
    from speckv.models.common.native_linear import linear_forms_summary

    print(f"speckv serve: projections: {linear_forms_summary(engine.model)}", flush=True)
    serve_forever(server, sock, args.uvicorn_log_level)
