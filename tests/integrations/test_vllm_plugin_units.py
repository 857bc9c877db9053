"""The vLLM plugin's parts that need no vLLM: the decision table, the version check, the
request hasher against speckv's own, and the divergence index."""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from speckv.hashing.extra_keys import HashInputs, LoRARef, MultiModalItem
from speckv.hashing.formats import format_for
from speckv.hashing.functions import get_hash_algo, make_none_hash
from speckv.hashing.request_hasher import hash_prompt
from speckv.integrations.vllm import register
from speckv.integrations.vllm.decision import SWITCH_ENV, decide
from speckv.integrations.vllm.entry_point import write_entry_point_dir
from speckv.integrations.vllm.hasher import LookaheadBlockHasher
from speckv.integrations.vllm.patches import version_supported
from speckv.integrations.vllm.reuse import SuccessorIndex, divergent_source, index_of

SHA256 = get_hash_algo("sha256")
NONE_HASH = make_none_hash(SHA256, "0")


@pytest.mark.parametrize(("method", "prefill_lookahead", "expected"), [
    ("eagle", 1, 1), ("eagle3", 1, 1), ("mtp", 1, 1), ("mtp", 3, 3),
    ("dflash", 1, 0), ("dspark", 1, 0), ("ngram", 0, 0), ("draft_model", 0, 0),
    (None, 0, 0), ("suffix", 0, 0),
])
def test_the_plugin_follows_speckvs_drafter_table(method, prefill_lookahead, expected):
    decision = decide(method, prefill_lookahead, enable_prefix_caching=True,
                      has_kv_connector=False)
    assert decision.lookahead_tokens == expected
    assert decision.active is (expected > 0)


def test_prefix_caching_off_a_kv_connector_or_the_switch_leave_vllm_alone(monkeypatch):
    assert not decide("eagle3", 1, enable_prefix_caching=False, has_kv_connector=False).active
    with_connector = decide("eagle3", 1, enable_prefix_caching=True, has_kv_connector=True)
    assert not with_connector.active and "KV connector" in with_connector.reason
    monkeypatch.setenv(SWITCH_ENV, "0")
    assert not decide("eagle3", 1, enable_prefix_caching=True, has_kv_connector=False).active


@pytest.mark.parametrize(("version", "supported"), [
    ("0.32.0", True), ("0.32.0+cpu", True), ("0.33.1", True), ("0.31.9", False),
    ("0.34.0", False), ("1.32.0", False), ("unknown", False),
])
def test_version_check(version, supported):
    assert version_supported(version) is supported


def _request(tokens: list[int], **fields) -> SimpleNamespace:
    """The attributes of vLLM's Request the hasher reads."""
    request = SimpleNamespace(block_hashes=[], _all_token_ids=list(tokens), lora_request=None,
                              mm_features=None, cache_salt=None, prompt_embeds=None)
    for name, value in fields.items():
        setattr(request, name, value)
    return request


def _feed(hasher: LookaheadBlockHasher, request: SimpleNamespace) -> None:
    request.block_hashes.extend(hasher(request))


@pytest.mark.parametrize("lookahead", [1, 3])
def test_hashes_equal_speckvs_hasher_as_tokens_arrive(lookahead):
    tokens = [(7 * i) % 5000 + 3 for i in range(301)]
    hasher = LookaheadBlockHasher("sha256", NONE_HASH, 16, lookahead)
    request = _request(tokens[:100])
    _feed(hasher, request)
    assert len(request.block_hashes) == (100 - lookahead) // 16
    for token in tokens[100:]:  # one sampled token at a time, as vLLM appends them
        request._all_token_ids.append(token)
        _feed(hasher, request)
    assert request.block_hashes == hash_prompt(SHA256, NONE_HASH, 16, format_for(lookahead),
                                               tokens)


