"""Prefill/decode disaggregation between two engines (tiny random models, NIXL on loopback):
greedy output equals a single engine's for no drafter, EAGLE3 and MTP k=2; the decode engine's
transferred KV (target and draft) equals a cold run's; legacy hashes recompute the last block
as a local hit would; a local prefix is not pulled again; faults end in a correct answer or,
under policy fail, in an error; blocks are freed on both sides."""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from speckv.bench.draft_kv import first_step_kv, kv_at, target_kv
from speckv.connectors.nixl.transport import nixl_available
from speckv.drafters.loaders import random_drafter
from speckv.engine.sampling_params import SamplingParams
from tests.connectors.nixl.pd_helpers import (
    B,
    all_free,
    decode,
    make_engine,
    prefill,
    prompt_of,
    pulled_hit,
    run,
    settle,
)
from tests.patience import WATCHDOG_S

pytestmark = pytest.mark.skipif(not nixl_available(), reason="needs nixl-cu12")
DRAFTERS = {"none": None, "eagle3": ("eagle3", {"aux_layers": (0, 1, 1)}),
            "mtp2": ("mtp", {"num_modules": 2})}
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def drafters(tiny_model):
    return {name: None if spec is None else
            random_drafter(spec[0], tiny_model, init_std=0.2, seed=5, **spec[1])
            for name, spec in DRAFTERS.items()}


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_output_through_pd_equals_a_single_engine(tiny_model, drafters, name):
    drafter = drafters[name]
    prompts = [prompt_of(31, seed=1), prompt_of(18, seed=2)]
    with make_engine(tiny_model, drafter) as single:
        expected = [run(single, prompt, GREEDY) for prompt in prompts]
    with make_engine(tiny_model, drafter, "kv_producer") as p, \
            make_engine(tiny_model, drafter, "kv_consumer") as d:
        for prompt, want in zip(prompts, expected):
            first = prefill(p, prompt)
            params = first.kv_transfer_params
            assert params is not None and params["first_token_id"] == first.token_ids[0]
            assert not all_free(p)  # kept under the lease
            got = decode(d, prompt, params)
            assert got.token_ids == want.token_ids
            assert got.token_ids[0] == first.token_ids[0]
            # everything a local hit could cover came over NIXL
            assert got.num_external_cached_tokens == got.num_cached_tokens \
                == want.num_cached_tokens + params["num_tokens"] - want.num_cached_tokens
            settle(p)  # the READ's notification released the lease
            assert all_free(p) and all_free(d)
        stats = d.kv_connector_stats()["nixl"]
        assert stats.load_failed_blocks == 0 and stats.loaded_blocks > 0


@pytest.mark.exactness
@pytest.mark.parametrize("name", ["eagle3", "mtp2"])
def test_the_decode_engines_transferred_kv_equals_a_cold_run(tiny_model, drafters, name):
    drafter = drafters[name]
    prompt = prompt_of(31, seed=3)
    with make_engine(tiny_model, drafter, "kv_producer") as p, \
            make_engine(tiny_model, drafter, "kv_consumer") as d:
        params = prefill(p, prompt).kv_transfer_params
        request_id, length = pulled_hit(d, prompt, params)
        warm_target = target_kv(d, request_id, length)
        warm_draft = kv_at(d.proposer.kv_cache,
                           d.runner.block_table(request_id, d.runner.draft_group), length, B)
        settle(d)
        settle(p)
    with make_engine(tiny_model, drafter) as cold_engine:
        cold = first_step_kv(cold_engine, prompt, length)
    # the prefill engine ran the same prompt in one step as the cold engine: same shapes
    assert torch.equal(warm_target, cold.target), "target KV differs from a cold run"
    assert torch.equal(warm_draft, cold.draft), "draft KV differs from a cold run"


def test_legacy_hashes_recompute_the_last_block_like_a_local_hit(tiny_model, drafters):
    drafter = drafters["eagle3"]
    prompt = prompt_of(31, seed=4)
    legacy = {"disable_lookahead_block_hashes": True}
    with make_engine(tiny_model, drafter, **legacy) as single:
        expected = run(single, prompt, GREEDY)
        local = run(single, prompt, GREEDY)  # a local hit: one block short of the run
    with make_engine(tiny_model, drafter, "kv_producer", **legacy) as p, \
            make_engine(tiny_model, drafter, "kv_consumer", **legacy) as d:
        params = prefill(p, prompt).kv_transfer_params
        got = decode(d, prompt, params)
        settle(p)
    assert params["hash_contract"]["drops_last_unit"]
    assert got.token_ids == expected.token_ids == local.token_ids
    assert got.num_external_cached_tokens == local.num_cached_tokens == params["num_tokens"] - B


