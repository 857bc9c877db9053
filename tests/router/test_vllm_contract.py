"""A vLLM engine's contract as the router builds it (no vLLM needed): from its /metrics
(`vllm:cache_config_info` as vLLM 0.32 prints it) and /v1/models plus the `--vllm-*` flags;
vLLM's seed rule (PYTHONHASHSEED, else "vllm-none-hash" for sha256, refused for xxhash); the
EAGLE last-block drop for EAGLE-family methods only; the plugin's lookahead; flags the engine
contradicts refused naming both values, from its /metrics or its KV events; the CLI flags."""

from __future__ import annotations

import argparse

import pytest
from msgspec.structs import replace

from speckv.commands.router import add_arguments, parse_engines, with_vllm_flags
from speckv.events.schema import BlockStored, KVEventBatch
from speckv.hashing.formats import format_for
from speckv.hashing.functions import get_hash_algo, make_none_hash
from speckv.hashing.request_hasher import hash_prompt
from speckv.router.contract import ContractError
from speckv.router.fleet import EngineLink, EngineSpec, Fleet
from speckv.router.tokenizer import TokenizerCache
from speckv.router.vllm_engine import VLLM_DEFAULT_SEED, VLLMFlags, check_events, vllm_contract

URL = "http://10.0.0.9:8000"
EVENTS = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557",
          "replay_endpoint": "tcp://*:5558"}
MODELS = {"object": "list", "data": [{"id": "builtin", "root": "/nowhere/smollm2",
                                      "max_model_len": 1024}]}


def metrics(algo="sha256", block_size="32", speculates=False, prefix_caching="True"):
    text = (
        "# HELP process_start_time_seconds Start time.\n# TYPE process_start_time_seconds gauge\n"
        "process_start_time_seconds 1.79658756309e+09\n"
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        "# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{block_size="{block_size}",cache_dtype="auto",'
        f'enable_prefix_caching="{prefix_caching}",engine="0",hash_block_size="None",'
        f'num_gpu_blocks="704",prefix_caching_hash_algo="{algo}",sliding_window="None"}} 1.0\n'
        "# HELP vllm:num_requests_running Running.\n# TYPE vllm:num_requests_running gauge\n"
        'vllm:num_requests_running{engine="0",model_name="builtin"} 0.0\n')
    if speculates:
        text += ("# HELP vllm:spec_decode_num_drafts Drafts.\n"
                 "# TYPE vllm:spec_decode_num_drafts counter\n"
                 'vllm:spec_decode_num_drafts_total{engine="0",model_name="builtin"} 0.0\n')
    return text


def test_the_contract_from_metrics_models_and_flags():
    plain = vllm_contract("v", URL, metrics(), MODELS, VLLMFlags(EVENTS, "0"))
    assert (plain.hashing.algo, plain.hashing.seed, plain.hashing.block_size) == \
        ("sha256", "0", 32)
    assert not plain.hit_rule.drops_last_unit and plain.hash_mode_label == "legacy"
    assert plain.events_endpoint == "tcp://10.0.0.9:5557"  # the wildcard: the engine's host
    assert (plain.served_model_name, plain.max_model_len, plain.num_blocks) == \
        ("builtin", 1024, 704)
    assert plain.epoch == "vllm-1796587563.090"
    # an EAGLE-family drafter drops the last matched block: 4 blocks matched of N = 158 -> 96
    eagle = vllm_contract("v", URL, metrics(speculates=True), MODELS,
                          VLLMFlags(EVENTS, "0", {"method": "eagle3"}))
    assert eagle.hit_rule.drops_last_unit and eagle.hit_rule.cached_tokens(4, 158) == 96
    assert plain.hit_rule.cached_tokens(4, 158) == 128
    for method, drops in (("ngram", False), ("mtp", True), ("draft_model", False)):
        rule = vllm_contract("v", URL, metrics(speculates=True), MODELS,
                             VLLMFlags(EVENTS, "0", {"method": method})).hit_rule
        assert rule.drops_last_unit is drops, method
    kept = vllm_contract("v", URL, metrics(speculates=True), MODELS, VLLMFlags(
        EVENTS, "0", {"method": "eagle3", "disable_eagle_block_drop": True}))
    assert not kept.hit_rule.drops_last_unit
    # speckv's plugin: lookahead hashes, no drop
    plugin = vllm_contract("v", URL, metrics(speculates=True), MODELS,
                           VLLMFlags(EVENTS, "0", {"method": "eagle3"}, 1))
    assert plugin.hashing.lookahead_tokens == 1 and not plugin.hit_rule.drops_last_unit
    assert plugin.hash_mode_label == "lookahead L=1 (speckv plugin)"
    # vLLM's own seed when PYTHONHASHSEED is unset (sha256); none for xxhash
    default = vllm_contract("v", URL, metrics(), MODELS, VLLMFlags(EVENTS))
    assert default.hashing.seed == VLLM_DEFAULT_SEED
    with pytest.raises(ContractError, match=r"random per-process seed.*--vllm-hash-seed v=S"):
        vllm_contract("v", URL, metrics(algo="xxhash"), MODELS, VLLMFlags(EVENTS))
    off = vllm_contract("v", URL, metrics(prefix_caching="False"), MODELS, VLLMFlags(EVENTS))
    assert off.hit_rule.cached_tokens(4, 158) == 0


