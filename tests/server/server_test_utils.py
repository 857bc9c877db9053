"""Helpers for server tests (imported by module name: tests are not a package): a tiny random
Llama with a real byte-level tokenizer and chat template, a server on a free loopback port,
calls into its engine loop, and reading /metrics."""

from __future__ import annotations

from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from speckv.engine.config import EngineConfig
from speckv.engine.engine_args import engine_config as make_engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.models import LlamaForCausalLM
from speckv.models.common.tokenizer import Tokenizer
from speckv.models.llama.tiny import tiny_model_config
from speckv.server.app import OpenAIServer, ServerConfig
from speckv.server.launch import ServerThread
from tests.patience import WATCHDOG_S, wait_until

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
# the shared tiny shape with the tokenizer's vocabulary and a longer context
TINY_CONFIG = tiny_model_config(vocab_size=TOKENIZER.vocab_size, max_position_embeddings=512)


def make_server(model: LlamaForCausalLM, engine_config: EngineConfig | None = None,
                connector=None, **server_config) -> ServerThread:
    """A server over a fresh engine (`connector`: a KV connector instance for it)."""
    engine = LLMEngine(model, engine_config or make_engine_config(
        block_size=4, num_blocks=512, max_num_seqs=16, hash_seed="0"),
                       TOKENIZER, connector=connector)
    config = ServerConfig(served_model_name=MODEL_NAME, **server_config)
    return ServerThread(OpenAIServer(engine, config, model_path="tiny-random")).start()


def engine_call(thread: ServerThread, fn: Callable[[LLMEngine], object]) -> object:
    """Run `fn(engine)` in the server's engine loop thread (between steps) and return it."""
    return thread.server.client.loop.call(fn).result(WATCHDOG_S)


def wait_idle_and_check(thread: ServerThread) -> int:
    """Wait until the engine holds no request, check the pool, return its free blocks."""
    wait_until(lambda: not engine_call(thread, lambda engine: engine.has_unfinished_requests()),
               "the engine goes idle", poll_s=0.02)

    def check(engine: LLMEngine) -> int:
        engine.manager.check_integrity()
        return engine.manager.get_num_free_blocks()

    return int(engine_call(thread, check))  # type: ignore[arg-type]


def scrape(base_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of GET /metrics: (name, sorted labels) -> value."""
    response = httpx.get(f"{base_url}/metrics", timeout=WATCHDOG_S)
    assert response.status_code == 200
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def value(samples, name: str, **labels: str) -> float:
    """The sample `name` with `labels` (model_name / engine are matched loosely: any)."""
    found = [v for (n, ls), v in samples.items()
             if n == name and all(dict(ls).get(k) == want for k, want in labels.items())]
    assert len(found) == 1, f"{name} {labels}: {len(found)} samples"
    return found[0]
