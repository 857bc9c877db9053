"""The engine serves a Gated DeltaNet hybrid: prefix hits restore the recurrent state of a cold
run exactly, and speculative decoding never lets a rejected draft advance the state."""

from __future__ import annotations

import random

import pytest
import torch

from speckv.drafters.gated_mtp import random_gated_mtp
from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import SamplingParams
from speckv.models.hybrid.loader import tiny_hybrid
from tests.engine.engine_test_utils import StillClock
from tests.engine.hybrid_engine_utils import OracleProposer, run_all

B, U = 4, 8  # KV block size, GDN state unit (the alignment unit)


@pytest.fixture(scope="module")
def hybrid():
    return tiny_hybrid()


def _engine(model, drafter=None, **kw) -> LLMEngine:
    return LLMEngine(model, engine_config(block_size=B, mamba_block_size=U, num_blocks=400,
                                          **kw), drafter=drafter)


def _state_at(engine: LLMEngine, request_id: str, num_tokens: int):
    group = engine.runner.states.group
    block = engine.manager.get_block_ids(request_id)[group][(num_tokens - 1) // U]
    return engine.runner.states.cache.snapshot(block)


def test_layout_groups_and_unit(hybrid):
    engine = _engine(hybrid)
    assert engine.layout.describe() == "full:4 x1 layers, mamba:8 x2 layers"
    assert engine.manager.alignment_tokens == U
    with pytest.raises(ValueError, match="multiple of block_size"):
        engine_config(block_size=4, mamba_block_size=10)


@pytest.mark.exactness
def test_second_request_hits_and_reads_the_cold_state(hybrid):
    rng = random.Random(7)
    params = SamplingParams(max_tokens=3)
    for n in (9, 16, 17, 45):
        prompt = [rng.randrange(128) for _ in range(n)]
        hit = (n - 1) // U * U
        warm = _engine(hybrid)
        warm.add_request(prompt, params, "first")
        run_all(warm)
        warm.add_request(prompt, params, "second")
        (out,) = warm.step()
        assert out.num_cached_tokens == hit
        cold = _engine(hybrid)
        cold.add_request(prompt, params, "cold")
        (cold_out,) = cold.step()
        assert out.token_ids == cold_out.token_ids
        if hit:
            for a, b in zip(_state_at(warm, "second", hit), _state_at(cold, "cold", hit)):
                assert torch.equal(a, b)  # the state at the hit, bit for bit
        # the state after the whole prompt (+ the first sampled token's step) too
        for a, b in zip(_state_at(warm, "second", n), _state_at(cold, "cold", n)):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.exactness
def test_greedy_speculative_output_equals_greedy(hybrid):
    rng = random.Random(3)
    prompts = [[rng.randrange(128) for _ in range(n)] for n in (13, 21, 6)]
    params = SamplingParams(max_tokens=30, ignore_eos=True)

    def run(**kw):
        engine = _engine(hybrid, **kw)
        for i, p in enumerate(prompts):
            engine.add_request(p, params, f"r{i}")
        return run_all(engine)

    base = run()
    reference = {rid: prompts[int(rid[1:])] + out.token_ids for rid, out in base.items()}
    # random MTP drafter: (almost) every draft rejected
    mtp = run(drafter=random_gated_mtp(hybrid), speculative_method="mtp", num_spec_tokens=3)
    assert {r: o.token_ids for r, o in mtp.items()} == {r: o.token_ids for r, o in base.items()}
    # oracle drafts with one wrong token every third window: windows accepted in part
    oracle = OracleProposer(reference, 3)
    # the adaptive draft length on a clock that never moves: the same choices everywhere
    engine = LLMEngine(hybrid, engine_config(block_size=B, mamba_block_size=U, num_blocks=400),
                       proposer=oracle, spec_clock=StillClock())
    for i, p in enumerate(prompts):
        engine.add_request(p, params, f"r{i}")
    spec = run_all(engine)
    assert {r: o.token_ids for r, o in spec.items()} == {r: o.token_ids for r, o in base.items()}
    accepted = sum(o.num_accepted_tokens for o in spec.values())
    drafted = sum(o.num_draft_tokens for o in spec.values())
    assert 0 < accepted < drafted  # both paths ran


@pytest.mark.exactness
def test_checkpoint_written_during_speculative_decode_serves_a_hit(hybrid):
    """Units completed while decoding with partly rejected drafts hold the verified state: a
    request whose prompt is prompt + output hits them and continues like a cold run."""
    prompt = [random.Random(5).randrange(128) for _ in range(10)]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    base = _engine(hybrid)
    base.add_request(prompt, params, "r0")
    full = prompt + run_all(base)["r0"].token_ids
    oracle = OracleProposer({"r0": full, "again": full + [0] * 64}, 3, wrong_every=2)
    # the adaptive draft length on a clock that never moves: the same choices everywhere
    engine = LLMEngine(hybrid, engine_config(block_size=B, mamba_block_size=U, num_blocks=400),
                       proposer=oracle, spec_clock=StillClock())
    engine.add_request(prompt, params, "r0")
    run_all(engine)
    again = full[:35]
    engine.add_request(again, SamplingParams(max_tokens=4), "again")
    (out,) = engine.step()
    assert out.num_cached_tokens == 32
    cold = _engine(hybrid)
    cold.add_request(again, SamplingParams(max_tokens=4), "cold")
    (cold_out,) = cold.step()
    for a, b in zip(_state_at(engine, "again", 32), _state_at(cold, "cold", 32)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert out.token_ids == cold_out.token_ids


def test_a_connector_of_one_group_only_is_refused(hybrid):
    from speckv.connectors import OffloadConnector
    from speckv.connectors.capability import SINGLE_FULL_ATTENTION

    class OneGroup(OffloadConnector):
        kv_group_support = SINGLE_FULL_ATTENTION

    with pytest.raises(ValueError, match="carries one KV cache group; this model has 2"):
        LLMEngine(hybrid, engine_config(block_size=B, mamba_block_size=U, num_blocks=64),
                  connector=OneGroup(0.01))


def test_llm_serves_hybrid_gdn_by_name_with_mtp():
    from speckv.engine.llm import LLM

    llm = LLM("hybrid-gdn", progress=False, kv_cache_memory_bytes=64 << 20,
              mamba_block_size=64, speculative_method="mtp", num_spec_tokens=2,
              speculative_model="random-mtp")
    assert llm.engine.layout.describe() == "full:16 x2 layers, mamba:64 x4 layers"
    prompt = list(range(5, 300))
    first, second = (llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))[0]
                     for _ in range(2))
    assert second.num_cached_tokens == (len(prompt) - 1) // 64 * 64
    assert first.token_ids == second.token_ids
    with pytest.raises(ValueError, match="use 'random-mtp'"):
        LLM("hybrid-gdn", progress=False, kv_cache_memory_bytes=64 << 20,
            speculative_method="mtp", num_spec_tokens=1, speculative_model="builtin")


