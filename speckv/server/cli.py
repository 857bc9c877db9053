"""`speckv serve [MODEL]`: the OpenAI-compatible server, with `vllm serve`'s flag names where
vLLM has them.

Owns the command's arguments: the engine flags (shared with `speckv bench serve`, which
launches this command and builds the same engine in process for its comparison), turning them
into `LLM` keyword arguments, and the server flags. MODEL defaults to the built-in model, which
gets EAGLE speculation with its shipped head unless `--drafter` says otherwise (as in
`speckv generate`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

from speckv.connectors.config import add_connector_arguments, connector_config_from_args
from speckv.engine.kv_connector import connector_engine_kwargs
from speckv.engine.speculation_choice import SPECULATIVE_METHODS, choose_speculation

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from '536870912', '512M', '512MiB', '2G' (powers of 1024, as vLLM reads them)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 512M, 2G)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** " kmgt".index(unit or " "))


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The engine flags of `speckv serve` (and `speckv bench serve --compare-in-process`)."""
    engine = parser.add_argument_group("engine")
    engine.add_argument("--hash-seed", default=None,
                        help="block-hash seed (default: PYTHONHASHSEED, else random); needed "
                        "by --kv-connector disk / store and by routers")
    engine.add_argument("--dtype", default="auto", help="auto, float32, bfloat16, float16")
    engine.add_argument("--device", default="auto", help="auto, cpu, cuda[:N]")
    engine.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    engine.add_argument("--kv-cache-memory-bytes", type=parse_size, default=None,
                        help="KV cache size, e.g. 512M (default 512M)")
    engine.add_argument("--num-gpu-blocks-override", type=int, default=None,
                        help="KV blocks, overriding the memory budget")
    engine.add_argument("--max-model-len", type=int, default=None,
                        help="tokens per sequence (default: the model's)")
    engine.add_argument("--max-num-seqs", type=int, default=64, help="running requests, at most")
    engine.add_argument("--max-num-batched-tokens", type=int, default=2048,
                        help="tokens per engine step")
    engine.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True, help="prefix caching")
    engine.add_argument("--prefix-caching-hash-algo", default="sha256",
                        choices=("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"))
    engine.add_argument("--seed", type=int, default=0, help="base of per-request seeds")
    engine.add_argument("--speculative-method", "--drafter", dest="speculative_method",
                        choices=SPECULATIVE_METHODS, default=None,
                        help="speculative decoding (default: eagle3 with the built-in head on "
                        "the built-in model where its recorded benchmark is faster, else none)")
    engine.add_argument("--speculative-model", "--draft-model", dest="speculative_model",
                        default=None,
                        help="drafter dir (EAGLE / EAGLE3 / MTP) or 'builtin' (the built-in "
                        "model's EAGLE3 head); --draft-model is a deprecated alias")
    engine.add_argument("--num-spec-tokens", type=int, default=3,
                        help="most drafts per step (the engine drafts fewer or none when that "
                        "is faster)")
    engine.add_argument("--speculative-config", type=json.loads, default=None,
                        help='vLLM style, e.g. \'{"method": "eagle", "model": "DIR", '
                        '"num_speculative_tokens": 3}\' (overrides --speculative-method and '
                        'friends)')
    engine.add_argument("--disable-lookahead-block-hashes", action="store_true",
                        help="legacy block hashes and the last-block drop")
    engine.add_argument("--disable-divergent-block-reuse", action="store_true",
                        help="recompute a block whose cached copy names another successor "
                        "instead of copying it and recomputing its last position(s)")
    engine.add_argument("--kv-events-endpoint", default=None,
                        help="publish KV events on this ZeroMQ PUB endpoint (tcp://*:5557)")
    engine.add_argument("--kv-events-replay-endpoint", default=None,
                        help="answer replay requests on this ZeroMQ ROUTER endpoint")
    engine.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                        help='prefill/decode disaggregation over NIXL: {"kv_connector": "nixl", '
                             '"kv_role": "kv_producer" | "kv_consumer" | "kv_both"} (also '
                             'kv_port, kv_lease_s, kv_transfer_timeout_s, '
                             'kv_load_failure_policy, engine_id); the side channel binds --host')
    engine.add_argument("--threads", type=int, default=None,
                        help="torch CPU threads (default: torch's choice)")
    add_connector_arguments(parser)