def test_flags_the_metrics_contradict_are_refused():
    with pytest.raises(ContractError, match="says method 'eagle3', but the engine does not"):
        vllm_contract("v", URL, metrics(), MODELS, VLLMFlags(EVENTS, "0", {"method": "eagle3"}))
    with pytest.raises(ContractError, match=r"the engine speculates.*--vllm-speculative-config"):
        vllm_contract("v", URL, metrics(speculates=True), MODELS, VLLMFlags(EVENTS, "0"))
    with pytest.raises(ContractError, match=r"'kv_events': no KV events.*--kv-events-config"):
        vllm_contract("v", URL, metrics(), MODELS, VLLMFlags(None, "0"))
    with pytest.raises(ContractError, match=r"prefix_caching_hash_algo.*'md5'"):
        vllm_contract("v", URL, metrics(algo="md5"), MODELS, VLLMFlags(EVENTS, "0"))
    with pytest.raises(ContractError, match=r"cache_config_info\.block_size"):
        vllm_contract("v", URL, metrics(block_size="x"), MODELS, VLLMFlags(EVENTS, "0"))
    with pytest.raises(ContractError, match="/v1/models"):
        vllm_contract("v", URL, metrics(), {"data": []}, VLLMFlags(EVENTS, "0"))


def root_event(tokens, seed, lookahead=0, block_size=32) -> KVEventBatch:
    algo = get_hash_algo("sha256")
    hashes = hash_prompt(algo, make_none_hash(algo, seed), block_size, format_for(lookahead),
                         tokens)
    n = len(tokens) // block_size - (1 if lookahead else 0)
    return KVEventBatch(ts=0.0, events=[BlockStored(
        block_hashes=hashes[:n], parent_block_hash=None, token_ids=tokens[:n * block_size],
        block_size=block_size, lora_id=None, medium="GPU", lora_name=None,
        lookahead_token_ids=[tokens[(i + 1) * block_size:(i + 1) * block_size + lookahead]
                             for i in range(n)] if lookahead else None)])


