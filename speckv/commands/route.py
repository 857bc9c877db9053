"""`speckv route`: the KV-aware router as a small HTTP service (arguments and start-up).

Subscribes to every engine's KV events, recomputes each published block hash
(`speckv.router.index`) and serves `POST /route` and `GET /stats` (`speckv.router.service`).
User errors are `ValueError`s, printed by `speckv.cli` as one line, exit status 2.
"""

from __future__ import annotations

import argparse
from typing import Any

from speckv.commands.events import check_endpoint, zmq_errors_as_user_errors
from speckv.commands.hash_seed import add_seed_argument, resolve_seed
from speckv.events.endpoints import port_is_free
from speckv.hashing.functions import HASH_ALGOS
from speckv.router.index import EngineHashConfig


def add_route_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--engines", nargs="+", required=True, metavar="NAME=PUB[,REPLAY]",
        help="engines to index, e.g. a=tcp://10.0.0.1:5557,tcp://10.0.0.1:5558",
    )
    parser.add_argument("--block-size", type=int, required=True, help="the engines' block size")
    parser.add_argument("--lookahead", type=int, default=0, help="the engines' L")
    parser.add_argument("--algo", default="sha256", choices=sorted(HASH_ALGOS))
    add_seed_argument(parser)
    parser.add_argument(
        "--lora", action="append", default=[], metavar="NAME=PATH",
        help="a LoRA adapter's path, needed to reproduce its hashes (repeatable)",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8100)
    parser.add_argument("--no-verify", action="store_true", help="skip recomputing hashes")


def parse_engine_specs(specs: list[str]) -> dict[str, tuple[str, str | None]]:
    """`name=pub[,replay]` strings as {name: (pub, replay)}; ValueError when malformed."""
    engines: dict[str, tuple[str, str | None]] = {}
    for spec in specs:
        name, sep, rest = spec.partition("=")
        if not sep or not name or not rest:
            raise ValueError(f"--engines entry {spec!r} is not NAME=PUB[,REPLAY]")
        if name in engines:
            raise ValueError(f"engine {name!r} is given twice")
        endpoints = rest.split(",")
        if len(endpoints) > 2:
            raise ValueError(f"--engines entry {spec!r} has more than two endpoints")
        pub = check_endpoint(endpoints[0], f"engine {name!r} endpoint")
        replay = None
        if len(endpoints) == 2:
            replay = check_endpoint(endpoints[1], f"engine {name!r} replay endpoint")
        engines[name] = (pub, replay)
    return engines


def _parse_lora(entries: list[str]) -> dict[str, str]:
    paths: dict[str, str] = {}
    for entry in entries:
        name, sep, path = entry.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora entry {entry!r} is not NAME=PATH")
        paths[name] = path
    return paths


def build_router_service(args: argparse.Namespace) -> Any:
    """The (not yet started) `RouterService` the arguments describe; ValueError if invalid."""
    from speckv.router.service import RouterService, engine_endpoints

    engines = parse_engine_specs(args.engines)
    seed = resolve_seed(args.seed)
    try:
        hashing = EngineHashConfig(
            algo=args.algo, seed=seed, block_size=args.block_size,
            lookahead_tokens=args.lookahead, lora_paths=_parse_lora(args.lora),
            verify=not args.no_verify,
        )
    except ValueError as err:
        raise ValueError(str(err)) from None
    return RouterService(engine_endpoints(engines, hashing))


@zmq_errors_as_user_errors
def run_route(args: argparse.Namespace) -> int:
    """Run the router: subscribe to every engine, serve POST /route and GET /stats."""
    import uvicorn

    from speckv.router.service import make_app

    if not 0 < args.port < 65536:
        raise ValueError(f"--port must be in 1..65535, got {args.port}")
    service = build_router_service(args)
    if not port_is_free(args.host, args.port):
        raise ValueError(f"cannot listen on {args.host}:{args.port} (in use or not local)")
    service.start()
    try:
        uvicorn.run(make_app(service), host=args.host, port=args.port, log_level="warning")
    finally:
        service.stop()
    return 0
