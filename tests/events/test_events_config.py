"""KV events configured through `EngineConfig.kv_events_endpoint` (what `speckv serve
--kv-events-endpoint` sets): the engine makes, uses and closes its own publisher."""

from __future__ import annotations

import pytest
import torch

from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import SamplingParams
from speckv.events.endpoints import loopback_endpoint, port_is_free
from speckv.events.schema import BlockStored
from speckv.events.subscriber import EventSubscriber, SubscriberConfig
from speckv.models import LlamaForCausalLM, ModelConfig
from tests.events.events_helpers import collect
from tests.patience import WATCHDOG_S, wait_until

CONFIG = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM.from_config(CONFIG, init_std=0.2)


def test_engine_publishes_on_the_configured_endpoints(model):
    pub_ep, replay_ep = loopback_endpoint(), loopback_endpoint()
    config = engine_config(block_size=4, num_blocks=64, hash_seed="0",
                           kv_events_endpoint=pub_ep, kv_events_replay_endpoint=replay_ep)
    engine = LLMEngine(model, config)
    try:
        engine.add_request(list(range(1, 19)), SamplingParams(max_tokens=3, ignore_eos=True))
        while engine.has_unfinished_requests():
            engine.step()
        publisher = engine.event_publisher
        assert publisher is not None and publisher.wait_sent(WATCHDOG_S)
        # a late subscriber gets the history by replay from the configured replay endpoint
        with EventSubscriber(SubscriberConfig(endpoint=pub_ep, replay_endpoint=replay_ep)) as sub:
            batches = collect(sub, publisher.stats.sent_batches)
        stored = [e for _, b in batches for e in b.events if isinstance(e, BlockStored)]
        # 18 prompt + 3 output tokens, 20 with KV (the last sampled one has none): 5 blocks
        assert sum(len(e.block_hashes) for e in stored) == 5
    finally:
        engine.close()
    # closed: the endpoint is free again (ZeroMQ's I/O thread releases it asynchronously)
    host, port = pub_ep.removeprefix("tcp://").split(":")
    wait_until(lambda: port_is_free(host, int(port)), "the endpoint is free again",
               poll_s=0.05)


def test_bad_or_busy_endpoints_are_user_errors(model):
    with pytest.raises(ValueError, match="kv_events_endpoint"):
        engine_config(kv_events_endpoint="localhost:5557")
    with pytest.raises(ValueError, match="needs kv_events_endpoint"):
        engine_config(kv_events_replay_endpoint="tcp://127.0.0.1:5558")
    endpoint = loopback_endpoint()
    first = LLMEngine(model, engine_config(block_size=4, num_blocks=16,
                                           kv_events_endpoint=endpoint))
    try:
        with pytest.raises(ValueError, match="cannot bind the KV-event endpoint"):
            LLMEngine(model, engine_config(block_size=4, num_blocks=16,
                                           kv_events_endpoint=endpoint))
    finally:
        first.close()
