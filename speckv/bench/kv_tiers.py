"""`speckv bench kv-tiers`: how fast the KV tiers load and store, beside a plain `copy_`.

One request's prompt (`--prompt-tokens`, whole blocks) is stored in each tier with the built-in
model's KV layout (SmolLM2-135M: 30 layers, 3 KV heads, head size 64) plus a one-layer EAGLE
drafter's, then loaded back into fresh device blocks through the connector, as the engine does
before a forward. Each row is the median of `--repeats` loads, in GB/s of KV bytes (target +
draft), with the ratio to one `tensor.copy_` of the same number of bytes from host memory to
the device (the ceiling for any tier). Stores are reported as the step's share (the snapshot
in `start_load_kv`) and the copy thread's time to settle them. The disk tier reads through the
page cache (warm: the files were just written).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from rich.console import Console
from rich.table import Table

from speckv.bench.tier_harness import (
    assert_loaded,
    bench_kv,
    store_prompt,
    sync,
    timed_load,
)
from speckv.connectors import ConnectorConfig, ConnectorMode, TierIdentity, make_connector


def _copy_reference(nbytes: int, device: torch.device, repeats: int) -> float:
    """Median seconds of one host -> device `copy_` of `nbytes` (pinned host on CUDA)."""
    source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    source.fill_(1)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats + 1):
        sync(device)
        start = time.perf_counter()
        target.copy_(source, non_blocking=True)
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def measure(tier: str, dtype: str, prompt_tokens: int, block_size: int, repeats: int,
            device: torch.device, directory: str) -> dict:
    num_blocks = prompt_tokens // block_size
    kv = bench_kv(num_blocks, block_size, dtype, device)
    block_bytes = kv.layout.nbytes
    gib = (2 * num_blocks * block_bytes) / (1 << 30)
    config = ConnectorConfig.parse(tier, offload_gib=gib, offload_dir=directory, disk_gib=gib,
                                   max_pending_blocks=num_blocks)
    connector = make_connector(config, TierIdentity("bench-kv-tiers", "sha256", "0"))
    connector.initialize(kv, ConnectorMode(1, False, block_size))
    try:
        stored = store_prompt(connector, prompt_tokens, block_size, device)
        load_times = [timed_load(connector, stored, block_size, device, f"reader-{repeat}")[1]
                      for repeat in range(repeats + 1)]
        assert_loaded(kv, stored)
    finally:
        connector.shutdown()
    nbytes = num_blocks * block_bytes
    load_s = statistics.median(load_times[1:])
    copy_s = _copy_reference(nbytes, device, repeats)
    return {
        "tier": tier, "dtype": dtype, "blocks": num_blocks, "mb": nbytes / 1e6,
        "load_ms": load_s * 1e3, "load_gbps": nbytes / load_s / 1e9,
        "copy_gbps": nbytes / copy_s / 1e9, "copy_ratio": load_s / copy_s,
        "snapshot_ms": stored.snapshot_s * 1e3, "settle_ms": stored.settle_s * 1e3,
    }


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tiers", default="offload,disk",
                        help="comma-separated tiers to measure (default %(default)s)")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="auto", help="auto, cpu or cuda")
    parser.add_argument("--dir", default=None, help="disk tier directory (default: a temp dir)")
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
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for tier in args.tiers.split(","):
            for dtype in args.dtypes.split(","):
                rows.append(measure(tier.strip(), dtype.strip(), args.prompt_tokens,
                                    args.block_size, args.repeats, device,
                                    args.dir or scratch))
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    table = Table(title=f"KV tier loads on {device} ({args.prompt_tokens} tokens, "
                        f"target + draft KV)")
    for column in ("tier", "dtype", "MB", "load ms", "load GB/s", "copy_ GB/s",
                   "load / copy_", "store: step ms", "store: settled ms"):
        table.add_column(column, justify="right")
    for row in rows:
        table.add_row(row["tier"], row["dtype"], f"{row['mb']:.1f}", f"{row['load_ms']:.2f}",
                      f"{row['load_gbps']:.2f}", f"{row['copy_gbps']:.2f}",
                      f"{row['copy_ratio']:.2f}x", f"{row['snapshot_ms']:.2f}",
                      f"{row['settle_ms']:.2f}")
    Console().print(table)
    return 0
