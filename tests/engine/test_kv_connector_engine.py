"""The engine with KV tiers (tiny random models, real CPU and disk tiers): a hit from a tier
reads exactly the target and draft KV of a cold run, for EAGLE, EAGLE3 and MTP k=2; a stale
successor is never served; a load that fails part-way is recomputed, never served; preemption
right after a load; a disk tier survives a restart; events, resets and the API."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from speckv.bench.draft_kv import first_step_kv
from speckv.cache.block import make_cache_key
from speckv.cache.events import BlockStored
from speckv.connectors import ConnectorConfig, TierIdentity, make_connector
from speckv.connectors.disk import block_path
from speckv.drafters.loaders import random_drafter
from speckv.engine.engine_args import engine_config
from speckv.engine.llm import LLM
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.request import Request
from speckv.engine.sampling_params import SamplingParams
from speckv.engine.speculative import speculative_args
from speckv.simulation import instrument_tiers
from tests.patience import WATCHDOG_S

B = 4
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
DRAFTERS = [("eagle", {}), ("eagle3", {"aux_layers": (0, 1, 1)}), ("mtp", {"num_modules": 2})]
TIERS = ["offload", "disk", "offload,disk"]


@pytest.fixture(scope="module")
def drafters(tiny_model):
    return {name: random_drafter(name, tiny_model, init_std=0.2, seed=5, **kwargs)
            for name, kwargs in DRAFTERS}


def _prompt(length: int, seed: int = 0, vocab: int = 96) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(length)]


def _engine(model, drafter, tier: str | None = None, directory: Path | None = None,
            num_blocks: int = 64, connector=None, **overrides) -> LLMEngine:
    tiers = {} if tier is None else {
        "kv_connector": tier, "kv_offload_gib": 0.01, "kv_offload_disk_gib": 0.01,
        "kv_offload_dir": str(directory) if "disk" in tier else None,
    }
    # a fixed draft length: these tests count blocks step by step, and the adaptive policy
    # chooses its draft length from wall-clock timings
    overrides.setdefault("adaptive_speculation", False)
    config = engine_config(block_size=B, num_blocks=num_blocks, hash_seed="0",
                           **speculative_args(drafter, 2), **tiers, **overrides)
    return LLMEngine(model, config, drafter=drafter, detokenize=False, connector=connector)


def _run(engine: LLMEngine, prompts, params=GREEDY):
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    ids = [engine.add_request(prompt, p) for prompt, p in zip(prompts, params)]
    final = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
        engine.manager.check_integrity()
    return [final[request_id] for request_id in ids]


def _store_and_forget(engine: LLMEngine, prompt) -> None:
    """Run `prompt` cold, let the tiers settle, reset the local prefix cache."""
    _run(engine, [prompt])
    assert engine.flush_kv_connector(timeout_s=WATCHDOG_S)
    assert engine.reset_prefix_cache()


@pytest.mark.exactness
@pytest.mark.parametrize("tier", TIERS)
@pytest.mark.parametrize("name", [name for name, _ in DRAFTERS])
def test_a_tier_hit_reads_the_kv_of_a_cold_run(tiny_model, drafters, name, tier, tmp_path):
    drafter = drafters[name]
    prompt = _prompt(31, seed=3)
    with _engine(tiny_model, drafter, tier, tmp_path) as engine:
        _store_and_forget(engine, prompt)
        warm = first_step_kv(engine, prompt)
        stats = engine.kv_connector_stats()
    lookahead = drafter.policy.draft_kv_lookahead_tokens
    assert warm.num_tokens == warm.num_external_tokens == (31 - lookahead) // B * B
    with _engine(tiny_model, drafter) as cold_engine:
        cold = first_step_kv(cold_engine, prompt, warm.num_tokens)
    assert torch.equal(warm.target, cold.target), "target KV differs from a cold run"
    assert torch.equal(warm.draft, cold.draft), "draft KV differs from a cold run"
    assert sum(s.loaded_blocks for s in stats.values()) == warm.num_tokens // B
    assert all(s.load_failed_blocks == 0 for s in stats.values())


@pytest.mark.exactness
@pytest.mark.parametrize("tier", TIERS)
def test_greedy_outputs_with_tier_hits_equal_a_run_without_tiers(tiny_model, drafters, tier,
                                                                   tmp_path):
    drafter = drafters["eagle"]
    shared = _prompt(20, seed=1)
    prompts = []
    for n in (1, 3, 6, 9):  # each shares 5 blocks, then a filler evicts most of them
        prompts += [shared + _prompt(n, seed=10 + n), _prompt(28, seed=20 + n)]
    # a local cache that keeps everything, without the block reuse a tier engine does not do
    with _engine(tiny_model, drafter, disable_divergent_block_reuse=True) as plain:
        expected = []
        for prompt in prompts:
            expected += _run(plain, [prompt])
    # a local cache that holds about one request: evicted blocks come back from the tier
    with _engine(tiny_model, drafter, tier, tmp_path, num_blocks=12) as engine:
        outputs = []
        for prompt in prompts:
            outputs += _run(engine, [prompt])
    assert [o.token_ids for o in outputs] == [o.token_ids for o in expected]
    assert [o.num_cached_tokens for o in outputs] == [o.num_cached_tokens for o in expected]
    shared_runs = outputs[2::2]
    assert all(o.num_cached_tokens == 16 for o in shared_runs)  # block 5's successor differs
    assert all(0 < o.num_external_cached_tokens < 16 for o in shared_runs)  # local + tier
    for output in outputs:
        assert output.num_cached_tokens == (output.num_local_cached_tokens
                                            + output.num_external_cached_tokens)


@pytest.mark.exactness
def test_a_stale_successor_is_never_served_from_a_tier(tiny_model, drafters):
    drafter = drafters["eagle"]
    shared = _prompt(16, seed=4)  # 4 whole blocks
    first = shared + [7] + _prompt(8, seed=5)
    second = shared + [8] + _prompt(8, seed=5)  # same blocks, another successor of block 4
    with _engine(tiny_model, drafter, "offload") as engine:
        _store_and_forget(engine, first)
        warm = first_step_kv(engine, second)
    # the tier holds block [12, 16) keyed with successor 7: the second request cannot hit it
    assert warm.num_tokens == warm.num_external_tokens == 12
    with _engine(tiny_model, drafter) as cold_engine:
        cold = first_step_kv(cold_engine, second, warm.num_tokens)
    assert torch.equal(warm.target, cold.target) and torch.equal(warm.draft, cold.draft)


@pytest.mark.exactness
def test_a_tier_without_the_capability_puts_the_engine_on_the_legacy_drop(tiny_model, drafters):
    drafter = drafters["eagle"]
    shared = _prompt(16, seed=4)
    first = shared + [7] + _prompt(8, seed=5)
    second = shared + [8] + _prompt(8, seed=5)
    with _engine(tiny_model, drafter, "offload-nolookahead") as engine:
        assert engine.hash_mode.drops_last_unit
        assert "offload-nolookahead" in engine.hash_mode.reason
        _store_and_forget(engine, first)
        warm = first_step_kv(engine, second)
    # legacy hashes match all 4 shared blocks; the tier follows the drop and serves 3
    assert warm.num_tokens == warm.num_external_tokens == 12
    with _engine(tiny_model, drafter) as cold_engine:
        cold = first_step_kv(cold_engine, second, warm.num_tokens)
    assert torch.equal(warm.target, cold.target) and torch.equal(warm.draft, cold.draft)


def _failing_connector(tier: str, directory: Path, fail_block: int, prompt: list[int],
                       times: int = 1):
    """A connector whose loads fail at block `fail_block` of `prompt` (the first `times`
    loads of it), and the wrappers that count it."""
    config = ConnectorConfig.parse(tier, offload_gib=0.01, offload_dir=str(directory),
                                   disk_gib=0.01)
    connector = make_connector(config, TierIdentity("test", "sha256", "0"))
    target = tuple(prompt[fail_block * B:(fail_block + 1) * B])
    budget = [times]

    def fail(block) -> bool:
        if block.token_ids == target and budget[0] > 0:
            budget[0] -= 1
            return True
        return False

    return connector, instrument_tiers(connector, fail_load=fail, check_content=False)


@pytest.mark.parametrize("tier", ["offload", "disk"])
def test_a_load_failing_midway_recomputes_instead_of_serving_garbage(tiny_model, drafters,
                                                                     tier, tmp_path):
    drafter = drafters["eagle"]
    prompt = _prompt(30, seed=6)
    with _engine(tiny_model, drafter) as plain:
        (expected,) = _run(plain, [prompt])
    connector, stores = _failing_connector(tier, tmp_path, 3, prompt)
    with _engine(tiny_model, drafter, connector=connector) as engine:
        _store_and_forget(engine, prompt)
        (output,) = _run(engine, [prompt])
        stats = engine.kv_connector_stats()[connector.name]
    assert sum(store.num_injected_faults for store in stores) == 1
    assert output.token_ids == expected.token_ids
    # blocks 0-2 came from the tier; block 3 on were recomputed
    assert output.num_cached_tokens == output.num_external_cached_tokens == 3 * B
    assert stats.load_failed_blocks == 7 - 3 and stats.loaded_blocks == 3


@pytest.mark.exactness
def test_a_failed_load_leaves_no_hash_naming_garbage(tiny_model, drafters, tmp_path):
    """After a failed load, the recomputed blocks are what a later local hit reads."""
    drafter = drafters["eagle"]
    prompt = _prompt(30, seed=6)
    connector, _ = _failing_connector("offload", tmp_path, 2, prompt)
    with _engine(tiny_model, drafter, connector=connector) as engine:
        _store_and_forget(engine, prompt)
        _run(engine, [prompt])  # loads blocks 0-1, fails at 2, recomputes
        warm = first_step_kv(engine, prompt)  # a local hit now
    assert warm.num_tokens == 28 and warm.num_external_tokens == 0
    with _engine(tiny_model, drafter) as cold_engine:
        cold = first_step_kv(cold_engine, prompt, 28)
    # blocks 0-1: loaded, the bytes a run of the whole prompt wrote, as the cold run's
    loaded = 2 * B
    assert torch.equal(warm.target[:, :, :loaded], cold.target[:, :, :loaded])
    assert torch.equal(warm.draft[:, :, :loaded], cold.draft[:, :, :loaded])
    # blocks 2-6: recomputed by a forward over tokens 8-29 (22 rows), the cold run's covered 30:
    # equal within fp32 rounding (GEMM kernels round by row count); garbage would be O(1) off
    torch.testing.assert_close(warm.target, cold.target, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(warm.draft, cold.draft, atol=1e-5, rtol=1e-5)


def test_a_disk_file_corrupted_midway_is_a_counted_miss_and_recomputed(tiny_model, drafters,
                                                                      tmp_path):
    drafter = drafters["eagle"]
    prompt = _prompt(30, seed=8)
    with _engine(tiny_model, drafter) as plain:
        (expected,) = _run(plain, [prompt])
    with _engine(tiny_model, drafter, "disk", tmp_path) as engine:
        _store_and_forget(engine, prompt)
        assert len(list(tmp_path.glob("ns-*/*/*.kvb"))) == 8  # 36 tokens: 8 blocks
        hashes = Request("probe", prompt, engine.hashing).get_block_hashes(1)
        victim = block_path(engine.connector.store.directory, make_cache_key(hashes[4], 0))
        whole = victim.read_bytes()
        victim.write_bytes(whole[:-10])  # truncated: block 4 of 7
        (output,) = _run(engine, [prompt])
        stats = engine.kv_connector_stats()["disk"]
        assert engine.flush_kv_connector(timeout_s=WATCHDOG_S)
        assert victim.read_bytes() == whole  # recomputed and stored again
    assert output.token_ids == expected.token_ids
    assert output.num_cached_tokens == output.num_external_cached_tokens == 4 * B
    assert stats.corrupt_blocks == 1 and stats.load_failed_blocks == 3


def test_preemption_right_after_a_tier_load(tiny_model, drafters):
    """The step after a request loaded from the tier, the cache is full and it is preempted;
    it comes back and its output equals a run without tiers. Likewise when its load failed
    part-way and it is preempted before recomputing the failed blocks."""
    drafter = drafters["eagle"]
    long_prompt, tiered = _prompt(10, seed=11), _prompt(26, seed=12)
    long_params = SamplingParams(max_tokens=34, ignore_eos=True)  # 12 blocks at the end
    with _engine(tiny_model, drafter) as plain:
        expected = [o.token_ids for o in _run(plain, [long_prompt, tiered],
                                              [long_params, GREEDY])]
    for fail_times in (0, 1):
        connector, _ = _failing_connector("offload", Path("."), 4, tiered, times=fail_times)
        with _engine(tiny_model, drafter, connector=connector, num_blocks=13) as engine:
            _store_and_forget(engine, tiered)
            engine.add_request(long_prompt, long_params, request_id="long")
            final = {}
            for step in range(200):
                if step == 6:  # the long request decodes; the tiered one takes the last blocks
                    engine.add_request(tiered, GREEDY, request_id="tiered")
                for output in engine.step():
                    if output.finished:
                        final[output.request_id] = output
                engine.manager.check_integrity()
                if step == 6:
                    loader = engine.get_request("tiered")
                    assert loader.num_external_cached_tokens == (16 if fail_times else 24)
                    assert loader.num_computed_tokens == (16 if fail_times else 26)
                if step == 7:  # the long request needs a block: the loader is preempted
                    assert engine.get_request("tiered").num_preemptions == 1
                if not engine.has_unfinished_requests():
                    break
            stats = engine.kv_connector_stats()["offload"]
        assert [final["long"].token_ids, final["tiered"].token_ids] == expected
        assert stats.load_failed_blocks == (2 if fail_times else 0)


@pytest.mark.exactness
def test_the_disk_tier_survives_a_restart(tiny_model, drafters, tmp_path):
    drafter = drafters["mtp"]
    prompt = _prompt(33, seed=9)
    with _engine(tiny_model, drafter, "disk", tmp_path) as first:
        _run(first, [prompt])  # close() settles every store
    with _engine(tiny_model, drafter, "disk", tmp_path) as second:
        warm = first_step_kv(second, prompt)
    assert warm.num_tokens == warm.num_external_tokens == (33 - 2) // B * B
    with _engine(tiny_model, drafter) as cold_engine:
        cold = first_step_kv(cold_engine, prompt, warm.num_tokens)
    assert torch.equal(warm.target, cold.target) and torch.equal(warm.draft, cold.draft)
    # another drafter: another namespace, no hit
    with _engine(tiny_model, drafters["eagle3"], "disk", tmp_path) as other:
        assert first_step_kv(other, prompt).num_external_tokens == 0


def test_tier_events_carry_their_medium(tiny_model, drafters, tmp_path):
    published = []

    class Sink:
        def publish(self, events):
            published.extend(events)

    config = engine_config(block_size=B, num_blocks=64, hash_seed="0", kv_connector="offload,disk",
                           kv_offload_gib=0.01, kv_offload_dir=str(tmp_path),
                           kv_offload_disk_gib=0.01, **speculative_args(drafters["eagle"], 2))
    with LLMEngine(tiny_model, config, drafter=drafters["eagle"], detokenize=False,
                   event_publisher=Sink()) as engine:
        _run(engine, [_prompt(21)])
        assert engine.flush_kv_connector(timeout_s=WATCHDOG_S)
        engine.add_request(_prompt(5, seed=2), GREEDY)
        engine.step()  # the tiers' events of the flushed stores go out with this step
        saved = engine.kv_connector_stats()["offload"].saved_blocks
    media = {getattr(event, "medium", None) for event in published}
    assert {"GPU", "CPU", "DISK"} <= media
    stored = [e for e in published if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert saved > 0 and sum(len(e.block_hashes) for e in stored) == saved
    assert all(e.lookahead_token_ids is not None for e in stored)


def test_reset_prefix_cache_can_clear_the_tiers_too(tiny_model, drafters, tmp_path):
    prompt = _prompt(21, seed=2)
    with _engine(tiny_model, drafters["eagle"], "offload,disk", tmp_path) as engine:
        _store_and_forget(engine, prompt)
        (hit,) = _run(engine, [prompt])
        assert hit.num_external_cached_tokens == 20
        assert engine.flush_kv_connector(timeout_s=WATCHDOG_S)
        assert engine.reset_prefix_cache(reset_connector=True)
        (miss,) = _run(engine, [prompt])
        assert miss.num_cached_tokens == 0
        assert set(engine.kv_connector_stats()) == {"offload", "disk"}


def test_the_llm_api_with_a_tier(tiny_model):
    prompt = _prompt(25, seed=13)
    with LLM(tiny_model, block_size=B, num_blocks=64, hash_seed="0", kv_connector="offload",
             kv_offload_gib=0.01) as llm:
        (cold,) = llm.generate([prompt], GREEDY)
        assert llm.engine.flush_kv_connector(timeout_s=WATCHDOG_S)
        assert llm.reset_prefix_cache()
        (warm,) = llm.generate([prompt], GREEDY)
    assert cold.num_cached_tokens == 0
    assert warm.num_external_cached_tokens == warm.num_cached_tokens == 24
    assert warm.num_local_cached_tokens == 0
    assert warm.token_ids == cold.token_ids


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kv_connector": "tape"}, "unknown connector 'tape'"),
    ({"kv_connector": "disk"}, "needs --kv-offload-dir"),
    ({"kv_offload_dir": "/tmp/x"}, "kv_offload_dir needs kv_connector"),
    ({"kv_connector": "offload", "kv_offload_gib": 0}, "--kv-offload-gib must be"),
    ({"kv_connector": "offload", "enable_prefix_caching": False}, "enable_prefix_caching"),
    ({"kv_connector": "offload,offload"}, "twice"),
])
def test_bad_connector_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        engine_config(**kwargs)


def test_a_disk_tier_refuses_a_random_hash_seed(monkeypatch, tmp_path):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    with pytest.raises(ValueError, match="PYTHONHASHSEED"):
        engine_config(kv_connector="disk", kv_offload_dir=str(tmp_path))
    engine_config(kv_connector="disk", kv_offload_dir=str(tmp_path), hash_seed="0")
    engine_config(kv_connector="offload")  # a CPU tier lives and dies with the process


# ---- the shared store tier (Valkey), through the engine ----------------------------------------
@pytest.mark.parametrize("name", ["eagle", "mtp"])
def test_a_store_hit_reads_the_kv_of_a_cold_run(tiny_model, drafters, name):
    drafter = drafters[name]
    prompt = _prompt(31, seed=4)
    with _engine(tiny_model, drafter, "store", kv_store_gib=0.05) as engine:
        _store_and_forget(engine, prompt)
        warm = first_step_kv(engine, prompt)
    lookahead = drafter.policy.draft_kv_lookahead_tokens
    assert warm.num_tokens == warm.num_external_tokens == (31 - lookahead) // B * B
    with _engine(tiny_model, drafter) as cold_engine:
        cold = first_step_kv(cold_engine, prompt, warm.num_tokens)
    assert torch.equal(warm.target, cold.target) and torch.equal(warm.draft, cold.draft)


def test_two_engines_share_one_store(tiny_model, drafters):
    from speckv.connectors.embedded_valkey import EmbeddedValkey

    drafter = drafters["eagle"]
    prompts = [_prompt(23, seed=s) for s in range(3)]
    server = EmbeddedValkey(64 * 1024**2).start()
    try:
        with _engine(tiny_model, drafter, "store", kv_store_url=server.url) as first:
            expected = [o.token_ids for o in _run(first, prompts)]
            assert first.flush_kv_connector(timeout_s=WATCHDOG_S)
        with _engine(tiny_model, drafter, "store", kv_store_url=server.url) as second:
            outputs = _run(second, prompts)
    finally:
        server.stop()
    assert [o.token_ids for o in outputs] == expected
    assert all(o.num_external_cached_tokens == (23 - 1) // B * B for o in outputs)
