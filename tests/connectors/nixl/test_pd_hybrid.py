"""Prefill/decode disaggregation of hybrid models (NIXL on loopback, per-group KV pools): a GDN
hybrid (full attention + Gated DeltaNet state) and a Gemma 3-style model (full attention +
sliding window), with MTP and EAGLE drafters.

Greedy output through P/D equals a single engine's, the decode engine hits what a local hit
would and READs only what that hit reads beyond its own local hit (every full block, the
window's blocks, the GDN state at the hit); the transferred target KV, draft KV, window and
GDN state are bit-equal to a cold run's, and a prefill engine with other weights is caught;
legacy hashes pull what a local hit would; a failed or expired transfer recomputes (or errors
under policy fail) with both pools clean and nothing of the failed load cached."""

from __future__ import annotations

import time

import pytest
import torch

from speckv.connectors.nixl.transport import nixl_available
from speckv.engine.sampling_params import SamplingParams
from tests.connectors.nixl.hybrid_helpers import (
    Hybrid,
    blocks_read,
    build_hybrids,
    gdn_model,
    hit_tensors,
    swa_model,
)
from tests.connectors.nixl.pd_helpers import (
    all_free,
    decode,
    make_engine,
    prefill,
    pulled_hit,
    run,
    settle,
    step_until,
)
from tests.patience import WATCHDOG_S

pytestmark = pytest.mark.skipif(not nixl_available(), reason="needs nixl-cu12")
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
CASES = [("gdn", "mtp2"), ("swa", "mtp2"), ("swa", "eagle3")]


@pytest.fixture(scope="module")
def hybrids() -> dict[str, Hybrid]:
    return build_hybrids()


def _engine(hybrid: Hybrid, drafter: str | None, role: str | None = None, **options):
    return make_engine(hybrid.model, hybrid.drafters[drafter] if drafter else None, role,
                       **{**hybrid.engine_options, **options})


@pytest.mark.parametrize(("name", "drafter"), CASES)
def test_greedy_output_through_pd_equals_a_single_engine(hybrids, name, drafter):
    hybrid = hybrids[name]
    prompts = [hybrid.prompt(47, seed=1), hybrid.prompt(21, seed=2)]
    with _engine(hybrid, drafter) as single:
        assert single.kv_budget.per_group_pools
        expected = [run(single, prompt, GREEDY) for prompt in prompts]
        local = [run(single, prompt, GREEDY) for prompt in prompts]  # local hits
    with _engine(hybrid, drafter, "kv_producer") as p, \
            _engine(hybrid, drafter, "kv_consumer") as d:
        loaded = 0
        for prompt, want, hit in zip(prompts, expected, local):
            first = prefill(p, prompt)
            params = first.kv_transfer_params
            assert len(params["block_ids"]) == 2 and not all_free(p)  # kept under the lease
            got = decode(d, prompt, params)
            assert got.token_ids == want.token_ids
            assert got.token_ids[0] == first.token_ids[0]
            # the transferred hit is the local hit: the longest prefix every group serves
            assert got.num_external_cached_tokens == got.num_cached_tokens \
                == hit.num_cached_tokens > 0
            loaded += blocks_read(d, got.num_cached_tokens)
            settle(p)  # the READ's notification released the lease
            assert all_free(p) and all_free(d)
        stats = d.kv_connector_stats()["nixl"]
        # only what each hit reads: full blocks, the window's blocks, one GDN state
        assert stats.load_failed_blocks == 0 and stats.loaded_blocks == loaded


@pytest.mark.exactness
@pytest.mark.parametrize(("name", "drafter"), [("gdn", "mtp2"), ("swa", "mtp2")])
def test_transferred_kv_draft_kv_and_state_equal_a_cold_run(hybrids, name, drafter):
    """The decode engine's hit (target KV of every group, draft KV, GDN conv + recurrent
    state) is bit-equal to a cold run's: the prefill engine ran the prompt in one step, as the
    cold engine does (same computation, same shapes). A prefill engine with other weights
    (same tokens, so the same hashes) is the stale control: the same check catches it."""
    hybrid = hybrids[name]
    prompt = hybrid.prompt(47, seed=3)
    other = gdn_model(seed=1) if name == "gdn" else swa_model(seed=9)

    def transferred(prefill_model) -> tuple[dict[str, torch.Tensor], int]:
        with make_engine(prefill_model, hybrid.drafters[drafter], "kv_producer",
                         **hybrid.engine_options) as p, \
                _engine(hybrid, drafter, "kv_consumer") as d:
            params = prefill(p, prompt).kv_transfer_params
            request_id, length = pulled_hit(d, prompt, params)
            tensors = hit_tensors(d, request_id, length)
            settle(d)
            settle(p)
            return tensors, length

    warm, length = transferred(hybrid.model)
    with _engine(hybrid, drafter) as cold_engine:
        request_id = cold_engine.add_request(prompt, SamplingParams(max_tokens=4,
                                                                    ignore_eos=True))
        cold_engine.step()
        cold = hit_tensors(cold_engine, request_id, length)
        settle(cold_engine)
    assert warm.keys() == cold.keys() and (name != "gdn" or "1.recurrent" in warm)
    for key in warm:
        assert warm[key].shape == cold[key].shape, key
        assert torch.equal(warm[key], cold[key]), f"{key} differs from a cold run"
    stale, _ = transferred(other)
    assert not torch.equal(stale["0.target"], cold["0.target"])
    assert not torch.equal(stale["draft"], cold["draft"])
    partial = "1.recurrent" if name == "gdn" else "1.target"
    assert not torch.equal(stale[partial], cold[partial])  # the state / the window


