"""Fixtures for server tests: the tiny model, servers on free loopback ports (stopped after the
test or module), and the official clients pointed at them. Helpers: server_test_utils.py."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
import torch
from server_test_utils import TINY_CONFIG, make_server

from speckv.engine.config import EngineConfig
from speckv.models import LlamaForCausalLM
from speckv.server.launch import ServerThread


@pytest.fixture(autouse=True)
def single_cpu_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread (two stall in spin-waits on a shared CPU)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def tiny_model() -> LlamaForCausalLM:
    torch.manual_seed(1234)
    return LlamaForCausalLM.from_config(TINY_CONFIG, init_std=0.2)


@pytest.fixture
def start_server(tiny_model) -> Iterator[Callable[..., ServerThread]]:
    """Start a server (engine config, server options); stopped after the test."""
    started: list[ServerThread] = []

    def start(engine_config: EngineConfig | None = None, **server_config) -> ServerThread:
        thread = make_server(tiny_model, engine_config, **server_config)
        started.append(thread)
        return thread

    yield start
    for thread in started:
        thread.stop()


@pytest.fixture(scope="module")
def shared_server(tiny_model) -> Iterator[ServerThread]:
    """One server for the tests that only send requests (module scope: fast)."""
    thread = make_server(tiny_model)
    yield thread
    thread.stop()


@pytest.fixture
def client(shared_server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{shared_server.url}/v1", api_key="unused",
                       max_retries=0, timeout=60) as client:
        yield client


@pytest.fixture
def http(shared_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=shared_server.url, timeout=60) as client:
        yield client
