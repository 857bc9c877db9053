"""`speckv bench kv-store`: the store tier's load speed beside raw redis-py reads of the same bytes.

One prompt (`--prompt-tokens`, whole blocks) of the built-in model's KV layout (SmolLM2-135M:
30 layers, 3 KV heads, head size 64, plus a one-layer EAGLE drafter) is stored through the
`StoreConnector` into a Valkey server on loopback (the embedded one, or `--url`), then loaded
into fresh device blocks as the engine does before a forward (`start_load_kv`: one MGET per
batch, every value checked, copied into the paged caches). Beside it, on the same server and
the same keys: a redis-py loop of one `GET` per block (the limit the issue names), and one
`MGET` per batch without decoding (the wire alone). Medians of `--repeats`, GB/s of KV bytes.

Run: `python3 -m speckv.bench.kv_store` (or `speckv bench kv-store` once mounted in cli.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import redis
import torch
from rich.console import Console
from rich.table import Table

from speckv.bench.tier_harness import (
    assert_loaded,
    bench_kv,
    store_prompt,
    timed_load,
)
from speckv.connectors import ConnectorMode, StoreConnector
from speckv.connectors.embedded_valkey import GIB, EmbeddedValkey
from speckv.connectors.redis_store import DEFAULT_BATCH_BLOCKS, block_key
from speckv.connectors.rules import describe_block


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure(url: str, dtype: str, prompt_tokens: int, block_size: int, batch_blocks: int,
            repeats: int, device: torch.device) -> dict:
    num_blocks = prompt_tokens // block_size
    kv = bench_kv(num_blocks, block_size, dtype, device)
    connector = StoreConnector(url, model_fingerprint=f"bench-kv-store-{time.time_ns()}",
                               hash_algo="sha256", hash_seed="0", batch_blocks=batch_blocks,
                               max_pending_blocks=num_blocks, timeout_s=30.0)
    mode = ConnectorMode(1, False, block_size)
    connector.initialize(kv, mode)
    client = redis.Redis.from_url(url)
    try:
        stored = store_prompt(connector, prompt_tokens, block_size, device)
        assert connector.stats()["store"].saved_blocks == num_blocks

        hashes = stored.writer.get_block_hashes(1)
        ident = connector.namespace.ident
        names = [block_key(ident, describe_block(stored.writer, hashes, i, mode).key)
                 for i in range(num_blocks)]
        value_bytes = sum(len(client.get(name)) for name in names)

        def get_loop() -> None:
            for name in names:
                client.get(name)

        per_mget = connector.redis_store.mget_blocks  # the same batches as the load

        def mget_batches() -> None:
            for begin in range(0, len(names), per_mget):
                client.mget(names[begin:begin + per_mget])

        # interleaved, so a busy machine slows all three alike and the ratio holds
        lookup_times, load_times, get_times, mget_times = [], [], [], []
        for repeat in range(repeats + 1):
            lookup_s, load_s = timed_load(connector, stored, block_size, device,
                                          f"reader-{repeat}")
            lookup_times.append(lookup_s)
            load_times.append(load_s)
            get_times.append(_timed(get_loop))
            mget_times.append(_timed(mget_batches))
        assert_loaded(kv, stored)
        get_s = statistics.median(get_times[1:])
        mget_s = statistics.median(mget_times[1:])
    finally:
        client.close()
        connector.shutdown()
    nbytes = num_blocks * kv.layout.nbytes
    load_s = statistics.median(load_times[1:])
    return {
        "dtype": dtype, "blocks": num_blocks, "block_bytes": kv.layout.nbytes,
        "mb": nbytes / 1e6, "value_mb": value_bytes / 1e6,
        "lookup_ms": statistics.median(lookup_times[1:]) * 1e3,
        "load_ms": load_s * 1e3, "load_gbps": nbytes / load_s / 1e9,
        "get_gbps": nbytes / get_s / 1e9, "mget_gbps": nbytes / mget_s / 1e9,
        "load_vs_get": get_s / load_s, "mget_blocks": per_mget,
    }


def measure_embedded(dtype: str, prompt_tokens: int, block_size: int, repeats: int,
                     device: torch.device, batch_blocks: int = DEFAULT_BATCH_BLOCKS) -> dict:
    """`measure` against a private embedded server started (and stopped) here."""
    with EmbeddedValkey(4 * GIB) as server:
        return measure(server.url, dtype, prompt_tokens, block_size, batch_blocks, repeats,
                       device)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="embedded",
                        help="a Valkey/Redis URL, or 'embedded' (default): a private server")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batch-blocks", type=int, default=DEFAULT_BATCH_BLOCKS,
                        help="keys per EXISTS pipeline, at most per MGET (default "
                             "%(default)s; an MGET also stops at 2 MiB)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead")


def run(args: argparse.Namespace) -> int:
    if args.prompt_tokens < args.block_size or args.prompt_tokens % args.block_size:
        raise ValueError("--prompt-tokens must be a positive multiple of --block-size")
    torch.set_num_threads(args.threads)
    device = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto"
        else args.device
    )
    server = EmbeddedValkey(4 * GIB).start() if args.url == "embedded" else None
    url = server.url if server is not None else args.url
    try:
        rows = [measure(url, dtype.strip(), args.prompt_tokens, args.block_size,
                        args.batch_blocks, args.repeats, device)
                for dtype in args.dtypes.split(",")]
    finally:
        if server is not None:
            server.stop()
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    where = "embedded valkey on loopback" if server is not None else url
    table = Table(title=f"store tier loads, {where}, {device} ({args.prompt_tokens} tokens, "
                        "target + draft KV)")
    for column in ("dtype", "blocks", "KV MB", "blocks / MGET", "lookup ms", "load ms",
                   "load GB/s", "GET loop GB/s", "MGET GB/s", "load / GET loop"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["dtype"], str(row["blocks"]), f"{row['mb']:.1f}",
                      str(row["mget_blocks"]),
                      f"{row['lookup_ms']:.2f}", f"{row['load_ms']:.1f}",
                      f"{row['load_gbps']:.2f}", f"{row['get_gbps']:.2f}",
                      f"{row['mget_gbps']:.2f}", f"{row['load_vs_get']:.2f}x")
    Console().print(table)
    return 0


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="speckv bench kv-store", description=__doc__)
    add_arguments(_parser)
    raise SystemExit(run(_parser.parse_args()))
