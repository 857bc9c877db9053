"""Hybrid models through every tier (CPU pool, disk, the store on a real Valkey): a prompt
served from the tier on a fresh engine hits as many tokens as the local cache would, and the
target KV, the drafter's KV, the sliding window's tail and the GDN state it reads equal a cold
run's, bit for bit (both sides computed the prompt in one forward of the same shape; the tier
copies bytes). A stale control shows the comparison catches a wrong state."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from speckv.bench.hybrid_tiers import group_reads
from speckv.connectors import DiskConnector, OffloadConnector, StoreConnector
from speckv.connectors.codec import CodecMiss, MissReason
from speckv.connectors.embedded_valkey import EmbeddedValkey
from speckv.connectors.offload import NoLookaheadOffloadConnector
from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import SamplingParams

B, UNIT, MIB = 4, 8, 1 << 20
TIERS = ("offload", "disk", "store")


@pytest.fixture(scope="module")
def valkey():
    with EmbeddedValkey(64 * MIB) as server:
        yield server


@dataclass
class Hybrid:
    """One hybrid model with its drafter, and the engines the tests build over it."""

    name: str
    model: object
    drafter: object
    method: str

    def engine(self, connector=None, **kw) -> LLMEngine:
        extra = {"mamba_block_size": UNIT} if self.name == "gdn" else {}
        config = engine_config(block_size=B, num_blocks=300, hash_seed="0",
                               speculative_method=self.method, num_spec_tokens=1,
                               max_num_batched_tokens=512, **extra, **kw)
        return LLMEngine(self.model, config, drafter=self.drafter, connector=connector)


@pytest.fixture(params=["gdn", "swa"])
def hybrid(request, tiny_hybrid_gdn, tiny_hybrid_swa) -> Hybrid:
    if request.param == "gdn":
        return Hybrid("gdn", *tiny_hybrid_gdn, "mtp")
    return Hybrid("swa", *tiny_hybrid_swa, "eagle")


def make_tier(kind: str, tmp_path, valkey, cls=None):
    ident = dict(model_fingerprint="tiny-hybrid", hash_algo="sha256", hash_seed="0")
    if kind == "offload":
        return (cls or OffloadConnector)(0.02)
    if kind == "disk":
        return DiskConnector(tmp_path / "kv", 0.05, **ident)
    return StoreConnector(valkey.url, 0.05, **ident)


def finish(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def first_step(engine: LLMEngine, prompt, request_id: str, max_tokens: int = 3):
    engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       request_id)
    while True:  # (a step whose load failed computes nothing for the request)
        outs = [o for o in engine.step() if o.request_id == request_id]
        if outs:
            return outs[0]


def serve_through_tier(hybrid: Hybrid, kind: str, tmp_path, valkey, prompt, *,
                       wrap=None, tier_cls=None):
    """(local hit on the warm engine, the fresh engine's first output, its reads at the
    hit, the cold run's reads there). The CPU tier lives in its engine's process, so its
    'fresh engine' is the warm one with the local prefix cache dropped; disk and store get a
    new engine (a new connector on the same directory / server)."""
    warm = hybrid.engine(make_tier(kind, tmp_path, valkey, tier_cls))
    first_step(warm, prompt, "first")
    finish(warm)
    local = first_step(warm, prompt, "local").num_cached_tokens
    finish(warm)
    assert warm.connector.flush(30)
    if kind == "offload":
        fresh = warm
        assert fresh.reset_prefix_cache()
    else:
        warm.close()
        fresh = hybrid.engine(make_tier(kind, tmp_path, valkey))
    if wrap is not None:
        for lane in fresh.connector.lanes:
            lane._store = wrap(lane._store, lane.mode)
            lane._worker.store = lane._store
    out = first_step(fresh, prompt, "fresh")
    reads = group_reads(fresh, "fresh", out.num_cached_tokens) if out.num_cached_tokens else {}
    cold = hybrid.engine()
    first_step(cold, prompt, "cold")
    cold_reads = (group_reads(cold, "cold", out.num_cached_tokens)
                  if out.num_cached_tokens else {})
    finish(fresh)
    fresh.manager.check_integrity()
    stats = fresh.kv_connector_stats()
    fresh.close()
    cold.close()
    return local, out, reads, cold_reads, stats


def prompt_of(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128) for _ in range(length)]


@pytest.mark.parametrize("kind", TIERS)
def test_a_fresh_engine_hits_through_the_tier_and_reads_the_cold_runs_kv_and_state(
        hybrid, kind, tmp_path, valkey):
    prompt = prompt_of(45)
    local, out, reads, cold_reads, stats = serve_through_tier(hybrid, kind, tmp_path, valkey,
                                                              prompt)
    # the local rule: (45 - 1) // U * U with U = 8 (GDN state unit) or 4 (one block)
    assert local == {"gdn": 40, "swa": 44}[hybrid.name] and out.num_cached_tokens == local
    expected = {"gdn": {"g0 target", "g0 draft", "g1 state"},
                "swa": {"g0 target", "g0 draft", "g1 target"}}[hybrid.name]
    assert set(reads) == expected
    for name, value in reads.items():
        assert value.shape == cold_reads[name].shape and torch.equal(value, cold_reads[name]), \
            name
    groups = stats[kind].extra["groups"]
    assert all(group["loaded_blocks"] > 0 for group in groups.values())
    # only what the hit reads: the GDN state at the hit (one block), the window's 2-block
    # tail before it (W = 8, B = 4: positions from hit - 7 on)
    loaded_partial = groups["1"]["loaded_blocks"]
    assert loaded_partial == (1 if hybrid.name == "gdn" else 2)


def _perturbed(store, mode):
    """A tier whose sliding-window / GDN blocks come back off by a little: what a stale or
    wrong state looks like to the comparison (the CPU pool checks no payload)."""
    if mode.group is None or mode.group.is_full:
        return store

    class Stale:
        def __getattr__(self, name):
            return getattr(store, name)

        def get(self, block):
            found = store.get(block)
            if isinstance(found, CodecMiss):
                return found
            return tuple(tensor + 1e-3 for tensor in found)

    return Stale()


def test_stale_control_a_wrong_state_or_window_is_caught(hybrid, tmp_path, valkey):
    _, out, reads, cold_reads, _ = serve_through_tier(hybrid, "offload", tmp_path, valkey,
                                                      prompt_of(45), wrap=_perturbed)
    assert out.num_cached_tokens == {"gdn": 40, "swa": 44}[hybrid.name]
    assert torch.equal(reads["g0 target"], cold_reads["g0 target"])
    assert not torch.equal(reads["g1 state" if hybrid.name == "gdn" else "g1 target"],
                           cold_reads["g1 state" if hybrid.name == "gdn" else "g1 target"])


@pytest.mark.parametrize("kind", TIERS)
def test_a_request_finishing_on_the_first_token_after_a_boundary_saves_its_state(
        tiny_hybrid_gdn, kind, tmp_path, valkey):
    """The finish-time save carries the GDN state at the boundary the last token completed:
    a 16-token prompt with one output token exits with 16 computed tokens; the next prompt
    that extends it hits 16 through the tier, not 8."""
    hybrid = Hybrid("gdn", *tiny_hybrid_gdn, "mtp")
    prompt = prompt_of(16, seed=5)
    warm = hybrid.engine(make_tier(kind, tmp_path, valkey))
    sampled = first_step(warm, prompt, "first", max_tokens=1).token_ids
    assert len(sampled) == 1 and not warm.has_unfinished_requests()
    assert warm.connector.flush(30)
    state_saves = warm.kv_connector_stats()[kind].extra["groups"]["1"]["saved_blocks"]
    assert state_saves == 2  # the states at 8 and 16
    # the block ending at 16 is named with its successor (lookahead L=1): the sampled token
    longer = prompt + list(sampled) + prompt_of(4, seed=6)
    if kind == "offload":
        fresh = warm
        assert fresh.reset_prefix_cache()
    else:
        warm.close()
        fresh = hybrid.engine(make_tier(kind, tmp_path, valkey))
    out = first_step(fresh, longer, "next")
    assert out.num_cached_tokens == 16
    cold = hybrid.engine()
    first_step(cold, longer, "cold")
    state = group_reads(fresh, "next", 16)["g1 state"]
    assert torch.equal(state, group_reads(cold, "cold", 16)["g1 state"])
    finish(fresh)
    fresh.close()
    cold.close()


def _failing_state(store, mode):
    """A tier whose GDN state blocks cannot be read (an I/O error on load)."""
    if mode.group is None or mode.group.kind != "mamba":
        return store

    class Failing:
        def __getattr__(self, name):
            return getattr(store, name)

        def get(self, block):
            return CodecMiss(MissReason.IO_ERROR, "injected")

    return Failing()


def test_a_failed_state_load_recomputes_from_the_local_hit(tiny_hybrid_gdn, tmp_path, valkey):
    """Any group's failure fails the whole load from the local hit (nothing between the
    local hit and the tier hit is valid for the state group); the request recomputes and its
    output equals a cold run's."""
    hybrid = Hybrid("gdn", *tiny_hybrid_gdn, "mtp")
    prompt = prompt_of(45)
    _, out, _, _, stats = serve_through_tier(hybrid, "offload", tmp_path, valkey, prompt,
                                             wrap=_failing_state)
    assert out.num_cached_tokens == 0
    assert stats["offload"].load_failed_blocks > 0
    cold = hybrid.engine()
    cold.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True), "cold")
    replay = hybrid.engine(OffloadConnector(0.02))
    replay.add_request(prompt, SamplingParams(max_tokens=3, ignore_eos=True), "cold")
    assert [o.token_ids for o in cold.step()] == [o.token_ids for o in replay.step()]
    cold.close()
    replay.close()


