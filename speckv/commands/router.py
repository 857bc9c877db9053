"""`speckv router`: a KV-aware OpenAI front for several `speckv serve` or vLLM engines
(arguments and start-up; the router itself is `speckv.router`; vLLM engines are described by
the `--vllm-*` flags, `speckv.router.vllm_engine`).

Reads each engine's cache contract by URL (refusing, with the field named, one it cannot
reproduce), loads the engines' tokenizer, subscribes to their KV events and serves the OpenAI
endpoints on one port. User errors are `ValueError`s, printed by `speckv.cli` as one line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
from dataclasses import replace
from urllib.parse import urlsplit

from speckv.router.policy import POLICIES, ScoringConfig
from speckv.server.cli import parse_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", action="append", default=[], metavar="NAME=URL",
                        help="an engine, e.g. a=http://10.0.0.1:8000 (repeat per engine)")
    parser.add_argument("--prefill", action="append", default=[], metavar="[NAME=]URL",
                        help="prefill/decode mode: a prefill engine (speckv serve "
                        "--kv-transfer-config with kv_role kv_producer or kv_both); repeat")
    parser.add_argument("--decode", action="append", default=[], metavar="[NAME=]URL",
                        help="prefill/decode mode: a decode engine (kv_role kv_consumer or "
                        "kv_both); repeat")
    parser.add_argument("--engine-api-key", action="append", default=[],
                        metavar="NAME=KEY|KEY",
                        help="the key sent to engine NAME (KEY alone: to every engine)")
    parser.add_argument("--vllm-kv-events-config", action="append", default=[],
                        metavar="[NAME=]JSON",
                        help="a vLLM engine's --kv-events-config, as it was started with "
                        "(its event endpoints); NAME= marks engine NAME as vLLM's, without "
                        "it the value holds for every vLLM engine")
    parser.add_argument("--vllm-hash-seed", action="append", default=[], metavar="[NAME=]SEED",
                        help="the PYTHONHASHSEED a vLLM engine was started with (default: "
                        "vLLM's own seed for sha256, vllm-none-hash)")
    parser.add_argument("--vllm-speculative-config", action="append", default=[],
                        metavar="[NAME=]JSON",
                        help="a vLLM engine's --speculative-config (an EAGLE-family method "
                        "drops the last matched block)")
    parser.add_argument("--vllm-lookahead-tokens", action="append", default=[],
                        metavar="[NAME=]L",
                        help="a vLLM engine runs speckv's vLLM plugin: lookahead hashes with "
                        "L successor tokens, no last-block drop")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8080)
    parser.add_argument("--policy", choices=POLICIES, default="kv")
    parser.add_argument("--api-key", default=os.environ.get("SPECKV_ROUTER_API_KEY"),
                        help="require 'Authorization: Bearer KEY' from clients (default: "
                        "$SPECKV_ROUTER_API_KEY)")
    parser.add_argument("--tokenizer", default=None, metavar="MODEL",
                        help="where to read the engines' tokenizer (default: the model the "
                        "engines name in their contract)")
    defaults = ScoringConfig()
    parser.add_argument("--prefill-load-scale", type=float,
                        default=defaults.prefill_load_scale,
                        help="cost of one uncached prompt token")
    parser.add_argument("--request-load-tokens", type=float,
                        default=defaults.request_load_tokens,
                        help="cost of one running or waiting request, in prompt tokens")
    parser.add_argument("--kv-usage-tokens", type=float, default=defaults.kv_usage_tokens,
                        help="cost of a full KV cache, in prompt tokens")
    parser.add_argument("--max-imbalance", type=int, default=defaults.max_imbalance,
                        help="requests above the least-loaded engine before a cached prefix "
                        "spills to another engine")
    parser.add_argument("--pending-ttl", type=float, default=1.0,
                        help="a routed prompt's blocks count as cached on its engine while "
                        "the request is in flight and this many seconds after, until their "
                        "KV events arrive")
    parser.add_argument("--stale-after", type=float, default=10.0,
                        help="seconds an engine may fail its health checks before its index "
                        "entries expire")
    parser.add_argument("--health-interval", type=float, default=0.5,
                        help="seconds between health / contract / load polls")
    parser.add_argument("--max-request-body-bytes", type=parse_size, default="8M",
                        help="larger bodies get 413")
    parser.add_argument("--max-inflight-requests", type=int, default=1024,
                        help="requests in flight before new ones get 503 + Retry-After")
    parser.add_argument("--uvicorn-log-level", default="warning",
                        choices=("critical", "error", "warning", "info", "debug", "trace"))


def parse_engines(entries: list[str], keys: list[str]) -> list:
    """`NAME=URL` entries and `NAME=KEY` / `KEY` keys as `EngineSpec`s; ValueError if bad."""
    from speckv.router.fleet import EngineSpec

    urls: dict[str, str] = {}
    for entry in entries:
        name, sep, url = entry.partition("=")
        if not sep or not name or not url:
            raise ValueError(f"--engine {entry!r} is not NAME=URL")
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.port is None:
            raise ValueError(f"--engine {entry!r}: the URL must be http://HOST:PORT")
        if name in urls:
            raise ValueError(f"--engine {name!r} is given twice")
        urls[name] = url.rstrip("/")
    api_keys: dict[str, str] = {}
    for entry in keys:
        name, sep, key = entry.partition("=")
        if sep and name in urls:
            api_keys[name] = key
        elif sep:
            raise ValueError(f"--engine-api-key {name}=...: no --engine named {name!r}")
        else:
            api_keys = {engine: entry for engine in urls} | api_keys
    return [EngineSpec(name, url, api_keys.get(name)) for name, url in urls.items()]


_VLLM_FLAGS = (("--vllm-kv-events-config", "kv_events_config"), ("--vllm-hash-seed", "hash_seed"),
               ("--vllm-speculative-config", "speculative_config"),
               ("--vllm-lookahead-tokens", "lookahead_tokens"))


def _vllm_value(flag: str, text: str) -> object:
    if flag.endswith("-config"):
        try:
            value = json.loads(text)
        except ValueError as error:
            raise ValueError(f"{flag} {text!r}: not JSON ({error})") from None
        if not isinstance(value, dict):
            raise ValueError(f"{flag} {text!r}: expected a JSON object")
        return value
    if flag == "--vllm-lookahead-tokens":
        if not text.isdigit():
            raise ValueError(f"{flag} {text!r}: expected an integer L >= 0")
        return int(text)
    return text


def with_vllm_flags(specs: list, args: argparse.Namespace) -> list:
    """The engines with what the --vllm-* flags say of them: `vllm` for those a flag names
    (they are vLLM engines), `vllm_default` from the unnamed values. ValueError if bad."""
    from speckv.router.vllm_engine import VLLMFlags

    names = {spec.name for spec in specs}
    named: dict[str, dict[str, object]] = {}
    default: dict[str, object] = {}
    for flag, field in _VLLM_FLAGS:
        for entry in getattr(args, flag[2:].replace("-", "_")):
            name, sep, value = entry.partition("=")
            if not sep or entry.lstrip().startswith("{"):
                default[field] = _vllm_value(flag, entry)
                continue
            if name not in names:
                raise ValueError(f"{flag} {name}=...: no --engine named {name!r}")
            named.setdefault(name, {})[field] = _vllm_value(flag, value)
    out = []
    for spec in specs:
        values = named.get(spec.name)
        out.append(replace(
            spec, vllm=VLLMFlags(**{**default, **values}) if values is not None else None,
            vllm_default=VLLMFlags(**default) if default else None))
    return out


def build_pd_router(args: argparse.Namespace):
    """The P/D proxy of `--prefill URL --decode URL` (ValueError if the URLs are bad)."""
    from speckv.router.pd import PDConfig, PDRouter, build_pd_app

    if args.engine:
        raise ValueError("--engine and --prefill / --decode are two modes: use one")
    urls, names = [], []
    for flag, values in (("--prefill", args.prefill), ("--decode", args.decode)):
        checked, named = [], []
        for index, entry in enumerate(values):
            name, sep, url = entry.partition("=")
            if not sep:  # a bare URL: prefill0, decode1, ...
                name, url = f"{flag[2:]}{index}", entry
            parts = urlsplit(url)
            if not name or parts.scheme not in ("http", "https") or not parts.hostname \
                    or parts.port is None:
                raise ValueError(f"{flag} {entry!r}: expected [NAME=]http://HOST:PORT")
            checked.append(url.rstrip("/"))
            named.append(name)
        urls.append(tuple(checked))
        names.append(tuple(named))
    key = next((k for k in args.engine_api_key if "=" not in k), None)
    config = PDConfig(urls[0], urls[1], names[0], names[1], api_key=args.api_key,
                      engine_api_key=key, max_request_body_bytes=args.max_request_body_bytes)
    return build_pd_app(PDRouter(config))


def build_router(args: argparse.Namespace):
    from speckv.router.app import Router, RouterConfig
    from speckv.router.engine_probe import fetch_contracts
    from speckv.router.fleet import Fleet, FleetConfig
    from speckv.router.policy import Policy
    from speckv.router.tokenizer import TokenizerCache

    scoring = ScoringConfig(args.prefill_load_scale, args.request_load_tokens,
                            args.kv_usage_tokens, args.max_imbalance)
    config = RouterConfig(api_key=args.api_key,
                          max_request_body_bytes=args.max_request_body_bytes,
                          max_inflight_requests=args.max_inflight_requests,
                          health_interval_s=args.health_interval)
    fleet_config = FleetConfig(stale_after_s=args.stale_after, pending_ttl_s=args.pending_ttl)
    policy = Policy(args.policy, scoring)
    links = fetch_contracts(with_vllm_flags(parse_engines(args.engine, args.engine_api_key),
                                            args))
    fleet = Fleet(links, TokenizerCache(args.tokenizer), fleet_config)
    return Router(fleet, policy, config)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from speckv.server.launch import bind_socket

    sock = bind_socket(args.host, args.port)  # a busy port fails before anything else
    logging.basicConfig(level=logging.WARNING, format="speckv router: %(message)s")
    try:
        if args.prefill or args.decode:
            app = build_pd_router(args)
            print(f"speckv router: prefill/decode mode, prefill {', '.join(args.prefill)}, "
                  f"decode {', '.join(args.decode)}, on http://{args.host}:{args.port}",
                  flush=True)
            config = uvicorn.Config(app, log_level=args.uvicorn_log_level, lifespan="on",
                                    timeout_graceful_shutdown=5)
            with contextlib.suppress(KeyboardInterrupt):
                uvicorn.Server(config).run(sockets=[sock])
            return 0
        if not args.engine:
            raise ValueError("speckv router needs --engine NAME=URL (KV-aware routing) or "
                             "--prefill URL --decode URL (prefill/decode disaggregation)")
        router = build_router(args)
        for name, link in router.fleet.links.items():
            c = link.contract
            if c is None:
                print(f"speckv router: engine {name} {link.spec.url}: does not answer yet; "
                      "it joins when its health passes", flush=True)
                continue
            print(f"speckv router: engine {name} {link.spec.url}: {c.served_model_name}, "
                  f"{c.hash_mode_label} block hashes, blocks of {c.hashing.block_size}, "
                  f"events {c.events_endpoint}", flush=True)
        print(f"speckv router: {args.policy} policy on http://{args.host}:{args.port}",
              flush=True)
        config = uvicorn.Config(router.app, log_level=args.uvicorn_log_level, lifespan="on",
                                timeout_graceful_shutdown=5)
        with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises the SIGINT
            uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
    return 0
