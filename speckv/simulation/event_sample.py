"""A small synthetic engine for KV-event consumers: the real cache manager, no model.

Owns `SampleEngine` (the real scheduler and a `KVCacheManager` with an event sink, run by the
toy runner, hashing as an engine with `L` lookahead tokens would) and `run_sample_workload`, a
few requests that share prefixes, one with a LoRA adapter, one salted, one with a multimodal
item, on a cache small enough to evict, ending with a prefix-cache reset. Events are published
once per step, as an engine does. Used by `speckv events publish-sample`, the tests and the
benchmark.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from speckv.cache import FullAttentionSpec, KVCacheManager
from speckv.cache.events import KVCacheEvent, KVEventSink
from speckv.cache.hash_mode import HashMode
from speckv.engine.messages import FinishReason
from speckv.engine.request import Request
from speckv.hashing.extra_keys import NO_HASH_INPUTS, HashInputs, LoRARef, MultiModalItem
from speckv.hashing.functions import get_hash_algo
from speckv.simulation.toy_runner import toy_core

SAMPLE_LORA = LoRARef("sample-adapter", "/adapters/sample-adapter")
Publish = Callable[[Sequence[KVCacheEvent]], object]


@dataclass(frozen=True)
class SampleEngineConfig:
    block_size: int = 16
    lookahead_tokens: int = 1
    num_blocks: int = 64  # small on purpose: the workload evicts
    algo: str = "sha256"
    seed: str = "0"  # PYTHONHASHSEED string, so consumers can reproduce NONE_HASH
    num_spec_tokens: int = 3
    events: bool = True

    def __post_init__(self) -> None:
        if self.block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {self.block_size}")
        if self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2, got {self.num_blocks}")
        get_hash_algo(self.algo)
        if self.lookahead_tokens < 0:
            raise ValueError(f"lookahead must be >= 0, got {self.lookahead_tokens}")


class SampleEngine:
    def __init__(self, config: SampleEngineConfig) -> None:
        self.config = config
        self.sink = KVEventSink() if config.events else None
        self.manager = KVCacheManager(
            [FullAttentionSpec(config.block_size)], num_blocks=config.num_blocks,
            hash_mode=HashMode.for_lookahead(config.lookahead_tokens), event_sink=self.sink,
        )
        self.hashing = self.manager.block_hashing(config.algo, config.seed)
        # drafts only make sense with a drafter; L = 0 here means "no drafter"
        num_spec = config.num_spec_tokens if config.lookahead_tokens else 0
        self.core = toy_core(self.manager, num_spec)
        self.core.runner.num_accept = 2
        self.requests: list[Request] = []

    def request(
        self, request_id: str, prompt: Sequence[int], max_tokens: int = 8,
        inputs: HashInputs = NO_HASH_INPUTS,
    ) -> Request:
        req = Request(request_id, prompt, self.hashing, max_tokens=max_tokens, hash_inputs=inputs)
        self.requests.append(req)
        return req

    def run(self, request: Request, publish: Publish | None = None) -> None:
        """Step the request to completion, publishing each step's events."""
        self.core.scheduler.add_request(request)
        while not request.is_finished:
            for output in self.core.step():
                if output.finish_reason is FinishReason.ERROR:
                    raise RuntimeError("the sample cache is too small for this request")
            if publish is not None:
                publish(self.manager.take_events())


def sample_prompts(block_size: int, num_requests: int, rng: random.Random) -> list[list[int]]:
    """Prompts in families sharing prefixes of 2-4 blocks, with random suffixes."""
    families = [[rng.randrange(1, 30_000) for _ in range(4 * block_size)] for _ in range(3)]
    prompts = []
    for index in range(num_requests):
        prefix = families[index % len(families)][: block_size * (2 + index % 3)]
        suffix = [rng.randrange(1, 30_000) for _ in range(rng.randrange(1, 2 * block_size))]
        prompts.append(prefix + suffix)
    return prompts


@dataclass(frozen=True)
class SampleSummary:
    num_requests: int
    num_steps: int  # engine steps, i.e. publish calls


def run_sample_workload(
    engine: SampleEngine, publish: Publish, num_requests: int = 8, rng_seed: int = 0,
    reset_at_end: bool = True,
) -> SampleSummary:
    """Drive the sample workload; `publish` receives each step's records."""
    rng = random.Random(rng_seed)
    block_size = engine.config.block_size
    steps = 0

    def counted(events: Sequence[KVCacheEvent]) -> None:
        nonlocal steps
        steps += 1
        publish(events)

    for index, prompt in enumerate(sample_prompts(block_size, num_requests, rng)):
        inputs = NO_HASH_INPUTS
        if index % 4 == 1:
            inputs = HashInputs(lora=SAMPLE_LORA)
        elif index % 4 == 2:
            inputs = HashInputs(cache_salt=f"tenant-{index}")
        elif index % 4 == 3 and len(prompt) > block_size + 4:
            # an image that starts right after block 0: it lands in block 0's lookahead
            offset = block_size
            inputs = HashInputs(mm_items=(MultiModalItem(f"img-{index}", offset, 4),))
        engine.run(engine.request(f"req-{index}", prompt, inputs=inputs), counted)
    if reset_at_end and engine.manager.reset_prefix_cache():
        counted(engine.manager.take_events())
    return SampleSummary(num_requests, steps)
