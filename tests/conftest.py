"""Fixtures shared by every test directory: one thread count, one tiny model, the cache world,
and loopback ZeroMQ endpoints and publishers. Helper modules are imported as
`tests.<dir>.<module>` (the test tree is a package)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
import torch

from speckv.cache import FullAttentionSpec, KVCacheManager
from speckv.cache.drafter_policy import drafter_policy, resolve_hash_mode
from speckv.cache.events import KVEventSink
from speckv.cache.hit_check import hit_check_for
from speckv.connectors.config import ConnectorEntry, register_connector
from speckv.connectors.offload import NoLookaheadOffloadConnector
from speckv.engine.config import EngineConfig
from speckv.engine.request import Request
from speckv.events.endpoints import loopback_endpoint
from speckv.events.publisher import PublisherConfig, ZmqEventPublisher
from speckv.hashing.functions import get_hash_algo
from speckv.models.common.decoder import ModelOutput
from speckv.models.llama.model import LlamaForCausalLM
from speckv.models.llama.tiny import tiny_model as build_tiny_model
from speckv.server.launch import ServerThread
from tests.patience import WATCHDOG_S

# a CPU tier that declares no lookahead capability: the connector tests' fallback case
register_connector("offload-nolookahead", ConnectorEntry(
    lambda config, _identity: NoLookaheadOffloadConnector(
        config.offload_gib, max_pending_blocks=config.max_pending_blocks), "cpu"))

# CI's exactness rerun sets another count: GEMM kernels split work by thread, so rounding moves
TEST_TORCH_THREADS = int(os.environ.get("SPECKV_TEST_THREADS", "1"))


@pytest.fixture(autouse=True)
def single_torch_thread() -> Iterator[None]:
    """Tiny models run fastest on one thread; on a shared 2-core CPU, two threads stall in
    spin-waits (10-40x slower steps). Restored after each test."""
    previous = torch.get_num_threads()
    torch.set_num_threads(TEST_TORCH_THREADS)
    yield
    torch.set_num_threads(previous)


@pytest.fixture
def run_prefill() -> Callable[..., ModelOutput]:
    """One request's whole prompt through a model in one forward (tests/models helpers)."""
    from tests.models.speckv_model_test_utils import prefill

    return prefill


@pytest.fixture(scope="session")
def tiny_model() -> LlamaForCausalLM:
    """The shared tiny random Llama (`speckv.models.llama.tiny`); tests must not change it."""
    return build_tiny_model()


@pytest.fixture(scope="session")
def tiny_hybrid_gdn():
    """A tiny `hybrid-gdn`-shaped model (Gated DeltaNet + full attention, random init) and a
    random MTP drafter for it; tests must not change them."""
    from speckv.drafters.gated_mtp import random_gated_mtp
    from speckv.models.hybrid.loader import tiny_hybrid

    model = tiny_hybrid()
    return model, random_gated_mtp(model)


@pytest.fixture(scope="session")
def tiny_hybrid_swa():
    """A tiny `hybrid-swa`-shaped model (sliding window 8 + global layers, random init) and
    a random EAGLE drafter for it; tests must not change them."""
    from speckv.drafters.loaders import random_drafter
    from speckv.models.gemma.hybrid_swa import hybrid_swa_model

    model = hybrid_swa_model(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, sliding_window=8, num_hidden_layers=3,
        layer_types=("sliding_attention", "sliding_attention", "full_attention"),
        max_position_embeddings=512)
    return model, random_drafter("eagle", model, seed=0)


# ---- the cache world --------------------------------------------------------------------------
_request_ids = itertools.count()


class CacheWorld:
    """One single-group manager plus the hashing its requests use."""

    def __init__(self, block_size=4, num_blocks=64, drafter="eagle", num_modules=1,
                 legacy=False, algo="sha256", events=False, reuse=True):
        self.hash_mode = resolve_hash_mode(drafter_policy(drafter, num_modules),
                                           disable_lookahead_block_hashes=legacy,
                                           reuse_divergent_blocks=reuse)
        self.sink = KVEventSink() if events else None
        self.manager = KVCacheManager(
            [FullAttentionSpec(block_size)], num_blocks, self.hash_mode,
            hit_check=hit_check_for(get_hash_algo(algo)), event_sink=self.sink,
        )
        self.hashing = self.manager.block_hashing(algo, "0")
        self.block_size = block_size

    def request(self, prompt, max_tokens=8, **kwargs) -> Request:
        return Request(f"r{next(_request_ids)}", prompt, self.hashing, max_tokens=max_tokens,
                       **kwargs)


@pytest.fixture
def world_factory() -> type[CacheWorld]:
    return CacheWorld


# ---- KV events over ZeroMQ --------------------------------------------------------------------
@pytest.fixture
def endpoints() -> tuple[str, str]:
    """A (PUB, replay) pair of free loopback endpoints."""
    return loopback_endpoint(), loopback_endpoint()


@pytest.fixture
def make_publisher() -> Iterator[Callable[..., ZmqEventPublisher]]:
    made: list[ZmqEventPublisher] = []

    def make(**kwargs) -> ZmqEventPublisher:
        publisher = ZmqEventPublisher(PublisherConfig(**kwargs))
        made.append(publisher)
        return publisher

    yield make
    for publisher in made:
        publisher.shutdown()


# ---- the HTTP server ----------------------------------------------------------------------------
@pytest.fixture(scope="session")
def tiny_chat_model() -> LlamaForCausalLM:
    """The tiny model over the byte-level test tokenizer's vocabulary (server tests)."""
    from tests.server.server_test_utils import TINY_CONFIG

    return build_tiny_model(vocab_size=TINY_CONFIG.vocab_size,
                            max_position_embeddings=TINY_CONFIG.max_position_embeddings)


@pytest.fixture
def start_server(tiny_chat_model) -> Iterator[Callable[..., ServerThread]]:
    """Start a server (engine config, server options); stopped after the test."""
    from tests.server.server_test_utils import make_server

    started: list[ServerThread] = []

    def start(engine_config: EngineConfig | None = None, **server_config) -> ServerThread:
        thread = make_server(tiny_chat_model, engine_config, **server_config)
        started.append(thread)
        return thread

    yield start
    for thread in started:
        thread.stop()


@pytest.fixture(scope="module")
def shared_server(tiny_chat_model) -> Iterator[ServerThread]:
    """One server for the tests that only send requests (module scope: fast)."""
    from tests.server.server_test_utils import make_server

    thread = make_server(tiny_chat_model)
    yield thread
    thread.stop()


@pytest.fixture
def client(shared_server) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{shared_server.url}/v1", api_key="unused",
                       max_retries=0, timeout=WATCHDOG_S) as client:
        yield client


@pytest.fixture
def http(shared_server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=shared_server.url, timeout=WATCHDOG_S) as client:
        yield client
