"""The engine with the adaptive draft length: greedy output never depends on it, the draft KV
is written even on steps that draft nothing, and acceptance is reported per position."""

from __future__ import annotations

import pytest
import torch

from speckv.drafters.loaders import random_drafter
from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import SamplingParams
from speckv.speculation.adaptive import AdaptiveSpecConfig, AdaptiveSpeculation
from tests.engine.engine_test_utils import run_engine

PROMPTS = [[(3 * i + j * 7) % 90 + 1 for j in range(9 + 4 * i)] for i in range(4)]


class ScriptedSpeculation(AdaptiveSpeculation):
    """Chooses draft lengths from a fixed script (cycled), measuring as usual."""

    def __init__(self, max_spec_tokens: int, script: list[int]) -> None:
        super().__init__(AdaptiveSpecConfig(max_spec_tokens))
        self.script = script
        self.calls = 0

    def _decide(self, num_requests: int) -> int:
        k = self.script[self.calls % len(self.script)]
        self.calls += 1
        return k


def _engine(tiny_model, drafter, script=None, adaptive=True):
    method = drafter.policy.name if drafter is not None else "ngram"
    config = engine_config(num_blocks=128, block_size=4, speculative_method=method,
                           num_spec_tokens=3, adaptive_speculation=adaptive)
    engine = LLMEngine(tiny_model, config, drafter=drafter)
    if script is not None:
        engine.spec_policy = engine.runner.spec_policy = ScriptedSpeculation(3, script)
    return engine


def test_greedy_output_is_the_same_for_any_draft_lengths(tiny_model):
    drafter = random_drafter("eagle", tiny_model, init_std=0.2, seed=5)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = run_engine(LLMEngine(tiny_model, engine_config(num_blocks=128, block_size=4)),
                       PROMPTS, params)
    for script in ([0], [3], [1, 0, 3, 2], [2, 2, 0]):
        engine = _engine(tiny_model, drafter, script)
        outputs = run_engine(engine, PROMPTS, params)
        assert {i: o.token_ids for i, o in outputs.items()} == \
            {i: o.token_ids for i, o in plain.items()}
        drafted = sum(o.num_draft_tokens for o in outputs.values())
        assert (drafted == 0) == (script == [0])
        assert engine.spec_decode_stats().steps_by_num_spec_tokens[0] >= (script.count(0) > 0)


def test_steps_without_drafts_still_write_the_draft_kv(tiny_model):
    """A block cached from a request that never drafted holds the same draft KV as one from a
    request that always drafted: later hits read valid draft KV either way."""
    drafter = random_drafter("eagle", tiny_model, init_std=0.2, seed=3)
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    prompt = PROMPTS[2]
    kv = []
    for script in ([0], [3]):
        engine = _engine(tiny_model, drafter, script)
        (first,) = run_engine(engine, [prompt], params).values()
        tokens = prompt + first.token_ids  # 26 tokens, 25 computed
        again = engine.add_request(tokens + [1], SamplingParams(max_tokens=1))
        (out,) = engine.step()
        assert out.num_cached_tokens == 24  # whole blocks whose lookahead token is known
        blocks = engine.manager.get_block_ids(again)[0][:6]
        # [layers, 2, blocks, block_size, kv_heads, head_dim]
        kv.append(engine.proposer.kv_cache.storage[:, :, blocks].clone())
    torch.testing.assert_close(kv[0], kv[1], rtol=0, atol=1e-5)


def test_acceptance_is_reported_per_position(tiny_model):
    engine = _engine(tiny_model, None, adaptive=False)  # n-gram: the tiny model repeats itself
    outputs = run_engine(engine, PROMPTS, SamplingParams(max_tokens=24, ignore_eos=True))
    stats = engine.spec_decode_stats()
    assert stats.steps_by_num_spec_tokens[3] > 0
    by_position = [0, 0, 0]
    accepted = [0, 0, 0]
    for output in outputs.values():
        assert sum(output.num_accepted_by_position) == output.num_accepted_tokens
        assert sum(output.num_drafts_by_position) == output.num_draft_tokens
        for j, (d, a) in enumerate(zip(output.num_drafts_by_position,
                                       output.num_accepted_by_position)):
            assert a <= d
            by_position[j] += d
            accepted[j] += a
        rates = output.acceptance_by_position
        assert len(rates) == len(output.num_drafts_by_position)
        assert all(0.0 <= r <= 1.0 for r in rates)
    assert tuple(by_position) == stats.num_drafts_by_position
    assert tuple(accepted) == stats.num_accepted_by_position
    assert sum(accepted) > 0