def test_extra_keys_come_from_the_request_as_speckv_tags_them():
    tokens = list(range(500, 600))
    lora = SimpleNamespace(lora_name="adapter", lora_path="/adapters/a")
    image = SimpleNamespace(identifier="img-1",
                            mm_position=SimpleNamespace(offset=20, length=30))
    request = _request(tokens, lora_request=lora, mm_features=[image], cache_salt="salt")
    _feed(LookaheadBlockHasher("sha256_cbor", NONE_HASH, 16, 1), request)
    inputs = HashInputs(lora=LoRARef("adapter", "/adapters/a"),
                        mm_items=(MultiModalItem("img-1", 20, 30),), cache_salt="salt")
    expected = hash_prompt(get_hash_algo("sha256_cbor"), NONE_HASH, 16, format_for(1), tokens,
                           inputs)
    assert request.block_hashes == expected
    plain = hash_prompt(get_hash_algo("sha256_cbor"), NONE_HASH, 16, format_for(1), tokens)
    assert all(a != b for a, b in zip(expected, plain))  # LoRA keys every block


def test_prompt_embeddings_hash_the_bytes_of_each_row_span():
    embeds = torch.arange(40 * 8, dtype=torch.bfloat16).reshape(40, 8)
    request = _request([0] * 40, prompt_embeds=embeds)
    _feed(LookaheadBlockHasher("sha256", NONE_HASH, 16, 1), request)
    rows = embeds.contiguous().view(torch.uint8).reshape(40, -1).numpy()
    expected = hash_prompt(SHA256, NONE_HASH, 16, format_for(1), [0] * 40,
                           HashInputs(prompt_embeds=np.ascontiguousarray(rows)))
    assert request.block_hashes == expected and len(expected) == 2


def _block(block_hash: bytes) -> SimpleNamespace:
    return SimpleNamespace(block_hash=block_hash, is_null=False)


def test_successor_index_drops_blocks_that_were_evicted_or_recached():
    index = SuccessorIndex(max_entries=8)
    block = _block(b"h1")
    index.record(b"parent", (1, 2), block)
    assert index.find(b"parent", (1, 2)) is block
    assert index.find(b"parent", (1, 3)) is None
    block.block_hash = None  # evicted
    assert index.find(b"parent", (1, 2)) is None
    live = [_block(bytes([i])) for i in range(20)]
    for i, live_block in enumerate(live):
        index.record(b"p", (i,), live_block)
    assert len(index._entries) <= 8
    assert index.find(b"p", (19,)) is live[-1]


def test_a_divergent_source_needs_a_block_ending_by_the_prompts_last_token():
    pool = SimpleNamespace(num_gpu_blocks=10)
    tokens = list(range(100, 150))
    chain = hash_prompt(SHA256, NONE_HASH, 16, format_for(1), tokens)
    source = _block(b"cached-under-another-successor")
    index_of(pool).record(chain[0], tuple(tokens[16:32]), source)
    request = _request(tokens, block_hashes=chain[:1])
    request.num_tokens = len(tokens)
    request.all_token_ids = tokens
    assert divergent_source(pool, request, 16, 16, 1, NONE_HASH) is source
    assert divergent_source(pool, request, 15, 16, 1, NONE_HASH) is None  # not at a boundary
    short = _request(tokens[:32], block_hashes=chain[:1])
    short.num_tokens, short.all_token_ids = 32, tokens[:32]
    assert divergent_source(pool, short, 16, 16, 1, NONE_HASH) is None  # block 1 ends at N
    salted = _request(tokens, block_hashes=chain[:1], cache_salt="s")
    salted.num_tokens, salted.all_token_ids = len(tokens), tokens
    assert divergent_source(pool, salted, 16, 16, 1, NONE_HASH) is None


def test_the_entry_point_folder_names_pyprojects_plugin_entry_point(tmp_path):
    root = write_entry_point_dir(tmp_path / "entry-point")
    assert write_entry_point_dir(root) == root  # rewritten in place, as a second start does
    (dist,) = importlib.metadata.distributions(path=[str(root)])
    project = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    assert (dist.metadata["Name"], dist.version) == ("speckv", project["project"]["version"])
    plugins = dist.entry_points.select(group="vllm.general_plugins")
    declared = project["project"]["entry-points"]["vllm.general_plugins"]
    assert {ep.name: ep.value for ep in plugins} == declared
    (plugin,) = plugins
    assert plugin.load() is register