def test_a_local_prefix_is_not_pulled_again(tiny_model, drafters):
    drafter = drafters["eagle3"]
    shared = prompt_of(16, seed=5)
    prompt = shared + prompt_of(15, seed=6)
    with make_engine(tiny_model, drafter) as single:
        expected = run(single, prompt, GREEDY)
    with make_engine(tiny_model, drafter, "kv_producer") as p, \
            make_engine(tiny_model, drafter, "kv_consumer") as d:
        run(d, shared + [1, 2, 3, 4, 5], GREEDY)  # the decode engine holds the prefix
        params = prefill(p, prompt).kv_transfer_params
        got = decode(d, prompt, params)
        settle(p)
        assert all_free(p)
    assert got.token_ids == expected.token_ids
    local = got.num_cached_tokens - got.num_external_cached_tokens
    assert local == 16 - B  # the lookahead block 3's successor differs: 3 blocks hit
    assert got.num_external_cached_tokens == params["num_tokens"] - local
    assert d.kv_connector_stats()["nixl"].loaded_blocks == (params["num_tokens"] - local) // B


def test_a_dead_prefill_engine_or_an_expired_lease_ends_in_a_local_prefill(tiny_model,
                                                                          drafters):
    drafter = drafters["eagle3"]
    prompt = prompt_of(31, seed=7)
    with make_engine(tiny_model, drafter) as single:
        expected = run(single, prompt, GREEDY)
    with make_engine(tiny_model, drafter, "kv_consumer",
                     transfer_options={"kv_transfer_timeout_s": 0.5}) as d:
        p = make_engine(tiny_model, drafter, "kv_producer")
        params = prefill(p, prompt).kv_transfer_params
        p.close()  # dead before the pull
        got = decode(d, prompt, params)
        assert got.token_ids == expected.token_ids and got.num_external_cached_tokens == 0
        with make_engine(tiny_model, drafter, "kv_producer",
                         transfer_options={"kv_lease_s": 0.05}) as p:
            params = prefill(p, prompt).kv_transfer_params
            time.sleep(0.1)
            settle(p)  # expired: the prefill engine freed the blocks on its own
            assert all_free(p)
            d.reset_prefix_cache()
            got = decode(d, prompt, params)
        assert got.token_ids == expected.token_ids and got.num_external_cached_tokens == 0
        assert all_free(d)


def test_a_silent_side_channel_times_out_and_policy_fail_errors(tiny_model, drafters):
    drafter = drafters["eagle3"]
    prompt = prompt_of(31, seed=8)
    with make_engine(tiny_model, drafter) as single:
        expected = run(single, prompt, GREEDY)
    context = zmq.Context.instance()
    silent = context.socket(zmq.ROUTER)  # accepts the handshake, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        with make_engine(tiny_model, drafter, "kv_producer") as p:
            params = dict(prefill(p, prompt).kv_transfer_params, port=port)
            options = {"kv_transfer_timeout_s": 0.3}
            with make_engine(tiny_model, drafter, "kv_consumer",
                             transfer_options=options) as d:
                got = decode(d, prompt, params)
                assert got.token_ids == expected.token_ids
                assert got.num_external_cached_tokens == 0
            options["kv_load_failure_policy"] = "fail"
            with make_engine(tiny_model, drafter, "kv_consumer",
                             transfer_options=options) as d:
                failed = decode(d, prompt, params)
                assert failed.finish_reason == "error"
                assert "no answer from the prefill" in failed.error
                assert failed.token_ids == [] and all_free(d)
    finally:
        silent.close(0)


def test_a_failed_transfer_is_never_cached(tiny_model, drafters):
    drafter = drafters["eagle3"]
    prompt = prompt_of(31, seed=9)
    with make_engine(tiny_model, drafter, "kv_producer") as p, \
            make_engine(tiny_model, drafter, "kv_consumer") as d:
        params = prefill(p, prompt).kv_transfer_params
        # the lease ends before the READ is admitted: the load of every block fails
        bad = dict(params, lease_id="0" * 24)
        d.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True,
                                             kv_transfer_params=bad))
        d.step()
        probe = d.add_request(prompt, SamplingParams(max_tokens=1, ignore_eos=True))
        hit = d.manager.get_computed_blocks(d.get_request(probe))
        assert hit.num_computed_tokens == 0  # no hash names a block of the failed load
        settle(d)
        stats = d.kv_connector_stats()["nixl"]
        assert stats.load_failed_blocks == params["num_tokens"] // B
        assert stats.loaded_blocks == 0


def test_the_decode_engine_composes_with_the_cpu_tier(tiny_model, drafters):
    drafter = drafters["eagle3"]
    prompt = prompt_of(31, seed=10)
    with make_engine(tiny_model, drafter) as single:
        expected = run(single, prompt, GREEDY)
    with make_engine(tiny_model, drafter, "kv_producer") as p, \
            make_engine(tiny_model, drafter, "kv_consumer", kv_connector="offload",
                        kv_offload_gib=0.01) as d:
        params = prefill(p, prompt).kv_transfer_params
        got = decode(d, prompt, params)
        settle(p)
        assert got.token_ids == expected.token_ids
        assert got.num_external_cached_tokens == params["num_tokens"]
        # the transferred blocks became ordinary blocks: the CPU tier stored them
        assert d.flush_kv_connector(timeout_s=WATCHDOG_S) and d.reset_prefix_cache()
        again = run(d, prompt, GREEDY)
        assert again.token_ids == expected.token_ids
        assert again.num_external_cached_tokens == params["num_tokens"]
        stats = d.kv_connector_stats()
        assert stats["offload"].loaded_blocks == params["num_tokens"] // B
        assert stats["nixl"].loaded_blocks == params["num_tokens"] // B