@pytest.mark.parametrize("method, kwargs", [("eagle", {}), ("mtp", {"num_modules": 2})])
def test_a_hit_after_lazy_catch_up_reads_the_draft_kv_of_a_cold_run(tiny_model, method, kwargs):
    """Steps without drafts defer the draft KV of a request's open block; a later request's
    hit on the blocks it filled reads the draft KV a cold run (a fresh engine prefilling the
    same tokens) writes."""
    drafter = random_drafter(method, tiny_model, init_std=0.2, seed=6, **kwargs)
    engine = _engine(tiny_model, drafter, [0])
    calls = []
    write = drafter.write_draft_kv

    def counting(*args, **kw):
        calls.append(1)
        return write(*args, **kw)

    drafter.write_draft_kv = counting
    prompt = PROMPTS[1]  # 13 tokens: blocks of 4, the fourth still open
    engine.add_request(prompt, SamplingParams(max_tokens=14, ignore_eos=True))
    deferred, steps = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            deferred.append(engine.proposer.num_deferred_positions(out.request_id))
            tokens = out.prompt_token_ids + out.token_ids
        steps += 1
    del drafter.write_draft_kv
    assert max(deferred) > 0 and len(calls) < steps  # the drafter skipped steps
    hit_len = (len(tokens) - 2) // 4 * 4  # whole blocks whose lookahead token is known
    again = engine.add_request(tokens[:-1], SamplingParams(max_tokens=2, ignore_eos=True))
    (out,) = engine.step()  # still running: its blocks are held
    assert out.num_cached_tokens == hit_len == 24
    blocks = engine.manager.get_block_ids(again)[0][: hit_len // 4]
    assert len(blocks) == 6
    hit = engine.proposer.kv_cache.storage[:, :, blocks].clone()
    cold = _engine(tiny_model, drafter, [3])  # drafts after its prefill: writes every position
    cold_id = cold.add_request(tokens[:-1], SamplingParams(max_tokens=2, ignore_eos=True))
    cold.step()
    assert hit.abs().amax(dim=(0, 1, 3, 4, 5)).min() > 0  # every hit block holds draft KV
    cold_blocks = cold.manager.get_block_ids(cold_id)[0][: hit_len // 4]
    # [layers, 2, blocks, block_size, kv_heads, head_dim]; the cold run computes the 24
    # positions in one prefill, the first run in passes of other sizes, whose products take
    # other forms (each its own summation order) in the target and the drafter: fp32 rounding
    # apart. Values reach ~3, so sums of products of ~10 (an ulp of ~1e-6) carried through the
    # target's layers into the drafter's input: a few tens of ulps in absolute terms
    torch.testing.assert_close(hit, cold.proposer.kv_cache.storage[:, :, cold_blocks],
                               rtol=2e-5, atol=3e-5)


class ScriptedClock:
    """A clock that moves only when the test says: the target's forward costs 100 ms + 1 ms
    per token, each draft position 30 ms (a drafter as slow as in a worst case)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_policy_reads_an_injected_clock_and_stops_drafts_that_do_not_pay(
        tiny_model, monkeypatch):
    choices = []
    for _ in range(2):
        clock = ScriptedClock()
        drafter = random_drafter("eagle", tiny_model, init_std=0.2, seed=2)
        forward, propose = tiny_model.forward, drafter.propose

        def timed_forward(ids, *args, clock=clock, forward=forward, **kw):
            clock.now += 0.100 + 0.001 * ids.shape[0]
            return forward(ids, *args, **kw)

        def timed_propose(state, num, kv, clock=clock, propose=propose):
            clock.now += 0.030 * num
            return propose(state, num, kv)

        monkeypatch.setattr(tiny_model, "forward", timed_forward)
        monkeypatch.setattr(drafter, "propose", timed_propose)
        config = engine_config(num_blocks=128, block_size=4, speculative_method="eagle",
                               num_spec_tokens=3)
        engine = LLMEngine(tiny_model, config, drafter=drafter, spec_clock=clock)
        run_engine(engine, PROMPTS[:1], SamplingParams(max_tokens=60, ignore_eos=True))
        monkeypatch.undo()
        choices.append(engine.spec_decode_stats().steps_by_num_spec_tokens)
    assert choices[0] == choices[1]  # the same clock readings, the same choices
    steps_without, *steps_with = choices[0]
    assert steps_without >= 3 * sum(steps_with)  # a random head's drafts never pay here


class RecordingSpeculation(ScriptedSpeculation):
    """A scripted policy that logs what the runner reports to it, in order."""

    def __init__(self, max_spec_tokens: int, script: list[int]) -> None:
        super().__init__(max_spec_tokens, script)
        self.log: list[tuple[str, int]] = []

    def observe_target(self, num_target_tokens: int, target_s: float) -> None:
        self.log.append(("target", num_target_tokens))
        super().observe_target(num_target_tokens, target_s)

    def decide(self, num_requests: int) -> int:
        self.log.append(("decide", num_requests))
        return super().decide(num_requests)

    def observe_drafter(self, cost) -> None:
        self.log.append(("drafter", cost.num_spec_tokens))
        super().observe_drafter(cost)


def test_the_draft_length_is_chosen_after_the_forward_it_follows_is_measured(tiny_model):
    """Every step reports its target forward before the runner asks for the next draft
    length, and the drafter's costs after the proposals: the decision after a step that
    verified drafts has seen what verifying them cost (drafting that loses stops a step
    sooner)."""
    drafter = random_drafter("eagle", tiny_model, init_std=0.2, seed=5)
    engine = _engine(tiny_model, drafter)
    policy = RecordingSpeculation(3, [2])
    engine.spec_policy = engine.runner.spec_policy = policy
    run_engine(engine, [PROMPTS[1]], SamplingParams(max_tokens=8, ignore_eos=True))
    kinds = [kind for kind, _ in policy.log]
    assert len(kinds) >= 9 and kinds == ["target", "decide", "drafter"] * (len(kinds) // 3)
    # after the prefill, each forward verifies the two drafts the step before proposed
    targets = [n for kind, n in policy.log if kind == "target"]
    assert targets[0] == len(PROMPTS[1]) and targets[1:3] == [3, 3]
