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
