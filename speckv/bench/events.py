"""`speckv bench events`: what KV events cost.

Owns three measurements, printed as a rich table (or JSON with `--json`):

1. publisher: batches/s (one 32-block BlockStored each) that `ZmqEventPublisher` converts,
   encodes and sends on a loopback PUB socket with a subscriber connected, from the first
   `publish` until the last batch is on the socket;
2. router: BlockStored events/s that `RouterIndex` indexes, with and without recomputing
   every hash (verification), for the same 32-block events decoded from the wire;
3. engine overhead: the sample cache-manager workload (`CacheSimulator`, lookahead L) run with
   events off (no sink), records only (sink, nothing published) and on (sink + `publish` per
   step), interleaved in the same process; the ratio is on / off wall time (best of repeats).
   The publisher's sender thread shares the GIL with the engine, so its encoding shows here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import sys
import time
from collections.abc import Sequence
from typing import Any

from speckv.cache import events as records
from speckv.events.endpoints import loopback_endpoint
from speckv.events.publisher import PublisherConfig, ZmqEventPublisher
from speckv.events.schema import decode_batch, encode_batch, to_wire_batch
from speckv.events.subscriber import EventSubscriber, SubscriberConfig
from speckv.hashing.formats import format_for
from speckv.hashing.functions import get_hash_algo, make_none_hash
from speckv.hashing.request_hasher import hash_prompt
from speckv.router.index import EngineHashConfig, RouterIndex
from speckv.simulation.event_sample import SampleEngine, SampleEngineConfig, run_sample_workload

BLOCKS_PER_EVENT = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", type=int, default=20_000, help="publisher batches")
    parser.add_argument("--router-events", type=int, default=2_000, help="events to index")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--lookahead", type=int, default=1)
    parser.add_argument("--algo", default="sha256")
    parser.add_argument("--workload-requests", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3, help="overhead runs per mode")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def make_stored_records(
    num_events: int, block_size: int, lookahead: int, algo_name: str, seed: str = "0"
) -> list[records.BlockStored]:
    """`num_events` BlockStored records of 32 blocks each, with real hashes. Pure."""
    algo = get_hash_algo(algo_name)
    none_hash = make_none_hash(algo, seed)
    rng = random.Random(0)
    out = []
    for _ in range(num_events):
        num_tokens = BLOCKS_PER_EVENT * block_size + lookahead
        tokens = [rng.randrange(1, 30_000) for _ in range(num_tokens)]
        hashes = hash_prompt(algo, none_hash, block_size, format_for(lookahead), tokens)
        body = tokens[: BLOCKS_PER_EVENT * block_size]
        out.append(
            records.BlockStored(
                block_hashes=hashes, parent_block_hash=None, token_ids=body,
                block_size=block_size, lora_name=None, extra_keys=None, group_idx=0,
                lookahead_token_ids=(
                    [tokens[(i + 1) * block_size : (i + 1) * block_size + lookahead]
                     for i in range(BLOCKS_PER_EVENT)] if lookahead else None
                ),
            )
        )
    return out


def bench_publisher(stored: Sequence[records.BlockStored], num_batches: int) -> dict[str, Any]:
    config = PublisherConfig(
        endpoint=loopback_endpoint(), replay_endpoint=loopback_endpoint(),
        max_queue_size=num_batches + 1, buffer_steps=10_000, hwm=num_batches + 1,
    )
    subscriber_config = SubscriberConfig(endpoint=config.endpoint, start_seq=None)
    with ZmqEventPublisher(config) as publisher, EventSubscriber(subscriber_config) as subscriber:
        time.sleep(0.3)  # let the subscription reach the publisher
        start = time.perf_counter()
        for index in range(num_batches):
            publisher.publish([stored[index % len(stored)]])
        publish_s = time.perf_counter() - start
        publisher.wait_sent(120.0)
        sent_s = time.perf_counter() - start
        received = 0
        deadline = time.monotonic() + 5.0
        while received < num_batches and time.monotonic() < deadline:
            received += len(subscriber.poll(0.2))
        stats = publisher.stats
    return {
        "batches": num_batches,
        "blocks_per_batch": BLOCKS_PER_EVENT,
        "publish_call_us": publish_s / num_batches * 1e6,
        "sent_batches_per_s": stats.sent_batches / sent_s,
        "received_batches": received,
        "dropped_batches": stats.dropped_batches,
    }


def bench_router(stored: Sequence[records.BlockStored], hashing: EngineHashConfig) -> dict:
    payloads = [encode_batch(to_wire_batch([record])) for record in stored]
    batches = [decode_batch(payload) for payload in payloads]
    out: dict[str, Any] = {"events": len(batches)}
    for verify in (False, True):
        index = RouterIndex({"e": dataclasses.replace(hashing, verify=verify)})
        start = time.perf_counter()
        for seq, batch in enumerate(batches):
            index.apply_batch("e", batch, seq)
        elapsed = time.perf_counter() - start
        state = index.state["e"]
        key = "verified" if verify else "unverified"
        out[f"{key}_events_per_s"] = len(batches) / elapsed
        if verify:
            out["mismatched_blocks"] = state.mismatched_blocks
            out["verified_blocks"] = state.verified_blocks
    start = time.perf_counter()
    for payload in payloads:
        decode_batch(payload)
    out["decode_events_per_s"] = len(payloads) / (time.perf_counter() - start)
    return out


def bench_overhead(args: argparse.Namespace) -> dict[str, Any]:
    config = PublisherConfig(endpoint=loopback_endpoint(), replay_endpoint=loopback_endpoint())
    times: dict[str, list[float]] = {"off": [], "sink": [], "on": []}
    steps = 0
    with ZmqEventPublisher(config) as publisher:
        for _ in range(args.repeats):
            for mode in ("off", "sink", "on"):
                engine = SampleEngine(
                    SampleEngineConfig(
                        block_size=args.block_size, lookahead_tokens=args.lookahead,
                        num_blocks=256, algo=args.algo, events=mode != "off",
                    )
                )
                # "sink": the pool records events but nobody publishes them
                publish = publisher.publish if mode == "on" else (lambda events: None)
                start = time.perf_counter()
                summary = run_sample_workload(
                    engine, publish, num_requests=args.workload_requests
                )
                times[mode].append(time.perf_counter() - start)
                steps = summary.num_steps
        publisher.wait_sent(10.0)
        sent = publisher.stats.sent_batches
    off, sink, on = min(times["off"]), min(times["sink"]), min(times["on"])
    return {
        "steps_per_run": steps,
        "off_ms": off * 1e3,
        "sink_only_ms": sink * 1e3,
        "on_ms": on * 1e3,
        "ratio_sink_off": sink / off,
        "ratio_on_off": on / off,
        "batches_sent": sent,
    }


def run(args: argparse.Namespace) -> int:
    for name in ("batches", "router_events", "repeats", "workload_requests", "block_size"):
        if getattr(args, name) <= 0:
            print(f"error: --{name.replace('_', '-')} must be > 0", file=sys.stderr)
            return 2
    try:
        hashing = EngineHashConfig(
            algo=args.algo, block_size=args.block_size, lookahead_tokens=args.lookahead
        )
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    stored = make_stored_records(
        args.router_events, args.block_size, args.lookahead, args.algo
    )
    results = {
        "config": {"block_size": args.block_size, "lookahead": args.lookahead,
                   "algo": args.algo, "blocks_per_event": BLOCKS_PER_EVENT},
        "publisher": bench_publisher(stored, args.batches),
        "router": bench_router(stored, hashing),
        "overhead": bench_overhead(args),
    }
    if args.json:
        print(json.dumps(results, indent=2))
    else:
        _print_table(results)
    return 0


def _print_table(results: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    cfg = results["config"]
    pub, router, over = results["publisher"], results["router"], results["overhead"]
    table = Table(
        title=f"KV events: {cfg['blocks_per_event']}-block BlockStored, B={cfg['block_size']}, "
        f"L={cfg['lookahead']}, {cfg['algo']}"
    )
    table.add_column("measurement")
    table.add_column("value", justify="right")
    table.add_row("publisher: sent batches/s", f"{pub['sent_batches_per_s']:,.0f}")
    table.add_row("publisher: publish() call, µs", f"{pub['publish_call_us']:.2f}")
    table.add_row(
        "publisher: received / sent / dropped",
        f"{pub['received_batches']} / {pub['batches']} / {pub['dropped_batches']}",
    )
    table.add_row("router: decode events/s", f"{router['decode_events_per_s']:,.0f}")
    table.add_row("router: index events/s (no verify)", f"{router['unverified_events_per_s']:,.0f}")
    table.add_row("router: index events/s (verify)", f"{router['verified_events_per_s']:,.0f}")
    table.add_row("router: mismatched blocks", str(router["mismatched_blocks"]))
    table.add_row(
        f"engine workload ({over['steps_per_run']} steps): events off, ms", f"{over['off_ms']:.1f}"
    )
    table.add_row("engine workload: records only (no publish), ms", f"{over['sink_only_ms']:.1f}")
    table.add_row("engine workload: events on (publish), ms", f"{over['on_ms']:.1f}")
    table.add_row("engine workload: on / off", f"{over['ratio_on_off']:.3f}")
    Console().print(table)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m speckv.bench.events")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
