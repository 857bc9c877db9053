"""Blocks routed to a vLLM engine while their request is in flight, request by request as the
concurrency-4 route bench showed them (no vLLM needed: the events are vLLM's, synthetic).

An engine may evict a block the router saw cached before it schedules the request routed
there (an earlier request's allocation takes it first); that request then computes it again,
so the next request routed there while it is in flight finds it. Once the request is answered
the events alone say what the engine holds."""

from __future__ import annotations

import time

from speckv.events.schema import BlockRemoved, KVEventBatch
from speckv.router.index import RouterIndex
from speckv.router.vllm_engine import VLLMFlags, vllm_contract
from tests.router.test_vllm_contract import EVENTS, MODELS, URL, metrics, root_event

BLOCK = 32


def removed(*hashes: bytes) -> KVEventBatch:
    return KVEventBatch(0.0, [BlockRemoved(block_hashes=list(hashes), medium="GPU")])


def index_with_prefix() -> tuple[RouterIndex, list[int]]:
    contract = vllm_contract("v", URL, metrics(), MODELS, VLLMFlags(EVENTS, "0"))
    index = RouterIndex({"v": contract.hashing})
    prefix = list(range(1000, 1000 + 4 * BLOCK))
    index.apply_batch("v", root_event(prefix, "0"))  # 4 blocks cached
    return index, prefix


def chain(index: RouterIndex, tokens: list[int]) -> list[bytes]:
    from speckv.hashing.extra_keys import NO_HASH_INPUTS

    return index.prompt_hashes("v", tokens, NO_HASH_INPUTS)


def test_a_cached_block_evicted_before_its_routed_request_runs_still_counts():
    index, prefix = index_with_prefix()
    first = prefix + list(range(5000, 5000 + BLOCK + 7))  # the prefix + 1 new block + 7
    second = prefix + list(range(6000, 6000 + BLOCK + 7))
    first_hashes = chain(index, first)
    index.add_pending("v", first_hashes)  # routed: in flight
    # another request's allocation evicts blocks 2 and 3 before the engine schedules `first`
    index.apply_batch("v", removed(first_hashes[2], first_hashes[3]))
    now = time.monotonic()
    # `first` computes them again: `second`, routed while it is in flight, finds all four
    assert index.matched_blocks("v", chain(index, second), pending_at_s=now) == 4
    # the events alone (published blocks) no longer show them
    assert index.matched_blocks("v", chain(index, second)) == 2


def test_once_answered_the_events_alone_say_what_is_held():
    index, prefix = index_with_prefix()
    prompt = prefix + list(range(5000, 5000 + 9))
    hashes = chain(index, prompt)
    index.add_pending("v", hashes)
    index.release_pending("v", hashes, time.monotonic() + 60.0)  # a grace period # not a wall limit
    # a block its events showed cached is evicted after the request was answered: the
    # router sees it at once, the grace period is for blocks whose BlockStored is late
    index.apply_batch("v", removed(hashes[1]))
    assert index.matched_blocks("v", hashes, pending_at_s=time.monotonic()) == 1


def test_the_fleet_predicts_a_vllm_engine_from_its_pool_mirror_and_its_events():
    from speckv.router.fleet import EngineLink, EngineSpec, Fleet
    from speckv.router.tokenizer import TokenizerCache

    flags = VLLMFlags(EVENTS, "0")
    link = EngineLink(EngineSpec("v", URL, vllm=flags),
                      vllm_contract("v", URL, metrics(), MODELS, flags))
    fleet = Fleet([link], TokenizerCache(override="builtin"))  # the model dir is elsewhere
    assert link.pool is not None  # 704 blocks of 32, one group, no drafter
    prefix = list(range(1000, 1000 + 4 * BLOCK))
    # blocks the engine stored before the router started: known from its events only
    fleet.apply(link, link.generation, 0, root_event(prefix, "0"))
    prompt = prefix + list(range(5000, 5000 + BLOCK + 7))
    plan = fleet.plan(prompt, ["v"])["v"]
    assert plan.predicted_cached_tokens == plan.published_cached_tokens == 4 * BLOCK
    fleet.routed("v", plan)  # scheduled in the mirror: its new block held there now
    again = fleet.plan(prompt, ["v"])["v"]
    assert again.predicted_cached_tokens == 5 * BLOCK > again.published_cached_tokens
    fleet.finished("v", plan, 1)
    assert fleet.state()["v"]["pool_mirror"] == {"free_blocks": 703, "corrections": 0}
    fleet.cleared(link)  # a reset through the router
    assert fleet.plan(prompt, ["v"])["v"].predicted_cached_tokens == 0