def test_a_seed_or_lookahead_the_events_contradict_is_refused_naming_both():
    tokens = list(range(1000, 1100))
    contract = vllm_contract("v", URL, metrics(), MODELS, VLLMFlags(EVENTS, "7"))
    check_events(contract, VLLMFlags(EVENTS, "7"), [root_event(tokens, "7")])  # agrees
    as_vllm = root_event(tokens, "0")  # vLLM sends an extra-keys entry per block
    as_vllm = KVEventBatch(0.0, [replace(as_vllm.events[0], extra_keys=[None, None, None])])
    with pytest.raises(ContractError, match="'hash_seed'"):
        check_events(contract, VLLMFlags(EVENTS, "7"), [as_vllm])
    check_events(contract, VLLMFlags(EVENTS, "7"), [])  # nothing to check yet
    with pytest.raises(ContractError, match=r"--vllm-hash-seed '7' does not reproduce.*"
                       "its first block 0x.*with seed '7' 0x.*seed '0' reproduces them"):
        check_events(contract, VLLMFlags(EVENTS, "7"), [root_event(tokens, "0")])
    with pytest.raises(ContractError, match="seed 'vllm-none-hash' reproduces them"):
        check_events(contract, VLLMFlags(EVENTS, "7"), [root_event(tokens, VLLM_DEFAULT_SEED)])
    with pytest.raises(ContractError, match="--vllm-lookahead-tokens 0, but the engine's KV "
                       "events carry 1 lookahead tokens"):
        check_events(contract, VLLMFlags(EVENTS, "7"), [root_event(tokens, "7", lookahead=1)])
    with pytest.raises(ContractError, match="blocks of 16 tokens, its /metrics say 32"):
        check_events(contract, VLLMFlags(EVENTS, "7"),
                     [root_event(tokens, "7", block_size=16)])


def test_the_vllm_cli_flags():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args([
        "--engine", "s=http://127.0.0.1:1", "--engine", "v=http://127.0.0.1:2",
        "--vllm-kv-events-config", 'v={"endpoint": "tcp://*:5557"}',
        "--vllm-hash-seed", "v=0", "--vllm-speculative-config", '{"method": "eagle3"}',
        "--vllm-lookahead-tokens", "v=1"])
    specs = {s.name: s for s in with_vllm_flags(parse_engines(args.engine, []), args)}
    assert specs["s"].vllm is None  # a speckv engine unless found to be vLLM's
    assert specs["s"].vllm_default == VLLMFlags(None, None, {"method": "eagle3"})
    assert specs["v"].vllm == VLLMFlags({"endpoint": "tcp://*:5557"}, "0", {"method": "eagle3"},
                                        1)
    for bad, message in ((["--vllm-hash-seed", "x=0"], "no --engine named 'x'"),
                         (["--vllm-lookahead-tokens", "v=-1"], "expected an integer L >= 0"),
                         (["--vllm-speculative-config", "v=[1]"], "expected a JSON object"),
                         (["--vllm-kv-events-config", "v={"], "not JSON")):
        args = parser.parse_args(["--engine", "v=http://127.0.0.1:2", *bad])
        with pytest.raises(ValueError, match=message):
            with_vllm_flags(parse_engines(args.engine, []), args)


def test_a_vllm_group_the_router_cannot_predict_is_refused_from_its_events():
    """A hybrid vLLM engine is predicted from the groups its events name
    (tests/router/test_vllm_hybrid.py); a kind the router does not know is refused at start
    and, at run time, takes the engine out of rotation until it restarts."""
    text = metrics().replace('sliding_window="None"', 'sliding_window="4096"')
    contract = vllm_contract("v", URL, text, MODELS, VLLMFlags(EVENTS, "0"))
    batch = root_event(list(range(1000, 1100)), "0")
    local = replace(batch.events[0], group_idx=1, kv_cache_spec_kind="chunked_local_attention")
    with pytest.raises(ContractError, match=r"group 1 of kind 'chunked_local_attention'"):
        check_events(contract, VLLMFlags(EVENTS, "0"), [batch, KVEventBatch(0.0, [local])])
    link = EngineLink(EngineSpec("v", URL), contract)
    fleet = Fleet([link], TokenizerCache("builtin"))  # --tokenizer: the model is elsewhere
    fleet.apply(link, 0, 0, batch)
    assert link.in_rotation
    fleet.apply(link, 0, 1, KVEventBatch(0.0, [local]))
    assert not link.in_rotation and "kv_groups" in fleet.state()["v"]["refused"]
    fleet.engine_healthy(link, contract, {})
    assert not link.in_rotation
    restarted = vllm_contract("v", URL, metrics().replace("1.79658756309e+09", "1.8e+09"),
                              MODELS, VLLMFlags(EVENTS, "0"))
    fleet.engine_healthy(link, restarted, {})
    assert link.in_rotation and link.epochs_seen == 2


