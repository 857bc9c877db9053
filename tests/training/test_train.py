"""EAGLE3 training pieces: the training-time-test forward computes exactly what drafting
computes at inference, the recorded features are the target's, the init and the feature
scale fold keep the head's function, and the draft vocabulary helpers."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from speckv.attention import AttentionMetadata
from speckv.drafters import CatchUpRequest, TargetStates
from speckv.drafters.loaders import build_drafter, save_drafter
from speckv.engine.sampling_params import SamplingParams
from speckv.training.distill import (
    DistillSequence,
    coverage,
    draft_vocabulary,
    generate_sequences,
)
from speckv.training.head_init import fold_aux_scale, init_from_head, init_from_target
from speckv.training.ttt import expected_acceptance_length, ttt_outputs
from tests.drafters.drafter_test_utils import make_drafter, tiny_target

AUX = (0, 2, 3)  # low, mid, and the last layer's input of the 5-layer tiny target


def dense_features(target, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), 4, H]: the target's aux-layer outputs and final hidden state."""
    n = len(tokens)
    md = AttentionMetadata.build([n], [n], [list(range(1, n // 4 + 2))], 4, target.device)
    kv = target.make_kv_cache(n // 4 + 2, 4)
    with torch.inference_mode():
        out = target(torch.tensor(tokens), md.positions(), kv, md, AUX)
    return torch.stack([*out.aux_hidden_states, out.hidden_states], dim=1)


def test_ttt_steps_equal_the_drafts_of_the_paged_drafter():
    target = tiny_target()
    drafter = make_drafter("eagle3", {"aux_layers": AUX}, target, seed=3)
    prompt = [(7 * j + 3) % 61 for j in range(14)]
    feats = dense_features(target, prompt)
    n = len(prompt)  # catch-up through position n - 2 (the anchor), then 3 drafts
    table = list(range(1, 8))
    kv = drafter.make_kv_cache(8, 4)
    states = TargetStates(feats[: n - 1, 3], tuple(feats[: n - 1, j] for j in range(3)))
    state = drafter.write_draft_kv(states, [CatchUpRequest(0, n - 1, prompt[1:], table)], kv)
    drafts = drafter.propose(state, 3, kv)[0].tolist()
    tokens = prompt + drafts  # the drafts accepted: TTT reads them as the next tokens
    features = torch.cat([feats, torch.zeros(3, 4, feats.shape[-1])])[: len(tokens) - 1]
    with torch.no_grad():
        outs = ttt_outputs(drafter, torch.tensor([tokens]), features[None], 3,
                           torch.ones(3 * feats.shape[-1]))
    anchor = n - 2
    assert [int(drafter.module.draft_token_ids(o[0, anchor : anchor + 1])) for o in outs] == \
        drafts


def test_init_from_target_first_predicts_the_targets_own_next_token():
    target = tiny_target()
    vocab = list(range(target.config.vocab_size))
    drafter = build_drafter("eagle3", target, draft_vocab_size=len(vocab), aux_layers=AUX)
    scale = torch.rand(3 * target.config.hidden_size) * 5 + 1
    init_from_target(drafter, target, vocab, scale)
    tokens = [(5 * j + 1) % 61 for j in range(20)]
    feats = dense_features(target, tokens)
    with torch.no_grad():
        (out,) = ttt_outputs(drafter, torch.tensor([tokens]), feats[None, :-1], 1, scale)
        mine = drafter.module.compute_logits(out[0])  # [T, vocab]
        theirs = target.compute_logits(feats[:-1, 3])
    torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    # folding the scale into fc keeps the function for raw features
    fold_aux_scale(drafter, scale)
    with torch.no_grad():
        (raw,) = ttt_outputs(drafter, torch.tensor([tokens]), feats[None, :-1], 1,
                             torch.ones_like(scale))
    torch.testing.assert_close(raw, out, rtol=1e-4, atol=1e-4)


def test_recorded_features_are_the_targets():
    target = tiny_target()
    prompts = [[(3 * i + j) % 61 + 1 for j in range(5 + 2 * i)] for i in range(3)]
    seqs = generate_sequences(target, None, prompts, [SamplingParams(max_tokens=6,
                              ignore_eos=True)] * 3, max_num_seqs=2, aux_layers=AUX)
    for prompt, seq in zip(prompts, seqs):
        assert seq.tokens[: len(prompt)] == prompt and len(seq.answer) == 6
        reference = dense_features(target, seq.tokens[:-1])
        torch.testing.assert_close(seq.features.float(), reference, rtol=2e-2, atol=2e-2)


def test_draft_vocabulary_and_coverage():
    seq = DistillSequence([9, 9, 5, 5, 5, 7, 2], 2, torch.zeros(6, 4, 1))
    counts = Counter(seq.answer)
    assert counts == {5: 3, 7: 1, 2: 1}
    assert draft_vocabulary(counts, 2, always=(2,)) == [2, 5]
    assert draft_vocabulary(counts, 5) == [0, 1, 2, 5, 7]  # padded with the lowest ids
    assert coverage([2, 5], [seq]) == pytest.approx(4 / 5)


def test_expected_acceptance_length():
    assert expected_acceptance_length([]) == 1.0
    assert expected_acceptance_length([0.5, 0.5, 1.0]) == 1.0 + 0.5 + 0.25 + 0.25


def test_init_from_head_continues_the_saved_function_on_scaled_features(tmp_path):
    target = tiny_target()
    saved = make_drafter("eagle3", {"aux_layers": AUX}, target, seed=5)
    save_drafter(saved, tmp_path, dtype="float32")
    scale = torch.rand(3 * target.config.hidden_size) * 5 + 1
    resumed, vocab = init_from_head(tmp_path, target, scale, AUX)
    assert vocab == [2 * i for i in range(saved.draft_vocab_size)]  # the saved d2t
    tokens = [(5 * j + 2) % 61 for j in range(18)]
    feats = dense_features(target, tokens)[None, :-1]
    with torch.no_grad():
        raw = ttt_outputs(saved, torch.tensor([tokens]), feats, 2, torch.ones_like(scale))
        scaled = ttt_outputs(resumed, torch.tensor([tokens]), feats, 2, scale)
    for a, b in zip(raw, scaled):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="aux layers"):
        init_from_head(tmp_path, target, scale, (0, 1, 3))
