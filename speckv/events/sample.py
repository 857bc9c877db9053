"""A small synthetic engine for KV-event consumers: the real cache manager, no model.

Owns `SampleEngine` (a `KVCacheManager` + `CacheSimulator` with an event sink, hashing as an
engine with `L` lookahead tokens would) and `run_sample_workload`, a few requests that share
prefixes, one with a LoRA adapter, one salted, one with a multimodal item, on a cache small
enough to evict, ending with a prefix-cache reset. Events are published once per step, as an
engine does. Used by `speckv events publish-sample`, the tests and the benchmark.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from speckv.cache import FullAttentionSpec, KVCacheManager
from speckv.cache.events import KVCacheEvent, KVEventSink
from speckv.engine.cache_sim import CacheSimulator
from speckv.engine.request import BlockHashing, Request
from speckv.hashing.extra_keys import NO_HASH_INPUTS, HashInputs, LoRARef, MultiModalItem
from speckv.hashing.functions import get_hash_algo, make_none_hash
from speckv.spec.policy import HashMode, make_drafter_policy, resolve_hash_mode

SAMPLE_LORA = LoRARef("sample-adapter", "/adapters/sample-adapter")
Publish = Callable[[Sequence[KVCacheEvent]], object]


def hash_mode_for(lookahead_tokens: int) -> HashMode:
    """The hash mode of an engine whose drafter needs `L` lookahead tokens."""
    if lookahead_tokens < 0:
        raise ValueError(f"lookahead must be >= 0, got {lookahead_tokens}")
    if lookahead_tokens == 0:
        return resolve_hash_mode(make_drafter_policy("none"))
    if lookahead_tokens == 1:
        return resolve_hash_mode(make_drafter_policy("eagle"))
    return resolve_hash_mode(make_drafter_policy("mtp", mtp_modules=lookahead_tokens))


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
        hash_mode_for(self.lookahead_tokens)


class SampleEngine:
    def __init__(self, config: SampleEngineConfig) -> None:
        self.config = config
        algo = get_hash_algo(config.algo)
        mode = hash_mode_for(config.lookahead_tokens)
        self.sink = KVEventSink() if config.events else None
        self.manager = KVCacheManager(
            [FullAttentionSpec(config.block_size)], num_blocks=config.num_blocks,
            hash_mode=mode, event_sink=self.sink,
        )
        self.hashing = BlockHashing(
            algo, make_none_hash(algo, config.seed), config.block_size, [mode.lookahead_tokens]
        )
        # drafts only make sense with a drafter; L = 0 here means "no drafter"
        num_spec = config.num_spec_tokens if config.lookahead_tokens else 0
        self.sim = CacheSimulator(self.manager, num_spec_tokens=num_spec)
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
        while not request.is_finished:
            if not self.sim.step(request, num_accept=2).scheduled:
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
