"""The engine's command-line flags, once for every command that builds an engine (`speckv
generate`, `speckv serve`, `speckv bench serve`), with `vllm serve`'s names where vLLM has them.

Owns `add_engine_arguments(parser)` (the flags), `engine_args_from_cli(args)` (flags ->
`EngineArgs`: the speculation choice of `speculation_choice.py`, the connector flags parsed
into one `ConnectorConfig`), and `engine_flags(args)` (flags -> a command line that parses
back to the same `EngineArgs`, for `bench serve` to launch a server with its engine).
"""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

from speckv.connectors.config import (
    add_connector_arguments,
    connector_config_from_args,
    connector_flags,
)
from speckv.connectors.transfer_config import KVTransferConfig, transfer_connectors_help
from speckv.engine.config import MAX_NUM_SPEC_TOKENS, SPECULATIVE_METHODS
from speckv.engine.engine_args import EngineArgs
from speckv.engine.speculation_choice import (
    NO_SPECULATION,
    SpeculationChoice,
    choose_speculation,
)

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
SPECULATIVE_METHOD_WORDS: tuple[str, ...] = (NO_SPECULATION, *SPECULATIVE_METHODS)


def parse_size(text: str) -> int:
    """Bytes from '536870912', '512M', '512MiB', '2G' (powers of 1024, as vLLM reads them)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size in bytes: {text!r} (e.g. 512M, 2G)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * 1024 ** " kmgt".index(unit or " "))


def json_object(text: str) -> dict[str, Any]:
    """An argparse type: a JSON object, or a one-line error saying why the text is not one."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"not JSON ({error}): {text[:80]!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {text[:80]!r}")
    return value


def add_engine_arguments(parser: argparse.ArgumentParser, *, seed_flag: bool = True) -> None:
    """The engine flags. `seed_flag=False`: the command's own `--seed` means something else
    (`speckv generate`: the request's sampling seed), so the engine's base seed stays 0."""
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
    if seed_flag:
        engine.add_argument("--seed", dest="engine_seed", type=int, default=0,
                            help="base of per-request seeds")
    else:
        parser.set_defaults(engine_seed=0)
    _add_speculation_arguments(engine)
    engine.add_argument("--disable-lookahead-block-hashes", action="store_true",
                        help="legacy block hashes and the last-block drop")
    engine.add_argument("--disable-divergent-block-reuse", action="store_true",
                        help="recompute a block whose cached copy names another successor "
                        "instead of copying it and recomputing its last position(s)")
    engine.add_argument("--kv-events-endpoint", default=None,
                        help="publish KV events on this ZeroMQ PUB endpoint (tcp://*:5557)")
    engine.add_argument("--kv-events-replay-endpoint", default=None,
                        help="answer replay requests on this ZeroMQ ROUTER endpoint")
    engine.add_argument("--threads", type=int, default=None,
                        help="CPU compute threads (default: torch's choice, its physical "
                        "cores; speckv serve: one fewer, leaving a core to the HTTP server "
                        "as vLLM does)")
    engine.add_argument("--prefill-threads", type=int, default=None,
                        help="CPU compute threads of steps longer than speckv's one-thread "
                        "kernels take, prefill chunks (default: --threads; speckv serve: "
                        "every core, the server's too)")
    engine.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                        help="a KV transfer connector, vLLM's KVTransferConfig JSON: "
                             '{"kv_connector": NAME, "kv_role": "kv_producer" | "kv_consumer" '
                             '| "kv_both", "kv_load_failure_policy": ..., '
                             '"kv_connector_extra_config": {...}}; NAME: '
                             + transfer_connectors_help())
    add_connector_arguments(parser)


def _add_speculation_arguments(group: Any) -> None:
    group.add_argument("--speculative-method", "--drafter", dest="speculative_method",
                       choices=SPECULATIVE_METHOD_WORDS, default=None,
                       help="speculative decoding (default: eagle3 with the built-in head on "
                       "the built-in model where its recorded benchmark is faster, else none)")
    group.add_argument("--speculative-model", "--draft-model", dest="speculative_model",
                       default=None,
                       help="drafter dir (EAGLE / EAGLE3 / MTP) or 'builtin' (the built-in "
                       "model's EAGLE3 head); --draft-model is a deprecated alias")
    group.add_argument("--num-spec-tokens", type=int, default=3,
                       help=f"most drafts per step, 1..{MAX_NUM_SPEC_TOKENS} (the engine "
                       "drafts fewer or none when that is faster)")
    group.add_argument("--no-adaptive-speculation", action="store_true",
                       help="always draft --num-spec-tokens tokens")
    group.add_argument("--speculative-config", type=json_object, default=None,
                       help='vLLM style, e.g. \'{"method": "eagle", "model": "DIR", '
                       '"num_speculative_tokens": 3}\' (overrides --speculative-method and '
                       'friends)')


