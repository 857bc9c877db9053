"""Speculative decoding on a sliding-window model (tiny random Gemma 3, random drafters):
greedy speculative output equals greedy under preemption, and a prefix hit's target and draft
KV equal a cold run's (fp32 max |diff| 0), with the stale-successor control caught."""

from __future__ import annotations

import random

import pytest
import torch

from speckv.bench.draft_kv import measure
from speckv.drafters.loaders import random_drafter
from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import SamplingParams
from speckv.models.gemma.gemma3 import GemmaForCausalLM, tiny_gemma_config
from tests.engine.engine_test_utils import StillClock

B = 4
WINDOW = 10


@pytest.fixture(scope="module")
def gemma() -> GemmaForCausalLM:
    torch.manual_seed(8)
    # a small vocabulary and large weights: repetitive greedy text, so drafts get accepted
    config = tiny_gemma_config(vocab_size=24, sliding_window=WINDOW)
    return GemmaForCausalLM.from_config(config, init_std=0.4, norm_std=0.2)


def _run(engine, prompts, max_tokens=16):
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
           for p in prompts]
    done, preemptions = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
                preemptions += output.num_preemptions
        engine.manager.check_integrity()
    return [done[i] for i in ids], preemptions


@pytest.mark.parametrize(("fmt", "kwargs", "seed"), [  # seeds whose random drafts get accepted
    ("eagle", {}, 3), ("eagle3", {"aux_layers": (0, 2, 4)}, 3), ("mtp", {"num_modules": 2}, 2)])
def test_speculative_greedy_equals_greedy_with_preemption(gemma, fmt, kwargs, seed):
    drafter = random_drafter(fmt, gemma, init_std=0.3, seed=seed, **kwargs)
    rng = random.Random(4)
    prompts = [[rng.randrange(24) for _ in range(n)] for n in (12, 25, 33, 18, 40)]
    reference, _ = _run(LLMEngine(gemma, engine_config(num_blocks=400, block_size=B)), prompts)
    # the adaptive draft length on a clock that never moves (the same choices everywhere:
    # this test needs the seeds' drafts, some accepted) and the cache pressure of 3
    # draft slots
    tight = engine_config(num_blocks=40, block_size=B, speculative_method=fmt,
                          num_spec_tokens=3, max_num_batched_tokens=20)
    finals, preemptions = _run(LLMEngine(gemma, tight, drafter=drafter,
                                         spec_clock=StillClock()), prompts)
    assert [o.token_ids for o in finals] == [o.token_ids for o in reference]
    assert preemptions > 0, "the tight cache should force preemptions"
    assert sum(o.num_draft_tokens for o in finals) > 0
    assert sum(o.num_accepted_tokens for o in finals) > 0, "no draft was ever accepted"


@pytest.mark.exactness
@pytest.mark.parametrize(("fmt", "kwargs"), [("eagle", {}), ("mtp", {"num_modules": 2})])
def test_hit_reads_the_cold_runs_target_and_draft_kv(gemma, fmt, kwargs):
    drafter = random_drafter(fmt, gemma, init_std=0.3, seed=2, **kwargs)
    prompt = [random.Random(6).randrange(24) for _ in range(47)]  # ~4 windows
    hit, control = measure(gemma, drafter, "float32", prompt, B)
    lookahead = drafter.policy.draft_kv_lookahead_tokens
    assert hit.hit_tokens == (47 - lookahead) // B * B
    assert hit.target_max_abs_diff == 0 and hit.draft_max_abs_diff == 0
    assert control.target_max_abs_diff == 0
    assert control.draft_max_abs_diff > 1e-3  # stale successor's draft KV caught
