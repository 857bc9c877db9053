"""`speckv events tail` and `speckv events publish-sample`: argument parsing and printing.

    speckv events tail            print decoded events live, one line per event
    speckv events publish-sample  publish a synthetic workload's events from the real cache

`speckv.cli` mounts them by name (`add_<name>_arguments` / `run_<name>`) and prints user
errors (`ValueError`; ZeroMQ's errors are turned into one) as one line, exit status 2.
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from collections.abc import Callable
from typing import Any

import zmq

from speckv.commands.hash_seed import add_seed_argument, resolve_seed
from speckv.events.schema import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    HashEncoding,
)
from speckv.events.subscriber import EventSubscriber, SubscriberConfig
from speckv.hashing.functions import HASH_ALGOS

# ---- shared helpers ---------------------------------------------------------------------------


def zmq_errors_as_user_errors(body: Callable[[argparse.Namespace], int]
                              ) -> Callable[[argparse.Namespace], int]:
    """A ZeroMQ failure (a bad or busy endpoint) is the user's to fix: say it in one line."""

    @functools.wraps(body)
    def run(args: argparse.Namespace) -> int:
        try:
            return body(args)
        except zmq.ZMQError as err:
            raise ValueError(f"ZeroMQ: {err}") from None

    return run


def check_endpoint(value: str, what: str) -> str:
    if "://" not in value:
        raise ValueError(f"{what} {value!r} is not a ZeroMQ endpoint (e.g. tcp://127.0.0.1:5557)")
    return value


def short_hash(block_hash: ExternalBlockHash | None) -> str:
    """8 hex digits of a wire hash (bytes: the first 4 bytes; int: the top of the 64 bits)."""
    if block_hash is None:
        return "-"
    if isinstance(block_hash, int):
        return f"{block_hash:016x}"[:8]
    return block_hash[:4].hex()


def format_event(seq: int, event: object) -> str:
    """One line describing one event."""
    if isinstance(event, BlockStored):
        hashes = ",".join(short_hash(h) for h in event.block_hashes)
        parts = [
            f"seq={seq}",
            "BlockStored",
            f"group={event.group_idx}",
            f"blocks={len(event.block_hashes)}x{event.block_size}",
            f"parent={short_hash(event.parent_block_hash)}",
            f"hashes=[{hashes}]",
            f"tokens={len(event.token_ids)}",
        ]
        if event.lookahead_token_ids is not None:
            parts.append(f"lookahead={event.lookahead_token_ids}")
        if event.lora_name is not None:
            parts.append(f"lora={event.lora_name}")
        if event.extra_keys is not None:
            shown = [list(entry) if entry is not None else None for entry in event.extra_keys]
            parts.append(f"extra_keys={_short_extra(shown)}")
        if event.medium is not None:
            parts.append(f"medium={event.medium}")
        return " ".join(parts)
    if isinstance(event, BlockRemoved):
        hashes = ",".join(short_hash(h) for h in event.block_hashes)
        return (
            f"seq={seq} BlockRemoved group={event.group_idx} blocks={len(event.block_hashes)} "
            f"hashes=[{hashes}] medium={event.medium}"
        )
    if isinstance(event, AllBlocksCleared):
        return f"seq={seq} AllBlocksCleared"
    return f"seq={seq} {type(event).__name__}"


def _short_extra(value: Any) -> str:
    if isinstance(value, bytes):
        return value[:4].hex() + ".."
    if isinstance(value, list | tuple):
        return "[" + ",".join(_short_extra(item) for item in value) + "]"
    return repr(value)


# ---- speckv events tail -------------------------------------------------------------------------


def add_tail_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", default="tcp://127.0.0.1:5557", help="the PUB endpoint")
    parser.add_argument("--replay-endpoint", default=None, help="the replay (ROUTER) endpoint")
    parser.add_argument("--topic", default="", help="topic prefix to subscribe to")
    parser.add_argument("--count", type=int, default=None, help="stop after N events")
    parser.add_argument(
        "--timeout", type=float, default=None,
        help="stop after S seconds without a batch (default: run until interrupted)",
    )
    parser.add_argument(
        "--from-seq", type=int, default=0,
        help="replay from this sequence number first (with --replay-endpoint); -1: live only",
    )