def speculative_kwargs(model: str, method: str | None, speculative_model: str | None,
                       num_spec_tokens: int, speculative_config: dict[str, Any] | None
                       ) -> dict[str, Any]:
    """`EngineArgs` speculative fields from the flags ({}: no speculation)."""
    choice, num_spec_tokens = speculation_choice(model, method, speculative_model,
                                                 num_spec_tokens, speculative_config)
    if choice.method is None:
        return {}
    return {"speculative_method": choice.method, "num_spec_tokens": num_spec_tokens,
            "speculative_model": choice.speculative_model}


def speculation_choice(model: str, method: str | None, speculative_model: str | None,
                       num_spec_tokens: int, speculative_config: dict[str, Any] | None
                       ) -> tuple[SpeculationChoice, int]:
    """Which drafter the flags choose (`--speculative-config` over the single flags), with
    its draft count; nothing is loaded."""
    if speculative_config is not None:
        if not isinstance(speculative_config, dict) or "method" not in speculative_config:
            raise ValueError('--speculative-config needs a JSON object with "method"')
        unknown = set(speculative_config) - {"method", "model", "num_speculative_tokens"}
        if unknown:
            raise ValueError(f"--speculative-config: unsupported keys {sorted(unknown)}")
        method = str(speculative_config["method"])
        speculative_model = speculative_config.get("model")
        num_spec_tokens = int(speculative_config.get("num_speculative_tokens", num_spec_tokens))
        if method not in SPECULATIVE_METHOD_WORDS:
            raise ValueError(f"--speculative-config method must be one of "
                             f"{SPECULATIVE_METHOD_WORDS}")
    return choose_speculation(model, method, speculative_model, num_spec_tokens), \
        num_spec_tokens


def engine_args_from_cli(args: argparse.Namespace) -> EngineArgs:
    """The `EngineArgs` the flags describe (ValueError in flag words before any loading)."""
    speculative = speculative_kwargs(args.model, args.speculative_method, args.speculative_model,
                                     args.num_spec_tokens, args.speculative_config)
    if args.kv_transfer_config is not None:  # its errors too come before the model loads
        KVTransferConfig.parse(args.kv_transfer_config)
    optional: dict[str, Any] = {}
    if args.kv_cache_memory_bytes is not None:
        optional["kv_cache_memory_bytes"] = args.kv_cache_memory_bytes
    return EngineArgs(
        dtype=args.dtype, device=args.device, block_size=args.block_size,
        num_blocks=args.num_gpu_blocks_override, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        enable_prefix_caching=args.enable_prefix_caching,
        hash_algo=args.prefix_caching_hash_algo, hash_seed=args.hash_seed,
        seed=args.engine_seed,
        disable_lookahead_block_hashes=args.disable_lookahead_block_hashes,
        disable_divergent_block_reuse=args.disable_divergent_block_reuse,
        adaptive_speculation=not args.no_adaptive_speculation,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_replay_endpoint=args.kv_events_replay_endpoint,
        kv_connector_config=connector_config_from_args(args),
        kv_load_failure_policy=args.kv_load_failure_policy,
        kv_transfer_config=args.kv_transfer_config,
        kv_transfer_host=getattr(args, "host", None) or "127.0.0.1",
        threads=args.threads, prefill_threads=args.prefill_threads,
        **optional, **speculative)


def engine_flags(args: argparse.Namespace) -> list[str]:
    """The engine flags as a command line (MODEL first) that parses to the same engine."""
    flags = [args.model, "--dtype", args.dtype, "--device", args.device,
             "--block-size", str(args.block_size), "--max-num-seqs", str(args.max_num_seqs),
             "--max-num-batched-tokens", str(args.max_num_batched_tokens),
             "--prefix-caching-hash-algo", args.prefix_caching_hash_algo,
             "--seed", str(args.engine_seed), "--num-spec-tokens", str(args.num_spec_tokens)]
    optional = {"--kv-cache-memory-bytes": args.kv_cache_memory_bytes,
                "--num-gpu-blocks-override": args.num_gpu_blocks_override,
                "--max-model-len": args.max_model_len,
                "--speculative-method": args.speculative_method,
                "--speculative-model": args.speculative_model, "--threads": args.threads,
                "--prefill-threads": args.prefill_threads,
                "--kv-events-endpoint": args.kv_events_endpoint,
                "--kv-events-replay-endpoint": args.kv_events_replay_endpoint,
                "--hash-seed": args.hash_seed, "--kv-connector": args.kv_connector,
                "--kv-transfer-config": args.kv_transfer_config,
                "--kv-load-failure-policy": args.kv_load_failure_policy}
    if args.kv_connector is not None:
        flags += connector_flags(args)
    for flag, value in optional.items():
        if value is not None:
            flags += [flag, str(value)]
    if args.speculative_config is not None:
        flags += ["--speculative-config", json.dumps(args.speculative_config)]
    switches = {"--no-enable-prefix-caching": not args.enable_prefix_caching,
                "--disable-lookahead-block-hashes": args.disable_lookahead_block_hashes,
                "--disable-divergent-block-reuse": args.disable_divergent_block_reuse,
                "--no-adaptive-speculation": args.no_adaptive_speculation}
    return flags + [flag for flag, on in switches.items() if on]
