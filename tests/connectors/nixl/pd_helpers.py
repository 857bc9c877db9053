"""Two engines in one process joined by the nixl connector (NIXL over loopback between two
agents, the side channel over loopback ZeroMQ): a prefill engine, a decode engine, a single
engine to compare with, and the P/D flow driven step by step."""

from __future__ import annotations

import json
import random

from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.outputs import RequestOutput
from speckv.engine.sampling_params import SamplingParams
from speckv.engine.speculative import speculative_args
from tests.patience import wait_until

B = 4


def prompt_of(length: int, seed: int = 0, vocab: int = 96) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


def transfer_config(role: str, **options) -> str:
    return json.dumps({"kv_connector": "nixl", "kv_role": role, **options})


def make_engine(model, drafter, role: str | None = None, num_blocks: int = 64,
                **overrides) -> LLMEngine:
    if role is not None:
        overrides["kv_transfer_config"] = transfer_config(
            role, **overrides.pop("transfer_options", {}))
    # a fixed draft length: the adaptive policy picks its length from wall-clock timings
    overrides.setdefault("adaptive_speculation", False)
    config = engine_config(block_size=B, num_blocks=num_blocks, hash_seed="0",
                           **(speculative_args(drafter, 2) if drafter is not None else {}),
                           **overrides)
    return LLMEngine(model, config, drafter=drafter, detokenize=False)


def run(engine: LLMEngine, prompt, params: SamplingParams) -> RequestOutput:
    request_id = engine.add_request(prompt, params)
    final = None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished and output.request_id == request_id:
                final = output
        engine.manager.check_integrity()
    assert final is not None
    return final


def prefill(engine: LLMEngine, prompt) -> RequestOutput:
    """The prefill half: one token, KV kept under a lease (the engine still holds it)."""
    request_id = engine.add_request(prompt, SamplingParams(
        max_tokens=1, ignore_eos=True, kv_transfer_params={"do_remote_decode": True}))
    while True:
        for output in engine.step():
            if output.finished and output.request_id == request_id:
                return output


def pulled_hit(engine: LLMEngine, prompt, params: dict) -> tuple[str, int]:
    """Add the decode half and step it until its first token (the READ is asynchronous: the
    request's first step follows it); (request id, its transferred hit in tokens), with the
    hit checked to be all of the prefill side's tokens."""
    request_id = engine.add_request(prompt, SamplingParams(
        max_tokens=4, ignore_eos=True, kv_transfer_params=params))
    while not any(o.request_id == request_id and o.token_ids for o in engine.step()):
        pass
    request = engine.get_request(request_id)
    length = request.num_external_cached_tokens
    assert length == request.num_cached_tokens == params["num_tokens"] > 0
    return request_id, length


def decode(engine: LLMEngine, prompt, params: dict, max_tokens: int = 8) -> RequestOutput:
    return run(engine, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True,
                                              kv_transfer_params=params))


def step_until(engine: LLMEngine, done, cpu_budget_s: float = 60.0) -> int:
    """Step (checking the pools) until `done()`; the steps it took. The transfer's handshake
    and admission run on threads: steps yield a millisecond so they run on a busy machine.
    The CPU budget (`tests.patience`) only guards against a hang."""
    steps = 0

    def stepped() -> bool:
        nonlocal steps
        if done():
            return True
        engine.step()
        engine.manager.check_integrity()
        steps += 1
        return False

    wait_until(stepped, "the condition holds", cpu_budget_s, poll_s=0.001)
    return steps


def settle(engine: LLMEngine, cpu_budget_s: float = 60.0) -> None:
    """Step until the engine holds nothing (its leases released or expired)."""
    def idle() -> bool:
        if not engine.has_unfinished_requests():
            return True
        engine.step()
        return False

    wait_until(idle, "the prefill engine lets go of its blocks", cpu_budget_s, poll_s=0.001)
    engine.manager.check_integrity()


def all_free(engine: LLMEngine) -> bool:
    """Every block of every pool free (per-group pools included)."""
    return engine.manager.get_num_free_blocks() == engine.manager.get_num_blocks()
