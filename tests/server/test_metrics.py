"""/metrics: vLLM's metric names and labels, speculative-decoding counters that add up, and
the hash-mode gauges (lookahead L vs legacy + drop)."""

from __future__ import annotations

import openai
import pytest

from speckv.drafters.loaders import random_drafter
from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.server.app import OpenAIServer, ServerConfig
from speckv.server.launch import ServerThread
from tests.server.server_test_utils import MODEL_NAME, TOKENIZER, scrape, value

VLLM_NAMES = [
    "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
    "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:num_preemptions_total",
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
    "vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total", "vllm:time_to_first_token_seconds_count",
    "vllm:inter_token_latency_seconds_count", "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_count",
]


@pytest.fixture
def eagle_server(tiny_chat_model):
    started = []

    def start(legacy: bool) -> ServerThread:
        drafter = random_drafter("eagle", tiny_chat_model, init_std=0.2, seed=5)
        config = engine_config(block_size=4, num_blocks=512, speculative_method="eagle",
                               num_spec_tokens=3, hash_seed="0",
                               disable_lookahead_block_hashes=legacy)
        engine = LLMEngine(tiny_chat_model, config, TOKENIZER, drafter=drafter)
        thread = ServerThread(OpenAIServer(engine, ServerConfig(MODEL_NAME))).start()
        started.append(thread)
        return thread

    yield start
    for thread in started:
        thread.stop()


def test_spec_decode_and_hash_mode_metrics(eagle_server):
    server = eagle_server(legacy=False)
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0) as client:
        outs = [client.completions.create(model=MODEL_NAME, prompt=[9, 10, 11, 12] * (3 + i),
                                          max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True})
                for i in range(4)]
    metrics = scrape(server.url)
    for name in VLLM_NAMES:
        assert value(metrics, name, model_name=MODEL_NAME, engine="0") >= 0
    drafts = value(metrics, "vllm:spec_decode_num_draft_tokens_total")
    accepted = value(metrics, "vllm:spec_decode_num_accepted_tokens_total")
    per_pos = [value(metrics, "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                     position=str(p)) for p in range(3)]
    assert drafts > 0
    assert sum(per_pos) == accepted and per_pos[0] >= per_pos[1] >= per_pos[2]
    assert value(metrics, "vllm:spec_decode_num_drafts_total") * 3 >= drafts
    assert value(metrics, "vllm:generation_tokens_total") == sum(
        o.usage.completion_tokens for o in outs) == 96
    assert value(metrics, "speckv:lookahead_tokens") == 1
    assert value(metrics, "speckv:legacy_block_drop") == 0
    assert value(metrics, "speckv:hash_mode_info", hash_mode="lookahead L=1") == 1
    # the adaptive draft length's choices: every step that verified drafts asked for k >= 1
    by_k = [value(metrics, "speckv:spec_decode_steps_by_num_spec_tokens",
                  num_spec_tokens=str(k)) for k in range(4)]
    assert sum(by_k[1:]) > 0 and sum(by_k) > 0
    assert 0 <= value(metrics, "speckv:spec_decode_num_spec_tokens") <= 3
    assert value(metrics, "speckv:spec_decode_predicted_speedup") >= 0


def test_legacy_mode_shows_the_block_drop(eagle_server):
    server = eagle_server(legacy=True)
    metrics = scrape(server.url)
    assert value(metrics, "speckv:lookahead_tokens") == 0
    assert value(metrics, "speckv:legacy_block_drop") == 1
    assert value(metrics, "speckv:hash_mode_info", hash_mode="legacy+drop") == 1


def test_kv_budget_per_group_gauges_on_a_hybrid_engine():
    from speckv.models.hybrid.loader import tiny_hybrid

    model = tiny_hybrid()
    per_block = sum(model.kv_cache_group_bytes(model.kv_cache_layout(4, 8)))
    engine = LLMEngine(model, engine_config(block_size=4, mamba_block_size=8, max_num_seqs=4,
                                            max_num_batched_tokens=64,
                                            kv_cache_memory_bytes=per_block * 200))
    budget = engine.kv_budget
    thread = ServerThread(OpenAIServer(engine, ServerConfig(MODEL_NAME))).start()
    try:
        metrics = scrape(thread.url)
    finally:
        thread.stop()
    assert value(metrics, "speckv:kv_cache_per_group_pools") == 1
    assert value(metrics, "speckv:kv_cache_context_tokens") == budget.context_tokens > 199 * 2
    for index, group in enumerate(budget.groups):
        assert value(metrics, "speckv:kv_cache_group_blocks", group=str(index),
                     kind=group.kind) == group.num_blocks
        assert value(metrics, "speckv:kv_cache_group_bytes", group=str(index),
                     kind=group.kind) == group.nbytes
    assert "per-group KV pools: full_attention" in budget.describe()
