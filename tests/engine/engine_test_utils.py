"""Helpers for engine tests: workloads, and running an engine step by step with checks."""

from __future__ import annotations

import random

from speckv.engine.llm_engine import LLMEngine
from speckv.engine.outputs import RequestOutput
from speckv.engine.sampling_params import SamplingParams


def shared_prefix_prompts(
    num_prompts: int, vocab_size: int, seed: int = 0, prefix_lens=(9, 17, 26)
) -> list[list[int]]:
    """Prompts that share a few random prefixes, each with its own random suffix."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab_size) for _ in range(n)] for n in prefix_lens]
    prompts = []
    for index in range(num_prompts):
        prefix = prefixes[index % len(prefixes)]
        suffix = [rng.randrange(vocab_size) for _ in range(rng.randrange(1, 7))]
        prompts.append(prefix + suffix)
    return prompts


def run_engine(
    engine: LLMEngine,
    prompts: list[list[int]],
    params: SamplingParams,
    check_integrity: bool = True,
    stagger: int = 0,
) -> dict[str, RequestOutput]:
    """Add the prompts (`stagger` > 0: one new prompt every `stagger` steps), step until
    done, checking pool integrity after every step. Returns final outputs by request id."""
    final: dict[str, RequestOutput] = {}
    queue = list(enumerate(prompts))
    steps = 0
    while queue or engine.has_unfinished_requests():
        if queue and (stagger == 0 or steps % stagger == 0):
            batch = queue if stagger == 0 else queue[:1]
            for index, prompt in batch:
                engine.add_request(prompt, params, request_id=f"r{index}")
            queue = [] if stagger == 0 else queue[1:]
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
        if check_integrity:
            engine.manager.check_integrity()
        steps += 1
        assert steps < 10_000, "engine did not finish"
    return final


class StillClock:
    """A cost clock that never moves: to the adaptive draft length every step costs nothing,
    so it drafts as many tokens as pay in expectation (after its two measuring steps: one
    draft, then none), the same choices on every machine (wall time would make them vary)."""

    def __call__(self) -> float:
        return 0.0