@pytest.mark.parametrize(("name", "drafter"), [("swa", "eagle"), ("gdn", "mtp1")])
def test_legacy_hashes_pull_what_a_local_hit_would(hybrids, name, drafter):
    hybrid = hybrids[name]
    prompt = hybrid.prompt(47, seed=4)
    legacy = {"disable_lookahead_block_hashes": True}
    with _engine(hybrid, drafter, **legacy) as single:
        expected = run(single, prompt, GREEDY)
        local = run(single, prompt, GREEDY)
    with _engine(hybrid, drafter, "kv_producer", **legacy) as p, \
            _engine(hybrid, drafter, "kv_consumer", **legacy) as d:
        params = prefill(p, prompt).kv_transfer_params
        got = decode(d, prompt, params)
        settle(p)
        assert d.kv_connector_stats()["nixl"].loaded_blocks == blocks_read(
            d, got.num_cached_tokens)
    assert params["hash_contract"]["lookahead_tokens"] == 0
    assert got.token_ids == expected.token_ids == local.token_ids
    assert got.num_external_cached_tokens == local.num_cached_tokens > 0


@pytest.mark.parametrize("name", ["gdn", "swa"])
def test_a_local_prefix_is_not_pulled_again(hybrids, name):
    hybrid = hybrids[name]
    shared = hybrid.prompt(18, seed=5)  # the lookahead of block 3 shared too
    prompt = shared + hybrid.prompt(29, seed=6)
    with _engine(hybrid, "mtp2") as single:
        expected = run(single, prompt, GREEDY)
    with _engine(hybrid, "mtp2", "kv_producer") as p, \
            _engine(hybrid, "mtp2", "kv_consumer") as d:
        run(d, shared + [1, 2, 3, 4, 5], GREEDY)  # the decode engine holds the prefix
        params = prefill(p, prompt).kv_transfer_params
        got = decode(d, prompt, params)
        settle(p)
        assert all_free(p)
        local = got.num_cached_tokens - got.num_external_cached_tokens
        assert local == 16 and got.num_cached_tokens == params["num_tokens"]
        # beyond the local hit: the full blocks, the window before the hit, one GDN state
        assert d.kv_connector_stats()["nixl"].loaded_blocks == blocks_read(
            d, got.num_cached_tokens, local)
    assert got.token_ids == expected.token_ids