def connector_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`EngineConfig` KV-connector fields from the `--kv-*` flags ({} without a connector)."""
    connector = connector_config_from_args(args)
    if connector is None:
        return {}
    return connector_engine_kwargs(args.kv_connector, connector)


def speculative_kwargs(model: str, drafter: str | None, speculative_model: str | None,
                       num_spec_tokens: int, speculative_config: dict[str, Any] | None
                       ) -> dict[str, Any]:
    """`EngineConfig` speculative fields from the flags (the `speckv generate` defaults)."""
    if speculative_config is not None:
        if not isinstance(speculative_config, dict) or "method" not in speculative_config:
            raise ValueError('--speculative-config needs a JSON object with "method"')
        unknown = set(speculative_config) - {"method", "model", "num_speculative_tokens"}
        if unknown:
            raise ValueError(f"--speculative-config: unsupported keys {sorted(unknown)}")
        drafter = str(speculative_config["method"])
        speculative_model = speculative_config.get("model")
        num_spec_tokens = int(speculative_config.get("num_speculative_tokens", num_spec_tokens))
        if drafter not in SPECULATIVE_METHODS:
            raise ValueError(f"--speculative-config method must be one of {SPECULATIVE_METHODS}")
    choice = choose_speculation(model, drafter, speculative_model, num_spec_tokens)
    if choice.method == "none":
        return {}
    return {"speculative_method": choice.method, "num_spec_tokens": num_spec_tokens,
            "speculative_model": choice.speculative_model}


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """`LLM(model, **engine_kwargs(args))` builds the engine the flags describe."""
    kwargs: dict[str, Any] = {
        "dtype": args.dtype, "device": args.device, "block_size": args.block_size,
        "num_blocks": args.num_gpu_blocks_override, "max_model_len": args.max_model_len,
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": args.enable_prefix_caching,
        "hash_algo": args.prefix_caching_hash_algo, "seed": args.seed,
        "disable_lookahead_block_hashes": args.disable_lookahead_block_hashes,
        "disable_divergent_block_reuse": args.disable_divergent_block_reuse,
        "kv_events_endpoint": args.kv_events_endpoint,
        "kv_events_replay_endpoint": args.kv_events_replay_endpoint,
    }
    if args.kv_cache_memory_bytes is not None:
        kwargs["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    if args.hash_seed is not None:
        kwargs["hash_seed"] = args.hash_seed
    kwargs.update(connector_kwargs(args))
    if getattr(args, "kv_transfer_config", None) is not None:
        kwargs["kv_transfer_config"] = args.kv_transfer_config
        kwargs["kv_transfer_host"] = getattr(args, "host", None) or "127.0.0.1"
    kwargs.update(speculative_kwargs(args.model, args.speculative_method, args.speculative_model,
                                     args.num_spec_tokens, args.speculative_config))
    return kwargs


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags as a command line (to launch `speckv serve` with the same engine)."""
    flags = [args.model, "--dtype", args.dtype, "--device", args.device,
             "--block-size", str(args.block_size), "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--prefix-caching-hash-algo", args.prefix_caching_hash_algo,
             "--seed", str(args.seed), "--num-spec-tokens", str(args.num_spec_tokens)]
    optional = {"--kv-cache-memory-bytes": args.kv_cache_memory_bytes,
                "--num-gpu-blocks-override": args.num_gpu_blocks_override,
                "--max-model-len": args.max_model_len,
                "--speculative-method": args.speculative_method,
                "--speculative-model": args.speculative_model, "--threads": args.threads,
                "--kv-events-endpoint": args.kv_events_endpoint,
                "--kv-events-replay-endpoint": args.kv_events_replay_endpoint,
                "--kv-transfer-config": getattr(args, "kv_transfer_config", None)}
    optional.update({"--hash-seed": args.hash_seed, "--kv-connector": args.kv_connector,
                     "--kv-offload-dir": args.kv_offload_dir, "--kv-store-url": args.kv_store_url})
    if args.kv_connector is not None:
        optional.update({"--kv-offload-gb": args.kv_offload_gb,
                         "--kv-offload-disk-gb": args.kv_offload_disk_gb,
                         "--kv-store-gb": args.kv_store_gb,
                         "--kv-store-timeout": args.kv_store_timeout})
        flags += ["--kv-store-cluster"] * args.kv_store_cluster
        flags += ["--kv-store-optional"] * args.kv_store_optional
    for flag, value in optional.items():
        if value is not None:
            flags += [flag, str(value)]
    if args.speculative_config is not None:
        flags += ["--speculative-config", json.dumps(args.speculative_config)]
    if not args.enable_prefix_caching:
        flags.append("--no-enable-prefix-caching")
    if args.disable_lookahead_block_hashes:
        flags.append("--disable-lookahead-block-hashes")
    if args.disable_divergent_block_reuse:
        flags.append("--disable-divergent-block-reuse")
    return flags


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
    import torch

    from speckv.engine.llm import LLM
    from speckv.server.app import OpenAIServer, ServerConfig

    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    config = ServerConfig(served_model_name=args.served_model_name or args.model,
                          api_key=args.api_key,
                          max_waiting_requests=args.max_waiting_requests,
                          max_request_body_bytes=args.max_request_body_bytes)
    llm = LLM(args.model, progress=progress, **engine_kwargs(args))
    return OpenAIServer(llm.engine, config, model_path=args.model)


def run(args: argparse.Namespace) -> int:
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
          f"({engine.model.device}, {engine.num_blocks} KV blocks of {engine.config.block_size}"
          f", {engine.hash_mode.label} block hashes"
          + (f", {engine.num_spec_tokens} draft tokens" if engine.num_spec_tokens else "")
          + ")", flush=True)
    transfer = _transfer_connector(engine.connector)
    if transfer is not None:
        print(f"speckv serve: KV transfer over NIXL, {transfer.config.role}, engine "
              f"{transfer.config.engine_id}"
              + (f", side channel {transfer.config.host}:{transfer.side_channel_port}"
                 if transfer.side_channel_port is not None else ""), flush=True)
    serve_forever(server, sock, args.uvicorn_log_level)


def _transfer_connector(connector: Any) -> Any:
    """The engine's NixlConnector (alone or inside a MultiConnector), or None."""
    from speckv.connectors.nixl.connector import NixlConnector

    for child in getattr(connector, "children", (connector,)):
        if isinstance(child, NixlConnector):
            return child
    return None
    return 0