def test_chunked_prefill_off_the_unit_grid_gives_the_same_tokens(hybrid):
    prompt = [random.Random(11).randrange(128) for _ in range(45)]
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    whole = _engine(hybrid)
    whole.add_request(prompt, params, "r")
    chunked = _engine(hybrid, max_num_batched_tokens=7)  # chunks end off the unit grid
    chunked.add_request(prompt, params, "r")
    assert run_all(chunked)["r"].token_ids == run_all(whole)["r"].token_ids


@pytest.mark.exactness
def test_per_group_pools_size_the_state_apart_and_hits_read_the_cold_state(hybrid):
    """From a memory budget, the GDN state group gets a pool of its own, far smaller than the
    attention group's (one state per unit checkpoint and per running request, not one per
    block id), so the same bytes hold more context; hits still read the cold run's state."""
    layout = hybrid.kv_cache_layout(B, U)
    drafter = random_gated_mtp(hybrid)
    shared_bytes = sum(hybrid.kv_cache_group_bytes(layout)) * 400
    config = engine_config(block_size=B, mamba_block_size=U, kv_cache_memory_bytes=shared_bytes,
                           max_num_seqs=4, max_num_batched_tokens=64,
                           speculative_method="mtp", num_spec_tokens=2)
    engine = LLMEngine(hybrid, config, drafter=drafter)
    budget = engine.kv_budget
    assert budget.per_group_pools and budget.nbytes <= shared_bytes
    full, state = budget.groups
    assert (full.kind, state.kind) == ("full_attention", "mamba")
    assert state.num_blocks < full.num_blocks and full.num_blocks > 400
    assert engine.runner.states.cache.num_blocks == state.num_blocks
    assert engine.runner.kv_cache.num_blocks == full.num_blocks
    assert budget.context_tokens == (full.num_blocks - 1) * B > 399 // 2 * B  # before: G = 2
    rng = random.Random(11)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = [rng.randrange(128) for _ in range(45)]
    engine.add_request(prompt, params, "first")
    run_all(engine)
    engine.add_request(prompt, params, "second")
    (out,) = engine.step()
    assert out.num_cached_tokens == 40
    cold = _engine(hybrid, drafter=drafter, speculative_method="mtp", num_spec_tokens=2)
    cold.add_request(prompt, params, "cold")
    (cold_out,) = cold.step()
    assert out.token_ids == cold_out.token_ids
    for a, b in zip(_state_at(engine, "second", 40), _state_at(cold, "cold", 40)):
        assert a.shape == b.shape and torch.equal(a, b)  # the state at the hit, bit for bit
    engine.manager.check_integrity()
