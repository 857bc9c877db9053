"""A consumer recomputes every published block hash from the event alone, and gets the
engine's own hashes (the request's `get_block_hashes(L)`), for legacy and lookahead modes,
with LoRA, cache salt, multimodal and prompt-embedding extra keys."""

from __future__ import annotations

import numpy as np
import pytest

from speckv.events.schema import BlockStored, decode_batch, encode_batch, to_wire_batch
from speckv.events.subscriber import EventSubscriber, SubscriberConfig
from speckv.hashing.extra_keys import HashInputs, LoRARef, MultiModalItem
from speckv.hashing.functions import get_hash_algo, make_none_hash
from speckv.router.index import recompute_block_hashes
from speckv.simulation.event_sample import SampleEngine, SampleEngineConfig
from tests.events.events_helpers import collect
from tests.patience import WATCHDOG_S

B = 8
LORA = LoRARef("adapter-a", "/srv/adapters/a")
PATHS = {LORA.name: LORA.path}
PROMPT = [(7 * i + 3) % 997 + 1 for i in range(5 * B + 3)]

INPUTS = {
    "plain": HashInputs(),
    "lora": HashInputs(lora=LORA),
    "salt": HashInputs(cache_salt="tenant-7"),
    # one item inside block 1, one starting exactly where block 2 ends (in its lookahead)
    "mm": HashInputs(
        mm_items=(MultiModalItem("img-a", B + 2, 3), MultiModalItem("img-b", 3 * B, 4))
    ),
    "embeds": HashInputs(prompt_embeds=np.arange(len(PROMPT) * 4, dtype=np.float32).reshape(-1, 4)),
    "all": HashInputs(lora=LORA, cache_salt="s", mm_items=(MultiModalItem("img", 2 * B - 1, 5),)),
}


def events_of_one_request(lookahead: int, inputs: HashInputs, algo: str = "sha256"):
    engine = SampleEngine(SampleEngineConfig(block_size=B, lookahead_tokens=lookahead,
                                             num_blocks=64, algo=algo))
    request = engine.request("r", PROMPT, max_tokens=6, inputs=inputs)
    batches = []
    engine.run(request, lambda records: batches.append(
        decode_batch(encode_batch(to_wire_batch(records)))) if records else None)
    stored = [e for batch in batches for e in batch.events if isinstance(e, BlockStored)]
    return request, stored


@pytest.mark.parametrize("lookahead", [0, 1, 3])
@pytest.mark.parametrize("kind", list(INPUTS))
def test_recomputed_hashes_equal_the_engines(lookahead, kind):
    request, stored = events_of_one_request(lookahead, INPUTS[kind])
    engine_hashes = request.get_block_hashes(lookahead)
    published = [h for event in stored for h in event.block_hashes]
    assert published and published == engine_hashes[: len(published)]
    algo = get_hash_algo("sha256")
    none_hash = make_none_hash(algo, "0")
    for event in stored:
        # the parent is the previous block of the chain; None only for block 0
        first = published.index(event.block_hashes[0])
        assert event.parent_block_hash == (published[first - 1] if first else None)
        assert len(event.token_ids) == B * len(event.block_hashes)
        if lookahead:
            assert [len(ids) for ids in event.lookahead_token_ids] == [lookahead] * len(
                event.block_hashes)
        else:
            assert event.lookahead_token_ids is None
        start = none_hash if event.parent_block_hash is None else event.parent_block_hash
        assert recompute_block_hashes(event, algo, start, PATHS) == event.block_hashes


def test_lookahead_changes_the_hash_when_an_item_starts_in_the_lookahead():
    _, with_item = events_of_one_request(1, HashInputs(mm_items=(MultiModalItem("i", B, 2),)))
    _, without = events_of_one_request(1, HashInputs())
    assert list(with_item[0].extra_keys[0][0]) == ["i", B]  # block 0 sees the item at offset B
    assert with_item[0].block_hashes[0] != without[0].block_hashes[0]


@pytest.mark.parametrize("algo", ["sha256_cbor", "xxhash"])
def test_other_algorithms(algo):
    request, stored = events_of_one_request(1, INPUTS["all"], algo)
    hash_algo = get_hash_algo(algo)
    event = stored[0]
    assert recompute_block_hashes(event, hash_algo, make_none_hash(hash_algo, "0"), PATHS) == (
        request.get_block_hashes(1)[: len(event.block_hashes)])


def test_recompute_over_real_sockets(endpoints, make_publisher):
    pub_ep, replay_ep = endpoints
    publisher = make_publisher(endpoint=pub_ep, replay_endpoint=replay_ep)
    engine = SampleEngine(SampleEngineConfig(block_size=B, lookahead_tokens=3, num_blocks=64))
    request = engine.request("r", PROMPT, max_tokens=6, inputs=INPUTS["all"])
    engine.run(request, publisher.publish)
    assert publisher.wait_sent(WATCHDOG_S)
    # joins late: catches up through replay
    with EventSubscriber(SubscriberConfig(endpoint=pub_ep, replay_endpoint=replay_ep)) as sub:
        got = collect(sub, publisher.stats.sent_batches)
    stored = [e for _, batch in got for e in batch.events if isinstance(e, BlockStored)]
    published = [h for event in stored for h in event.block_hashes]
    assert published == request.get_block_hashes(3)[: len(published)]
    algo = get_hash_algo("sha256")
    assert recompute_block_hashes(stored[0], algo, make_none_hash(algo, "0"), PATHS) == (
        stored[0].block_hashes)
