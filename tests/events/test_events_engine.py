"""Events from the real engine (tiny model, EAGLE drafter) over real sockets to the router:
every published hash is reproducible, and the router routes a repeat to the engine that ran it."""

from __future__ import annotations

import pytest

from speckv.drafters.loaders import random_drafter
from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import SamplingParams
from speckv.events.subscriber import EventSubscriber, SubscriberConfig
from speckv.models.llama.tiny import tiny_model
from speckv.router.index import EngineHashConfig, RouterIndex
from tests.events.events_helpers import collect
from tests.patience import WATCHDOG_S


@pytest.mark.parametrize("legacy", [False, True])
def test_engine_events_reproduce_hashes_and_route(endpoints, make_publisher, legacy):
    model = tiny_model(seed=0)
    drafter = random_drafter("eagle", model, seed=1)
    pub_ep, replay_ep = endpoints
    publisher = make_publisher(endpoint=pub_ep, replay_endpoint=replay_ep)
    config = engine_config(block_size=4, num_blocks=64, speculative_method="eagle",
                           num_spec_tokens=2, hash_seed="0",
                           disable_lookahead_block_hashes=legacy)
    engine = LLMEngine(model, config, drafter=drafter, event_publisher=publisher)
    lookahead = engine.hash_mode.lookahead_tokens
    assert lookahead == (0 if legacy else 1)
    prompts = [[(7 * i + j) % 90 + 1 for j in range(18)] for i in range(3)]
    for prompt in prompts:
        engine.add_request(prompt, SamplingParams(max_tokens=5, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert publisher.wait_sent(WATCHDOG_S)
    router = RouterIndex({
        "engine-a": EngineHashConfig(seed="0", block_size=4, lookahead_tokens=lookahead),
        "engine-b": EngineHashConfig(seed="0", block_size=4, lookahead_tokens=lookahead),
    })
    with EventSubscriber(SubscriberConfig(endpoint=pub_ep, replay_endpoint=replay_ep)) as sub:
        batches = collect(sub, publisher.stats.sent_batches)
    assert batches, "no events arrived"
    for seq, batch in batches:
        router.apply_batch("engine-a", batch, seq)
    stats = router.stats()["engine-a"]
    assert stats["verified_blocks"] > 0 and stats["mismatched_blocks"] == 0
    result = router.route(prompts[1])
    assert result.engine == "engine-a"
    assert result.matched_tokens >= 12
    assert result.per_engine["engine-b"] == 0
