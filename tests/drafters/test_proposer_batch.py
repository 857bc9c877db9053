"""The runner's whole-batch proposer input (`ProposerBatch`) drives a one-module drafter exactly
as the same step's per-request `ProposerInput`s do: the same drafts, the same draft KV and
target KV bit for bit (the same forwards on the same rows), the same deferred positions,
through chunked prefills, finishes, a waiting queue and steps that draft nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from speckv.drafters.loaders import random_drafter
from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import SamplingParams
from speckv.speculation.adaptive import AdaptiveSpecConfig, AdaptiveSpeculation
from speckv.speculation.proposer import ProposerBatch, TargetRows

PROMPTS = [[(5 * i + j * 3) % 90 + 1 for j in range(7 + 5 * i)] for i in range(6)]
SCRIPT = [3, 0, 0, 2, 3, 1, 0, 3]  # draft lengths per step: deferrals, then their joins


class ScriptedSpeculation(AdaptiveSpeculation):
    def __init__(self, max_spec_tokens: int, script: list[int] = SCRIPT) -> None:
        super().__init__(AdaptiveSpecConfig(max_spec_tokens))
        self.calls = 0
        self.script = script

    def _decide(self, num_requests: int) -> int:
        self.calls += 1
        return self.script[(self.calls - 1) % len(self.script)]


def _engine(model, drafter, per_request: bool, max_num_seqs: int = 4,
            script: list[int] = SCRIPT) -> LLMEngine:
    config = engine_config(num_blocks=96, block_size=4, speculative_method=drafter.policy.name,
                           num_spec_tokens=3, max_num_batched_tokens=24,
                           max_num_seqs=max_num_seqs)
    engine = LLMEngine(model, config, drafter=drafter)
    engine.spec_policy = engine.runner.spec_policy = ScriptedSpeculation(3, script)
    if per_request:
        batched = engine.proposer.propose
        engine.proposer.propose = lambda inputs: batched(list(inputs))  # ProposerInputs
    return engine


@pytest.mark.parametrize(("method", "num_prompts", "max_num_seqs", "script"), [
    ("eagle", 6, 4, SCRIPT), ("eagle3", 6, 4, SCRIPT), ("mtp", 6, 4, SCRIPT),
    # mostly no drafts: more requests deferring at once than the row store's first slots
    ("eagle3", 12, 12, [0, 0, 0, 0, 0, 2, 0, 0, 0]),
])
def test_batch_and_per_request_inputs_propose_alike(tiny_model, method, num_prompts,
                                                    max_num_seqs, script):
    kw = {"mtp": {"num_modules": 1}, "eagle3": {"aux_layers": (0, 0, 0)}}.get(method, {})
    drafter = random_drafter(method, tiny_model, init_std=0.2, seed=5, **kw)
    engines = [_engine(tiny_model, drafter, per_request, max_num_seqs, script)
               for per_request in (False, True)]
    prompts = (PROMPTS * 2)[:num_prompts]
    for engine in engines:
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, SamplingParams(max_tokens=6 + 3 * i, ignore_eos=True),
                               f"r{i}")
    outputs: list[dict[str, list[int]]] = [{}, {}]
    steps = 0
    while any(engine.has_unfinished_requests() for engine in engines):
        for engine, seen in zip(engines, outputs):
            for output in engine.step():
                seen[output.request_id] = output.token_ids
        a, b = engines
        assert {r.request_id: r.spec_token_ids for r in a.scheduler.running} == \
            {r.request_id: r.spec_token_ids for r in b.scheduler.running}
        for request_id in a.scheduler.requests:
            assert a.proposer.num_deferred_positions(request_id) == \
                b.proposer.num_deferred_positions(request_id)
        assert torch.equal(a.proposer.kv_cache.storage, b.proposer.kv_cache.storage)
        steps += 1
    assert outputs[0] == outputs[1] and len(outputs[0]) == len(prompts)
    assert torch.equal(engines[0].runner.kv_cache.storage, engines[1].runner.kv_cache.storage)
    assert steps > len(script)


def test_batch_reads_as_its_proposer_inputs():
    hidden = torch.arange(12.0).reshape(6, 2)
    rows = TargetRows(hidden, hidden + 100, (hidden + 200,), torch.arange(6))
    batch = ProposerBatch(
        ["a", "b"], [[1, 2, 3], [4, 5, 6, 7]], np.array([0, 2]), np.array([2, 3]),
        np.array([0, 2]), np.array([False, True]), np.array([0, 2]), rows,
        np.array([[3, 0], [5, 6]], dtype=np.int32), np.array([1, 2]),
        [[[3]], [[5, 6]]], 0)
    a, b = batch
    assert len(batch) == 2 and batch[1] is b
    assert (a.request_id, a.start, a.end, a.wants_drafts, a.max_drafts) == ("a", 0, 2, False, 0)
    assert (b.request_id, b.start, b.end, b.wants_drafts, b.max_drafts) == ("b", 2, 3, True, 2)
    assert torch.equal(b.hidden_states, hidden[2:3])
    assert torch.equal(b.aux_hidden_states[0], hidden[2:3] + 200)
    assert list(b.block_table) == [5, 6] and b.block_tables == ([5, 6],)
    with pytest.raises(ValueError, match="one entry per request"):
        ProposerBatch(["a"], [], np.array([0]), np.array([1]), np.array([0]),
                      np.array([True]), np.array([1]), rows, np.zeros((1, 1), np.int32),
                      np.array([0]), [[[]]], 0)
