"""`speckv bench spec-decode` on the tiny model: every mode decodes the same greedy tokens,
the counters add up, and bad arguments stop before the model loads."""

from __future__ import annotations

import pytest

from speckv import cli
from speckv.bench.spec_decode import measure
from speckv.drafters.loaders import random_drafter


def test_pooled_results_add_up(tiny_model):
    drafter = random_drafter("eagle3", tiny_model, init_std=0.2, seed=4, aux_layers=(0, 1, 1))
    prompts = [[(3 * i + j) % 90 + 1 for j in range(5 + i)] for i in range(4)]
    a = measure(tiny_model, None, drafter, prompts[:2], 1, 6, 2, ("none", "eagle3"))
    b = measure(tiny_model, None, drafter, prompts[2:], 2, 6, 2, ("none", "eagle3"),
                first_wave=2)
    pooled = a["eagle3"].merged(b["eagle3"])
    assert pooled.num_tokens == a["eagle3"].num_tokens + b["eagle3"].num_tokens
    assert pooled.outputs == a["eagle3"].outputs + b["eagle3"].outputs
    # position lists are as long as the deepest draft each run chose (the adaptive length
    # follows timings): pad the shorter one with zeros
    da, db = a["eagle3"].num_drafts_by_position, b["eagle3"].num_drafts_by_position
    width = max(len(da), len(db))
    assert pooled.num_drafts_by_position == [
        x + y for x, y in zip(da + [0] * (width - len(da)), db + [0] * (width - len(db)))]
    assert pooled.cpu_seconds > 0 and pooled.tokens_per_cpu_s > 0


def test_every_mode_decodes_the_same_tokens(tiny_model):
    drafter = random_drafter("eagle3", tiny_model, init_std=0.2, seed=4, aux_layers=(0, 1, 1))
    prompts = [[(5 * i + j) % 90 + 1 for j in range(6 + i)] for i in range(5)]
    results = measure(tiny_model, None, drafter, prompts, 2, 10, 2,
                      ("none", "eagle3", "eagle3-fixed", "ngram"))
    plain = results["none"]
    assert plain.num_tokens == sum(len(o) for o in plain.outputs) > 0
    for mode in ("eagle3", "eagle3-fixed", "ngram"):
        assert results[mode].outputs == plain.outputs
    fixed = results["eagle3-fixed"]
    assert fixed.steps_by_num_spec_tokens[0] == 0 and fixed.steps_by_num_spec_tokens[2] > 0
    assert fixed.num_drafts_by_position[0] >= fixed.num_drafts_by_position[1] > 0
    assert len(fixed.acceptance_by_position) == 2


@pytest.mark.parametrize(("argv", "message"), [
    (["--num-spec-tokens", "1000"], "--num-spec-tokens"),
    (["--modes", "none,medusa"], "--modes"),
    (["--batch-sizes", "1,x"], "--batch-sizes"),
    (["--num-prompts", "0"], "--num-prompts"),
    (["--families", "chat,poetry"], "--families"),
    (["--families", "code", "--num-prompts", "60"], "the code family has 50 distinct prompts"),
])
def test_bad_arguments_stop_before_the_model_loads(argv, message, monkeypatch, capsys):
    import speckv.engine.llm as llm

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(llm, "load_model", no_model)
    assert cli.main(["bench", "spec-decode", *argv]) == 2
    assert message in capsys.readouterr().err


def test_rows_give_the_median_ratio_over_rounds_and_pool_the_counters():
    from speckv.bench.spec_decode import ModeResult, _rows

    def round_(plain_s, spec_s):
        return {"none": ModeResult("none", 100, plain_s, plain_s, outputs=[[1]]),
                "eagle3": ModeResult("eagle3", 100, spec_s, spec_s, outputs=[[1]],
                                     num_drafts_by_position=[10], num_accepted_by_position=[4])}

    rows = _rows(8, "chat", 8, [round_(1.0, 0.5), round_(1.0, 2.0), round_(1.0, 0.8)])
    spec = next(r for r in rows if r["mode"] == "eagle3")
    assert spec["speedups"] == [2.0, 0.5, 1.25] and spec["speedup"] == 1.25  # not the mean
    assert spec["rounds"] == 3 and spec["num_tokens"] == 300
    assert spec["mean_acceptance_length"] == 1.4 and spec["identical_to_no_spec"]
