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

from speckv.attention import PagedKVCache
from speckv.connectors import (
    ConnectorConfig,
    ConnectorMode,
    DeviceKV,
    RequestBlocks,
    TierIdentity,
    make_connector,
)
from speckv.hashing.extra_keys import NO_HASH_INPUTS
from speckv.hashing.formats import format_for
from speckv.hashing.functions import get_hash_algo, make_none_hash
from speckv.hashing.request_hasher import RequestBlockHasher

# the built-in model's KV shape and its EAGLE head's
TARGET_LAYERS, DRAFT_LAYERS, KV_HEADS, HEAD_DIM = 30, 1, 3, 64


class _Prompt:
    """A request as a connector reads it (see `speckv.connectors.rules.ConnectorRequest`)."""

    hash_inputs = NO_HASH_INPUTS
    lora_name = None

    def __init__(self, request_id: str, tokens: list[int], block_size: int) -> None:
        self.request_id = request_id
        self.all_token_ids = tokens
        algo = get_hash_algo("sha256")
        hasher = RequestBlockHasher(algo, make_none_hash(algo, "0"), block_size, format_for(1))
        hasher.update(tokens)
        self._hashes = hasher.block_hashes

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def get_block_hashes(self, lookahead_tokens: int) -> list[bytes]:
        assert lookahead_tokens == 1
        return self._hashes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _copy_reference(nbytes: int, device: torch.device, repeats: int) -> float:
    """Median seconds of one host -> device `copy_` of `nbytes` (pinned host on CUDA)."""
    source = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    source.fill_(1)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    times = []
    for _ in range(repeats + 1):
        _sync(device)
        start = time.perf_counter()
        target.copy_(source, non_blocking=True)
        _sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def measure(tier: str, dtype: str, prompt_tokens: int, block_size: int, repeats: int,
            device: torch.device, directory: str) -> dict:
    num_blocks = prompt_tokens // block_size
    total_blocks = 2 * num_blocks + 2
    target = PagedKVCache(TARGET_LAYERS, total_blocks, block_size, KV_HEADS, HEAD_DIM, dtype,
                          device)
    draft = PagedKVCache(DRAFT_LAYERS, total_blocks, block_size, KV_HEADS, HEAD_DIM, dtype,
                         device)
    kv = DeviceKV(target, draft)
    block_bytes = kv.layout.nbytes
    gib = (2 * num_blocks * block_bytes) / (1 << 30)
    config = ConnectorConfig.parse(tier, offload_gib=gib, offload_dir=directory, disk_gib=gib,
                                   max_pending_blocks=num_blocks)
    connector = make_connector(config, TierIdentity("bench-kv-tiers", "sha256", "0"))
    connector.initialize(kv, ConnectorMode(1, False, block_size))
    try:
        for cache in kv.caches:
            cache.storage.normal_()
        tokens = [(7 * i) % 49152 for i in range(prompt_tokens + 1)]
        writer = _Prompt("writer", tokens, block_size)
        source_ids = list(range(1, num_blocks + 2))
        connector.update_state_after_alloc(writer, source_ids, 0, 0)
        connector.start_load_kv(connector.build_connector_meta([
            RequestBlocks(writer, source_ids, 0)]))
        # the step after the prefill lists every block: time the step's share, then the rest
        meta = connector.build_connector_meta([RequestBlocks(writer, source_ids, prompt_tokens)])
        _sync(device)
        start = time.perf_counter()
        connector.start_load_kv(meta)
        _sync(device)
        snapshot_s = time.perf_counter() - start
        assert connector.flush(timeout_s=600)
        settle_s = time.perf_counter() - start
        connector.request_finished(RequestBlocks(writer, source_ids, prompt_tokens))

        load_times = []
        target_ids = list(range(num_blocks + 2, 2 * num_blocks + 2))
        for repeat in range(repeats + 1):
            reader = _Prompt(f"reader-{repeat}", tokens, block_size)
            hit = connector.get_num_new_matched_tokens(reader, 0)
            assert hit.num_tokens == prompt_tokens, (hit, prompt_tokens)
            connector.update_state_after_alloc(reader, target_ids, 0, hit.num_tokens)
            meta = connector.build_connector_meta([])
            _sync(device)
            start = time.perf_counter()
            connector.start_load_kv(meta)
            _sync(device)
            load_times.append(time.perf_counter() - start)
            assert not connector.get_block_ids_with_load_errors()
            connector.request_finished(RequestBlocks(reader, target_ids, 0))
        for cache in kv.caches:
            assert torch.equal(cache.storage[:, :, source_ids[:num_blocks]],
                               cache.storage[:, :, target_ids])
    finally:
        connector.shutdown()
    nbytes = num_blocks * block_bytes
    load_s = statistics.median(load_times[1:])
    copy_s = _copy_reference(nbytes, device, repeats)
    return {
        "tier": tier, "dtype": dtype, "blocks": num_blocks, "mb": nbytes / 1e6,
        "load_ms": load_s * 1e3, "load_gbps": nbytes / load_s / 1e9,
        "copy_gbps": nbytes / copy_s / 1e9, "copy_ratio": load_s / copy_s,
        "snapshot_ms": snapshot_s * 1e3, "settle_ms": settle_s * 1e3,
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
