"""The cache contract: what `speckv serve` publishes (real in-process server, real HTTP), the
router's refusals naming the field, the hit rule it predicts with, and endpoint resolution."""

from __future__ import annotations

import copy

import httpx
import pytest

from speckv.api.contract import tokenizer_digest
from speckv.engine.engine_args import engine_config
from speckv.events.endpoints import loopback_endpoint
from speckv.router.contract import ContractError, HitRule, connect_endpoint, parse_contract
from tests.server.server_test_utils import TOKENIZER

URL = "http://10.0.0.7:8000"


def contract_body(**overrides):
    body = {
        "contract_version": 1, "engine_epoch": "e1", "served_model_name": "tiny",
        "model": "/m", "max_model_len": 512, "vocab_size": 259, "tokenizer": None,
        "prefix_caching": True, "block_size": 4, "alignment_tokens": 4, "hash_algo": "sha256",
        "hash_seed": "0",
        "hash_mode": {"label": "lookahead L=1", "lookahead_tokens": 1,
                      "drops_last_unit": False, "reason": ""},
        "kv_groups": [{"kind": "full_attention", "block_size": 4, "sliding_window": None,
                       "lookahead_tokens": 1}],
        "kv_events": {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
                      "topic": "", "hash_encoding": "bytes"},
        "num_blocks": 64,
    }
    for key, value in overrides.items():
        body[key] = value
    return body


def test_the_server_publishes_a_contract_the_router_reads(start_server):
    pub, replay = loopback_endpoint(), loopback_endpoint()
    thread = start_server(engine_config(block_size=4, num_blocks=64, hash_seed="7",
                                        kv_events_endpoint=pub, kv_events_replay_endpoint=replay),
                          api_key="k")
    assert httpx.get(f"{thread.url}/kv_cache_contract").status_code == 401
    body = httpx.get(f"{thread.url}/kv_cache_contract",
                     headers={"Authorization": "Bearer k"}).json()
    contract = parse_contract("a", thread.url, body)
    assert (contract.hashing.seed, contract.hashing.block_size, contract.hashing.algo) == \
        ("7", 4, "sha256")
    assert contract.hit_rule == HitRule(4, 0, False, True)  # no drafter: legacy, no drop
    assert contract.events_endpoint == pub and contract.replay_endpoint == replay
    assert contract.tokenizer == tokenizer_digest(TOKENIZER)
    assert len(contract.epoch) == 32


@pytest.mark.parametrize(("change", "field"), [
    ({"hash_seed": None}, "hash_seed"),
    ({"hash_algo": "md5"}, "hash_algo"),
    ({"contract_version": 2}, "contract_version"),
    ({"kv_events": None}, "kv_events"),
    ({"kv_events": {"endpoint": "tcp://*:1", "hash_encoding": "int"}}, "kv_events"),
    ({"kv_groups": [{"kind": "full_attention", "block_size": 4, "lookahead_tokens": 1},
                    {"kind": "sliding_window", "block_size": 4, "lookahead_tokens": 1}]},
     "kv_groups"),
    ({"alignment_tokens": 544}, "alignment_tokens"),
    ({"hash_mode": {"lookahead_tokens": 1, "drops_last_unit": True}}, "hash_mode"),
    ({"block_size": "4"}, "block_size"),
])
def test_an_irreproducible_contract_is_refused_naming_the_field(change, field):
    body = contract_body(**copy.deepcopy(change))
    with pytest.raises(ContractError) as raised:
        parse_contract("a", URL, body)
    assert raised.value.field == field
    assert f"engine 'a': cache contract field {field!r}" in str(raised.value)
    body = contract_body()
    del body["hash_seed"]
    with pytest.raises(ContractError, match="'hash_seed': missing"):
        parse_contract("a", URL, body)


def test_wildcard_event_endpoints_resolve_to_the_engine_host():
    contract = parse_contract("a", URL, contract_body())
    assert contract.events_endpoint == "tcp://10.0.0.7:5557"
    assert contract.replay_endpoint == "tcp://10.0.0.7:5558"
    assert connect_endpoint("tcp://10.1.1.1:9", URL) == "tcp://10.1.1.1:9"
    assert connect_endpoint("ipc:///tmp/x", URL) == "ipc:///tmp/x"


@pytest.mark.parametrize(("rule", "matched", "n", "cached"), [
    (HitRule(4, 1, False, True), 5, 21, 20),  # all 5 blocks, N - 1 = 20
    (HitRule(4, 1, False, True), 5, 20, 16),  # at most N - 1: 19 -> 16
    (HitRule(4, 0, True, True), 5, 21, 16),  # legacy drop: one block less
    (HitRule(4, 0, True, True), 0, 21, 0),  # nothing to drop
    (HitRule(4, 2, False, True), 3, 21, 12),  # L = 2: the prompt hash set bounds matched
    (HitRule(4, 1, False, False), 5, 21, 0),  # prefix caching off
])
def test_hit_rule(rule, matched, n, cached):
    assert rule.cached_tokens(matched, n) == cached