@pytest.mark.parametrize("name", ["gdn", "swa"])
def test_a_failed_transfer_recomputes_or_fails_and_leaves_the_pools_clean(hybrids, name):
    """The lease expires before the READ is admitted, after the decode engine allocated the
    hit (and released the window / state blocks behind it): the request starts over from its
    local hit, nothing of the failed load is cached, and both pools end clean; under policy
    fail it ends with an error. A dead prefill engine ends in a local prefill."""
    hybrid = hybrids[name]
    shared = hybrid.prompt(17, seed=7)
    prompt = shared + hybrid.prompt(30, seed=8)
    with _engine(hybrid, "mtp2") as single:
        expected = run(single, prompt, GREEDY)
    short = {"transfer_options": {"kv_lease_s": 0.05}}
    with _engine(hybrid, "mtp2", "kv_consumer") as d, \
            _engine(hybrid, "mtp2", "kv_producer", **short) as p:
        run(d, shared + [1, 2, 3, 4, 5], GREEDY)  # a local prefix: the restart's hit
        params = prefill(p, prompt).kv_transfer_params
        time.sleep(0.1)
        settle(p)  # expired: the prefill engine freed the blocks on its own
        assert all_free(p)
        request_id = d.add_request(prompt, SamplingParams(max_tokens=8, ignore_eos=True,
                                                          kv_transfer_params=params))
        # the handshake succeeds, the READ is refused
        step_until(d, lambda: d.kv_connector_stats()["nixl"].load_failed_blocks)
        probe = d.add_request(prompt, SamplingParams(max_tokens=1))
        local = d.manager.get_computed_blocks(d.get_request(probe)).num_computed_tokens
        assert 0 < local < params["num_tokens"]  # nothing of the failed load is cached
        assert d.kv_connector_stats()["nixl"].load_failed_blocks == blocks_read(
            d, params["num_tokens"], local)
        outputs = {}
        while d.has_unfinished_requests():
            outputs.update({o.request_id: o for o in d.step() if o.finished})
            d.manager.check_integrity()
        got = outputs[request_id]
        assert got.token_ids == expected.token_ids and got.num_external_cached_tokens == 0
        assert got.num_cached_tokens == local and all_free(d)
        with _engine(hybrid, "mtp2", "kv_consumer", transfer_options={
                "kv_load_failure_policy": "fail"}) as failing:
            failed = decode(failing, prompt, params)  # the same expired lease
            assert failed.finish_reason == "error" and failed.token_ids == []
            assert all_free(failing)
    with _engine(hybrid, "mtp2", "kv_consumer", transfer_options={
            "kv_load_failure_policy": "fail", "kv_transfer_timeout_s": 0.5}) as d:
        p = _engine(hybrid, "mtp2", "kv_producer")
        params = prefill(p, prompt).kv_transfer_params
        p.close()  # dead before the pull: refused at the handshake, so policy fail errors
        failed = decode(d, prompt, params)
        assert failed.finish_reason == "error" and all_free(d)
    with _engine(hybrid, "mtp2", "kv_consumer",
                 transfer_options={"kv_transfer_timeout_s": 0.5}) as d:
        got = decode(d, prompt, params)  # recompute: a local prefill
        assert got.token_ids == expected.token_ids and got.num_external_cached_tokens == 0
        assert all_free(d)


def test_the_nixl_connector_carries_every_group_and_composes_with_the_cpu_tier(hybrids):
    """The capability says every group, so the engine takes it on a hybrid; beside the CPU
    tier (which carries the groups too) the answers stay a single engine's. (The tier does
    not save the GDN / window blocks of a range its sibling loaded (`sibling_loads`), so it
    serves that prompt again from what the decode engine computed itself.)"""
    from speckv.connectors.capability import kv_group_blocker
    from speckv.connectors.nixl.config import NixlConfig
    from speckv.connectors.nixl.connector import NixlConnector

    nixl = NixlConnector(NixlConfig("kv_consumer"), "sha256", "0")
    for kinds in (["full_attention", "mamba"], ["full_attention", "sliding_window"]):
        assert kv_group_blocker(nixl, kinds) is None
    hybrid = hybrids["gdn"]
    prompt = hybrid.prompt(47, seed=10)
    with _engine(hybrid, "mtp2") as single:
        expected = run(single, prompt, GREEDY)
    with _engine(hybrid, "mtp2", "kv_producer") as p, \
            _engine(hybrid, "mtp2", "kv_consumer", kv_connector="offload",
                    kv_offload_gib=0.01) as d:
        params = prefill(p, prompt).kv_transfer_params
        got = decode(d, prompt, params)
        settle(p)
        assert got.token_ids == expected.token_ids
        assert got.num_external_cached_tokens == params["num_tokens"]
        assert d.flush_kv_connector(timeout_s=WATCHDOG_S) and d.reset_prefix_cache()
        again = run(d, prompt, GREEDY)
        assert again.token_ids == expected.token_ids
        assert d.kv_connector_stats()["nixl"].loaded_blocks == blocks_read(
            d, params["num_tokens"])


@pytest.mark.parametrize("model", ["hybrid-gdn", "hybrid-swa"])
def test_serve_a_hybrid_model_as_a_prefill_engine(monkeypatch, capsys, model):
    """`speckv serve hybrid-gdn --kv-transfer-config ...` starts (it was refused before: the
    transfer did not carry the GDN / window groups)."""
    import speckv.server.launch as launch
    from speckv import cli

    monkeypatch.setattr(launch, "serve_forever", lambda server, sock, log_level="warning":
                        sock.close())
    code = cli.main(["serve", model, "--port", "0", "--kv-cache-memory-bytes", "64M",
                     "--threads", "1", "--hash-seed", "0", "--kv-transfer-config",
                     '{"kv_connector": "nixl", "kv_role": "kv_producer"}'])
    out = capsys.readouterr().out
    assert code == 0 and "KV budget" in out
    assert "KV transfer over NIXL, kv_producer" in out and "side channel 127.0.0.1:" in out
