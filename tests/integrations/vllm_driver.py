"""Runs vLLM's CPU engine (LLM, in-process) on the scenarios a vLLM-plugin test asks for.

Owns nothing of speckv: it is executed by the vLLM environment's python (SPECKV_VLLM_VENV), with
or without speckv's plugin, and writes what it observed as JSON: cache hits per request, greedy
outputs, the KV events vLLM published (raw msgpack, hashes hex) and, with `draft_kv`, KV rows
read from vLLM's own cache tensors. The tests compare and judge; this script asserts nothing.

    python vllm_driver.py SPEC.json OUT.json
"""

from __future__ import annotations

import gc
import json
import os
import random
import sys
import threading
import time

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
os.environ.setdefault("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", "0")  # whole hashes in events

import msgspec
import zmq
from vllm import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def run(llm: LLM, prompt: list[int], params: SamplingParams = GREEDY) -> dict:
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    return {"cached": out.num_cached_tokens or 0, "output": list(out.outputs[0].token_ids)}


class EventCollector:
    """A SUB socket on the engine's KV-event publisher, decoding batches as plain msgpack."""

    def __init__(self, port: int) -> None:
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.connect(f"tcp://127.0.0.1:{port}")
        self.socket.setsockopt(zmq.SUBSCRIBE, b"")
        self.events: list = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        while not self.stop.is_set():
            if poller.poll(100):
                frames = self.socket.recv_multipart()
                batch = msgspec.msgpack.decode(frames[-1])
                self.events.extend(batch[1])

    def close(self) -> list:
        time.sleep(1.0)  # the publisher sends from its own thread
        self.stop.set()
        self.thread.join()
        self.socket.close(0)
        return [_jsonable(event) for event in self.events]


def _jsonable(value):
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, dict):
        return {key: _jsonable(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(item) for item in value]
    return value


def draft_kv_check(llm: LLM, block_size: int, seed: int) -> dict:
    """Hit blocks against a cold run's, and a stale-successor control, read from the KV tensors
    of the drafter's layer (the last attention layer) and of the target's first layer."""
    from vllm.v1.core.kv_cache_utils import NONE_HASH, make_block_hash_with_group_id

    from speckv.hashing.formats import format_for
    from speckv.hashing.functions import get_hash_algo
    from speckv.hashing.request_hasher import hash_prompt

    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    layers = runner.vllm_config.compilation_config.static_forward_context
    names = [name for name, layer in layers.items() if getattr(layer, "kv_cache", None) is not None]
    draft, target = names[-1], names[0]
    pool = core.scheduler.kv_cache_manager.block_pool
    algo = get_hash_algo(core.vllm_config.cache_config.prefix_caching_hash_algo)

    def blocks_of(prompt: list[int]) -> dict:
        hashes = hash_prompt(algo, NONE_HASH, block_size, format_for(1), prompt)
        rows = {}
        for index, block_hash in enumerate(hashes):
            block = pool.cached_block_hash_to_block.get_one_block(
                make_block_hash_with_group_id(block_hash, 0))
            if block is not None:
                rows[index] = {name: layers[name].kv_cache[block.block_id].clone()
                               for name in (draft, target)}
        return rows

    full = tokens(seed, 6 * block_size + 7)
    short = full[: 3 * block_size + 4]  # its blocks 0..2 have the successors `full` has
    # `full` with another token after block 2: block 2 has the same tokens and chain, another
    # successor (the block vLLM's legacy hashes would hand out as a hit)
    other = full[: 3 * block_size] + [full[3 * block_size] + 1] + full[3 * block_size + 1:]
    run(llm, short)
    hit = run(llm, full)
    hit_rows = blocks_of(full)
    llm.reset_prefix_cache()
    cold = run(llm, full)
    cold_rows = blocks_of(full)
    reused = run(llm, other)  # `full`'s blocks are cached: block 2 is reused, its end redone
    reused_rows = blocks_of(other)
    llm.reset_prefix_cache()
    other_cold = run(llm, other)
    other_cold_rows = blocks_of(other)

    def diffs(rows, reference, blocks, name):
        return [float((rows[j][name] - reference[j][name]).abs().max()) for j in blocks]

    hit_blocks = list(range(hit["cached"] // block_size))
    return {
        "hit_cached": hit["cached"], "cold_cached": cold["cached"], "hit_blocks": hit_blocks,
        "draft_max_diff": diffs(hit_rows, cold_rows, hit_blocks, draft),
        "target_max_diff": diffs(hit_rows, cold_rows, hit_blocks, target),
        "outputs_equal": hit["output"] == cold["output"],
        # the control: block 2 under the other successor against `full`'s
        "stale_draft_max_diff": diffs(other_cold_rows, cold_rows, [2], draft)[0],
        "stale_target_max_diff": diffs(other_cold_rows, cold_rows, [2], target)[0],
        # block reuse at the divergence: `other` against a cold run of `other`
        "reused_cached": reused["cached"], "other_cold_cached": other_cold["cached"],
        "reused_blocks": sorted(reused_rows),
        "reused_draft_max_diff": diffs(reused_rows, other_cold_rows, [0, 1, 2], draft),
        "reused_target_max_diff": diffs(reused_rows, other_cold_rows, [0, 1, 2], target),
        "reused_outputs_equal": reused["output"] == other_cold["output"],
    }


def engine(spec: dict) -> dict:
    kwargs = dict(
        model=spec["model"], dtype="float32", max_model_len=2048, enforce_eager=True,
        block_size=spec["block_size"], enable_prefix_caching=True, seed=0,
        max_num_seqs=4,
    )
    if spec.get("eagle3"):
        kwargs["speculative_config"] = {"method": "eagle3", "model": spec["eagle3"],
                                        "num_speculative_tokens": 3}
    if spec.get("events_port"):
        kwargs["kv_events_config"] = {
            "enable_kv_cache_events": True, "publisher": "zmq",
            "endpoint": f"tcp://*:{spec['events_port']}"}
    llm = LLM(**kwargs)
    collector = EventCollector(spec["events_port"]) if spec.get("events_port") else None
    result: dict = {"hits": {}, "prefix_repetition": None}
    for n in spec.get("hit_lengths", []):
        prompt = tokens(n, n)
        result["hits"][str(n)] = [run(llm, prompt), run(llm, prompt)]
    repetition = spec.get("prefix_repetition")
    if repetition:
        prefixes = [tokens(1000 + p, repetition["prefix_len"])
                    for p in range(repetition["num_prefixes"])]
        runs = []
        for index in range(repetition["num_prompts"]):
            prompt = prefixes[index % len(prefixes)] + tokens(2000 + index,
                                                               repetition["suffix_len"])
            runs.append(run(llm, prompt))
        result["prefix_repetition"] = runs
    if spec.get("draft_kv"):
        result["draft_kv"] = draft_kv_check(llm, spec["block_size"], seed=7)
    if collector is not None:
        result["events"] = collector.close()
    del llm
    gc.collect()
    return result


def main() -> int:
    with open(sys.argv[1]) as handle:
        specs = json.load(handle)
    results = {spec["name"]: engine(spec) for spec in specs}
    with open(sys.argv[2], "w") as handle:
        json.dump(results, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
