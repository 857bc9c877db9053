"""Fixtures for server tests: a tiny random Llama with a real byte-level tokenizer and chat
template, served by uvicorn on a free loopback port (real sockets, the official clients)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import httpx
import openai
import pytest
import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from speckv.engine.config import EngineConfig
from speckv.engine.llm_engine import LLMEngine
from speckv.models import LlamaForCausalLM, ModelConfig
from speckv.models.tokenizer import Tokenizer
from speckv.server.app import OpenAIServer, ServerConfig
from speckv.server.launch import ServerThread

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{{ message['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MODEL_NAME = "tiny"


def tiny_tokenizer() -> Tokenizer:
    """Byte-level BPE without merges: one token per byte, plus the chat specials."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {char: index for index, char in enumerate(alphabet)}
    for special in SPECIALS:
        vocab[special] = len(vocab)
    backend = HFTokenizer(models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(list(SPECIALS))
    return Tokenizer(backend, eos_token_ids=(vocab["<|im_end|>"],),
                     chat_template=CHAT_TEMPLATE)


TOKENIZER = tiny_tokenizer()
TINY_CONFIG = ModelConfig(vocab_size=TOKENIZER.vocab_size, hidden_size=64, intermediate_size=128,
                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                          max_position_embeddings=512)


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


def make_server(model: LlamaForCausalLM, engine_config: EngineConfig | None = None,
                **server_config) -> ServerThread:
    engine = LLMEngine(model, engine_config or EngineConfig(block_size=4, num_blocks=512,
                                                            max_num_seqs=16, hash_seed="0"),
                       TOKENIZER)
    config = ServerConfig(served_model_name=MODEL_NAME, **server_config)
    return ServerThread(OpenAIServer(engine, config, model_path="tiny-random")).start()


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


def engine_call(thread: ServerThread, fn: Callable[[LLMEngine], object],
                timeout_s: float = 30.0) -> object:
    """Run `fn(engine)` in the server's engine loop thread (between steps) and return it."""
    return thread.server.client.loop.call(fn).result(timeout_s)


def wait_idle_and_check(thread: ServerThread, timeout_s: float = 30.0) -> int:
    """Wait until the engine holds no request, check the pool, return its free blocks."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        busy = engine_call(thread, lambda engine: engine.has_unfinished_requests())
        if not busy:
            break
        assert time.monotonic() < deadline, "the engine did not go idle"
        time.sleep(0.02)

    def check(engine: LLMEngine) -> int:
        engine.manager.check_integrity()
        return engine.manager.get_num_free_blocks()

    return int(engine_call(thread, check))  # type: ignore[arg-type]