def test_bench_route_vllm_flags_are_checked_before_anything_starts(tmp_path):
    from speckv.bench import route

    parser = argparse.ArgumentParser()
    route.add_arguments(parser)
    fake = tmp_path / "venv"
    (fake / "bin").mkdir(parents=True)
    with pytest.raises(ValueError, match=r"--vllm-venv .*no bin/vllm there"):
        route.run(parser.parse_args(["--vllm-venv", str(tmp_path / "nowhere")]))
    (fake / "bin" / "vllm").write_text("")
    with pytest.raises(ValueError, match="--vllm-venv runs the built-in model"):
        route.run(parser.parse_args(["--vllm-venv", str(fake), "--model", "/some/dir"]))
    from speckv.bench.vllm_fleet import VLLMEngine, eagle3_config

    engine = VLLMEngine(fake, tmp_path, speculative_config=eagle3_config(), plugin=True)
    flags = engine.router_flags("v")
    assert f"--engine=v={engine.url}" in flags and "--vllm-lookahead-tokens=v=1" in flags
    assert "VLLM_PLUGINS" not in engine.env() and "VLLM_PLUGINS" in VLLMEngine(fake, tmp_path).env()
    command = engine.command()
    assert command[command.index("--block-size") + 1] == "32"


def test_a_hash_held_by_two_vllm_blocks_stays_until_both_are_removed():
    """vLLM keeps several blocks under one hash (two requests computing one block at once,
    EAGLE's dropped last block recomputed) and publishes a BlockStored for each and a
    BlockRemoved when one is evicted: the hash stays held while a copy does."""
    from speckv.events.schema import BlockRemoved
    from speckv.router.index import RouterIndex

    contract = vllm_contract("v", URL, metrics(), MODELS, VLLMFlags(EVENTS, "0"))
    assert contract.hashing.counts_copies
    index = RouterIndex({"v": contract.hashing})
    stored = root_event(list(range(1000, 1100)), "0")
    event = stored.events[0]
    index.apply_batch("v", stored)
    index.apply_batch("v", stored)  # a second block of each hash
    last = event.block_hashes[-1]
    removed = KVEventBatch(0.0, [BlockRemoved(block_hashes=[last], medium="GPU")])
    index.apply_batch("v", removed)
    assert index.holds("v", 0, last)  # one copy left
    index.apply_batch("v", removed)
    assert not index.holds("v", 0, last)
    # a speckv engine stores one block per hash: its BlockRemoved removes it
    single = RouterIndex({"s": replace_config(contract.hashing)})
    single.apply_batch("s", stored)
    single.apply_batch("s", stored)
    single.apply_batch("s", removed)
    assert not single.holds("s", 0, last)


def replace_config(config):
    from dataclasses import replace as replace_dataclass

    return replace_dataclass(config, counts_copies=False)


def test_the_plugins_divergent_block_reuse_is_predicted():
    """With speckv's plugin (lookahead L = 1 under EAGLE3) vLLM reuses a block cached under
    another successor: a prompt diverging right after block j hits j * 32 + 32 - 1 (the route
    bench showed 191 = 5 * 32 + 31 reported)."""
    flags = VLLMFlags(EVENTS, "0", {"method": "eagle3"}, 1)
    contract = vllm_contract("v", URL, metrics(speculates=True), MODELS, flags)
    assert contract.hit_rule.reuses_divergent_blocks
    link = EngineLink(EngineSpec("v", URL, vllm=flags), contract)
    fleet = Fleet([link], TokenizerCache("builtin"))
    cached = list(range(1000, 1200))  # blocks 0..4 stored, each with its successor token
    fleet.apply(link, 0, 0, root_event(cached, "0", lookahead=1))
    diverging = cached[:160] + list(range(5000, 5021))  # block 4's successor differs
    plan = fleet.plan(diverging, ["v"])["v"]
    assert plan.published_cached_tokens == 4 * 32 + 32 - 1
    assert fleet.plan(cached[:181], ["v"])["v"].published_cached_tokens == 5 * 32