@zmq_errors_as_user_errors
def run_tail(args: argparse.Namespace) -> int:
    """Print decoded events live."""
    endpoint = check_endpoint(args.endpoint, "--endpoint")
    replay = args.replay_endpoint
    if replay is not None:
        check_endpoint(replay, "--replay-endpoint")
    if args.count is not None and args.count <= 0:
        raise ValueError(f"--count must be > 0, got {args.count}")
    if args.timeout is not None and args.timeout <= 0:
        raise ValueError(f"--timeout must be > 0, got {args.timeout}")
    start_seq = None if args.from_seq < 0 or replay is None else args.from_seq
    config = SubscriberConfig(
        endpoint=endpoint, replay_endpoint=replay, topic=args.topic, start_seq=start_seq
    )
    printed = 0
    last_batch = time.monotonic()
    with EventSubscriber(config) as subscriber:
        while True:
            for seq, batch in subscriber.poll(0.1):
                last_batch = time.monotonic()
                for event in batch.events:
                    print(format_event(seq, event), flush=True)
                    printed += 1
                    if args.count is not None and printed >= args.count:
                        _print_tail_summary(subscriber, printed)
                        return 0
            if args.timeout is not None and time.monotonic() - last_batch > args.timeout:
                _print_tail_summary(subscriber, printed)
                return 0


def _print_tail_summary(subscriber: EventSubscriber, printed: int) -> None:
    stats = subscriber.stats
    print(
        f"# {printed} events, {stats.received_batches} batches "
        f"({stats.replayed_batches} replayed, {stats.lost_batches} lost, "
        f"{stats.malformed_messages} malformed)",
        file=sys.stderr,
    )


# ---- speckv events publish-sample ---------------------------------------------------------------


def add_publish_sample_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", default="tcp://127.0.0.1:5557", help="PUB endpoint to bind")
    parser.add_argument(
        "--replay-endpoint", default="tcp://127.0.0.1:5558", help="replay endpoint to bind"
    )
    parser.add_argument("--lookahead", type=int, default=1, help="L lookahead tokens (0: legacy)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block")
    parser.add_argument(
        "--num-blocks", type=int, default=24, help="KV cache blocks (small, so it evicts)"
    )
    parser.add_argument("--requests", type=int, default=8, help="requests in the workload")
    parser.add_argument("--algo", default="sha256", choices=sorted(HASH_ALGOS))
    add_seed_argument(parser)
    parser.add_argument(
        "--linger", type=float, default=10.0, help="seconds to keep the sockets up afterwards"
    )
    parser.add_argument(
        "--delay", type=float, default=0.5,
        help="seconds to wait before publishing, so subscribers can connect",
    )
    parser.add_argument("--int-hashes", action="store_true", help="send 64-bit int hashes")


@zmq_errors_as_user_errors
def run_publish_sample(args: argparse.Namespace) -> int:
    """Publish a synthetic workload's events and keep the sockets up."""
    from speckv.events.publisher import PublisherConfig, ZmqEventPublisher
    from speckv.simulation.event_sample import (
        SAMPLE_LORA,
        SampleEngine,
        SampleEngineConfig,
        run_sample_workload,
    )

    check_endpoint(args.endpoint, "--endpoint")
    check_endpoint(args.replay_endpoint, "--replay-endpoint")
    for name in ("linger", "delay"):
        if getattr(args, name) < 0:
            raise ValueError(f"--{name} must be >= 0, got {getattr(args, name)}")
    if args.requests <= 0:
        raise ValueError(f"--requests must be > 0, got {args.requests}")
    seed = resolve_seed(args.seed)
    try:
        engine = SampleEngine(
            SampleEngineConfig(
                block_size=args.block_size, lookahead_tokens=args.lookahead,
                num_blocks=args.num_blocks, algo=args.algo, seed=seed,
            )
        )
    except ValueError as err:
        raise ValueError(str(err)) from None
    encoding = HashEncoding.INT if args.int_hashes else HashEncoding.BYTES
    config = PublisherConfig(
        endpoint=args.endpoint, replay_endpoint=args.replay_endpoint, hash_encoding=encoding
    )
    with ZmqEventPublisher(config) as publisher:
        print(
            f"publishing on {args.endpoint} (replay {args.replay_endpoint}): algo={args.algo} "
            f"seed={seed!r} block_size={args.block_size} L={args.lookahead} "
            f"lora {SAMPLE_LORA.name}={SAMPLE_LORA.path}",
            flush=True,
        )
        time.sleep(args.delay)
        try:
            summary = run_sample_workload(engine, publisher.publish, num_requests=args.requests)
        except RuntimeError as err:
            raise ValueError(f"{err}; raise --num-blocks") from None
        publisher.wait_sent(5.0)
        stats = publisher.stats
        print(
            f"{summary.num_requests} requests, {summary.num_steps} steps, "
            f"{stats.sent_batches} batches sent (seq 0..{stats.next_seq - 1}); "
            f"lingering {args.linger:g} s",
            flush=True,
        )
        time.sleep(args.linger)
    return 0
