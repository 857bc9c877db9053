"""`speckv serve` on a sliding-window model (tiny random Gemma 3 + EAGLE): the same chat
request sent twice through the official `openai` client is served from the prefix cache
(`cached_tokens`), with the same greedy text."""

from __future__ import annotations

import openai
import torch

from speckv.drafters.loaders import random_drafter
from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.models.gemma.gemma3 import GemmaForCausalLM, tiny_gemma_config
from speckv.server.app import OpenAIServer, ServerConfig
from speckv.server.launch import ServerThread
from tests.patience import WATCHDOG_S
from tests.server.server_test_utils import TOKENIZER


def test_repeated_chat_on_a_sliding_window_model_hits():
    torch.manual_seed(3)
    model = GemmaForCausalLM.from_config(
        tiny_gemma_config(vocab_size=TOKENIZER.vocab_size, sliding_window=24), init_std=0.1)
    drafter = random_drafter("eagle", model, seed=0)
    engine = LLMEngine(model, engine_config(block_size=4, num_blocks=512, hash_seed="0",
                                            speculative_method="eagle", num_spec_tokens=2),
                       TOKENIZER, drafter=drafter)
    thread = ServerThread(OpenAIServer(engine, ServerConfig(served_model_name="swa"))).start()
    try:
        with openai.OpenAI(base_url=f"{thread.url}/v1", api_key="unused", max_retries=0,
                           timeout=WATCHDOG_S) as client:
            messages = [{"role": "user", "content": "A long shared system prompt, past the "
                         "sliding window of the local layers. " * 2}]
            first, second = (client.chat.completions.create(
                model="swa", messages=messages, max_tokens=6, temperature=0) for _ in range(2))
    finally:
        thread.stop()
    num_prompt = first.usage.prompt_tokens
    assert num_prompt > 2 * 24
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (num_prompt - 1) // 4 * 4
    assert first.choices[0].message.content == second.choices[0].message.content