def test_the_legacy_drop_through_the_tier_equals_the_local_drop(tiny_hybrid_gdn, tmp_path,
                                                                valkey):
    """A tier without the lookahead capability: legacy hashes, one unit dropped, once, in the
    tier as in the local cache (45 tokens: 40, then 32)."""
    hybrid = Hybrid("gdn", *tiny_hybrid_gdn, "mtp")
    local, out, reads, cold_reads, _ = serve_through_tier(
        hybrid, "offload", tmp_path, valkey, prompt_of(45),
        tier_cls=NoLookaheadOffloadConnector)
    assert local == 32 and out.num_cached_tokens == 32
    for name, value in reads.items():
        assert torch.equal(value, cold_reads[name]), name


def test_a_checkpoint_released_behind_a_longer_request_is_saved_and_served(
        tiny_hybrid_gdn, tmp_path, valkey):
    """The manager releases old GDN checkpoints inside `allocate_slots` (only the latest is
    read to continue); the tier saves them from the step's released blocks before they can be
    reused, so a prompt sharing only the first 16 tokens of a 45-token one hits 16 from the
    tier, reading the cold run's state there."""
    hybrid = Hybrid("gdn", *tiny_hybrid_gdn, "mtp")
    long_prompt = prompt_of(45)
    warm = hybrid.engine(make_tier("disk", tmp_path, valkey))
    first_step(warm, long_prompt, "long")
    finish(warm)
    assert warm.connector.flush(30)
    assert warm.kv_connector_stats()["disk"].extra["groups"]["1"]["saved_blocks"] == 5
    warm.close()
    short = long_prompt[:17] + prompt_of(6, seed=9)  # (the block ending at 16 needs token 16)
    fresh = hybrid.engine(make_tier("disk", tmp_path, valkey))
    out = first_step(fresh, short, "short")
    assert out.num_cached_tokens == 16
    cold = hybrid.engine()
    first_step(cold, short, "cold")
    reads, cold_reads = group_reads(fresh, "short", 16), group_reads(cold, "cold", 16)
    for name, value in reads.items():
        assert torch.equal(value, cold_reads[name]), name
    finish(fresh)
    fresh.close()
    cold.close()
