"""Fixtures for engine tests: a tiny random Llama (fp32, CPU) built in the test."""

from __future__ import annotations

import pytest
import torch

from speckv.models import LlamaForCausalLM, ModelConfig

TINY_CONFIG = ModelConfig(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


@pytest.fixture(autouse=True)
def single_cpu_thread():
    """Tiny models run fastest on one thread; on a shared 2-core CPU, two threads stall in
    spin-waits (10-40x slower steps). Restored after each test."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(1234)
    # a large init std gives peaked, input-dependent logits (no long argmax ties)
    return LlamaForCausalLM.from_config(TINY_CONFIG, init_std=0.2)
