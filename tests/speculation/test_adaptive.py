"""The adaptive draft length: it drafts where drafting pays and stops where it does not, from
measured costs and acceptance only (simulated here: no wall time involved)."""

from __future__ import annotations

import itertools
import random

import pytest

from speckv.speculation.adaptive import (
    AdaptiveSpecConfig,
    AdaptiveSpeculation,
    StepCost,
    Verification,
)


def simulate(policy, batch_size, target_s, draft_s, acceptance, steps=200, seed=0,
             catch_up_s=lambda b, k: 0.002 * b):
    """Run `steps` decode steps of `batch_size` requests; returns the draft length chosen per
    step. target_s(n): seconds of a target step over n tokens; draft_s(b): seconds per draft
    position for b requests; acceptance[j]: P(draft j accepted | drafts before it were)."""
    rng = random.Random(seed)
    chosen = []
    for _ in range(steps):
        k = policy.decide(batch_size)
        chosen.append(k)
        verifications = []
        for _ in range(batch_size):
            accepted = 0
            while accepted < k and rng.random() < acceptance[accepted]:
                accepted += 1
            verifications.append(Verification(k, accepted))
        if k:
            policy.observe_verifications(verifications)
        policy.observe_step(StepCost(batch_size * (1 + k), target_s(batch_size * (1 + k)),
                                     batch_size, k, catch_up_s(batch_size, k),
                                     k * draft_s(batch_size)))
    return chosen


def memory_bound(n):  # a small model on a CPU: extra query rows are nearly free
    return 0.060 + 0.004 * n


def compute_bound(n):  # every token costs the same
    return 0.012 * n


def test_drafts_fully_when_verifying_is_nearly_free_and_drafts_are_good():
    policy = AdaptiveSpeculation(AdaptiveSpecConfig(3))
    chosen = simulate(policy, 1, memory_bound, lambda b: 0.003, [0.8, 0.75, 0.7])
    # none, then one draft: T measured at B only (no slope) says nothing about T at 2B
    assert chosen[:2] == [0, 1]
    assert chosen[-100:].count(3) >= 90


def test_stops_drafting_when_every_verified_token_costs_a_full_token():
    policy = AdaptiveSpeculation(AdaptiveSpecConfig(3))
    chosen = simulate(policy, 32, compute_bound, lambda b: 0.0005 * b, [0.6, 0.5, 0.5])
    late = chosen[-150:]
    assert late.count(0) >= 140  # the rest are rare probes of the runner-up
    assert 0 < sum(1 for k in late if k) <= 10


def test_the_same_costs_favour_drafting_at_batch_1_and_not_at_batch_32():
    def batch_aware(n):  # memory bound up to ~8 rows, then compute bound
        return 0.060 + 0.010 * max(0, n - 8) + 0.002 * min(n, 8)

    rates = [0.7, 0.6, 0.6]
    at_1 = simulate(AdaptiveSpeculation(AdaptiveSpecConfig(3)), 1, batch_aware,
                    lambda b: 0.003, rates)
    at_32 = simulate(AdaptiveSpeculation(AdaptiveSpecConfig(3)), 32, batch_aware,
                     lambda b: 0.001 * b, rates)
    assert sum(at_1[-100:]) / 100 > 2.5
    assert at_32[-100:].count(0) >= 90


def test_follows_a_drop_in_acceptance():
    policy = AdaptiveSpeculation(AdaptiveSpecConfig(3))
    simulate(policy, 4, memory_bound, lambda b: 0.003, [0.9, 0.9, 0.9], steps=100)
    assert policy.decide(4) == 3
    later = simulate(policy, 4, memory_bound, lambda b: 0.003, [0.02, 0.02, 0.02], steps=400)
    assert later[-100:].count(0) >= 90


def test_not_adaptive_always_drafts_the_maximum_and_still_counts():
    policy = AdaptiveSpeculation(AdaptiveSpecConfig(3, adaptive=False))
    chosen = simulate(policy, 32, compute_bound, lambda b: 0.01 * b, [0.1, 0.1, 0.1], steps=30)
    assert chosen == [3] * 30
    stats = policy.stats()
    assert stats.steps_by_num_spec_tokens == (0, 0, 0, 30)
    assert stats.num_drafts_by_position == (30 * 32,) * 3


def test_per_position_counts():
    policy = AdaptiveSpeculation(AdaptiveSpecConfig(3))
    policy.observe_verifications([Verification(3, 0), Verification(3, 2), Verification(2, 2),
                                  Verification(3, 3), Verification(1, 1)])
    stats = policy.stats()
    assert stats.num_drafts_by_position == (5, 4, 3)
    assert stats.num_accepted_by_position == (4, 3, 1)
    assert stats.acceptance_by_position == (4 / 5, 3 / 4, 1 / 3)
    assert stats.mean_acceptance_length == 1 + 8 / 5
    # conditional estimates start from the prior (0.5 worth 1 draft): position 2 was reached
    # by 3 requests (the one accepting 0 never reached it), all accepted
    a1, a2, a3 = policy.acceptance()
    assert a1 == pytest.approx((4 + 0.5) / (5 + 1))
    assert a2 == pytest.approx((3 + 0.5) / (3 + 1))
    assert a3 == pytest.approx((1 + 0.5) / (2 + 1))


@pytest.mark.parametrize("kwargs", [
    {"max_spec_tokens": 0}, {"max_spec_tokens": 3, "probe_interval": 1},
    {"max_spec_tokens": 3, "cost_decay": 1.0}, {"max_spec_tokens": 3, "prior_weight": 0},
    {"max_spec_tokens": 3, "probe_optimism": -1.0},
])
def test_config_is_validated(kwargs):
    with pytest.raises(ValueError):
        AdaptiveSpecConfig(**kwargs)


def test_verification_is_validated():
    with pytest.raises(ValueError):
        Verification(2, 3)


@pytest.mark.parametrize("seconds", [(-0.1, 0.0, 0.0), (0.1, -37.5, 0.0), (0.1, 0.0, float("nan"))])
def test_a_step_cost_below_zero_is_refused(seconds):
    """A clock read wrong (e.g. a position subtracted from a time) must fail loudly: a
    negative catch-up makes every draft length look free."""
    target_s, catch_up_s, propose_s = seconds
    with pytest.raises(ValueError, match="seconds"):
        StepCost(32, target_s, 32, 1, catch_up_s, propose_s)


def test_a_catch_up_that_costs_more_with_drafts_counts_against_drafting():
    """Without drafts the drafter only writes its KV; with drafts its catch-up also computes
    the outputs drafting starts from. Here no drafting is 12% faster (32 / 104 ms against
    48 / 175 ms), but charging every k the drafting catch-up would make one draft look 11%
    faster (48 / 175 ms against 32 / 130 ms): the policy must stop drafting."""

    def target(n):
        return 0.100 + 0.00125 * (n - 32)  # batch 32: 100 ms; 32 more rows: 40 ms more

    def catch_up(b, k):
        return 0.004 if k == 0 else 0.030

    chosen = simulate(AdaptiveSpeculation(AdaptiveSpecConfig(1)), 32, target,
                      lambda b: 0.005, [0.5], steps=300, catch_up_s=catch_up)
    assert chosen[-200:].count(0) >= 180


def test_noise_that_makes_more_tokens_look_cheaper_does_not_buy_drafts():
    """A step over 2 tokens measured faster than one over 1 (a load spike during the latter)
    must not make drafts that are never accepted look free."""
    policy = AdaptiveSpeculation(AdaptiveSpecConfig(1))
    policy.observe_step(StepCost(1, 0.100, 1, 0, 0.0005, 0.0))
    policy.observe_step(StepCost(2, 0.080, 1, 1, 0.004, 0.004))
    policy.observe_verifications([Verification(1, 0)] * 20)
    assert policy.predicted_goodput(1, 1) < policy.predicted_goodput(1, 0)


def test_drafts_that_are_never_accepted_cost_less_than_two_percent():
    """Random-token prompts: every draft rejected, one draft costing 8% of a step. Over 300
    steps the chosen lengths lose less than 2% against never drafting."""
    def target(n):
        return 0.090 + 0.001 * n

    policy = AdaptiveSpeculation(AdaptiveSpecConfig(3))
    chosen = simulate(policy, 1, target, lambda b: 0.004, [0.0, 0.0, 0.0], steps=300,
                      catch_up_s=lambda b, k: 0.003 if k else 0.0002)
    spent = sum(target(1 + k) + (0.003 + 0.004 * k if k else 0.0002) for k in chosen)
    never = 300 * (target(1) + 0.0002)
    assert never / spent > 0.98


def test_one_slow_measurement_of_no_drafting_does_not_keep_drafts_that_lose():
    """Batch 32, one draft accepted 40% of the time while verifying it costs 55% more: drafting
    loses ~10%. A load spike during the one step without drafts (measured 1.6x slower) makes
    drafting look like a win; the policy must measure no drafting again soon and stop."""
    def target(n):
        return 0.150 + 0.0053 * n

    policy = AdaptiveSpeculation(AdaptiveSpecConfig(3))
    rng = random.Random(5)
    spent = 0.0
    spiked = False
    chosen = []
    for _ in range(200):
        k = policy.decide(32)
        if k:
            verifications = []
            for _ in range(32):
                accepted = 0
                while accepted < k and rng.random() < [0.4, 0.2, 0.1][accepted]:
                    accepted += 1
                verifications.append(Verification(k, accepted))
            policy.observe_verifications(verifications)
        cost = target(32 * (1 + k))
        measured = cost
        if k == 0 and not spiked:
            spiked, measured = True, 1.6 * cost
        spent += cost + 0.004 * k
        policy.observe_step(StepCost(32 * (1 + k), measured, 32, k, 0.001, 0.004 * k))
        chosen.append(k)
    never = 200 * target(32)
    assert never / spent > 0.97, chosen


def test_never_drafts_more_than_one_beyond_the_measured_token_counts():
    """T measured at B and 2B only (and flat: noise): 3 drafts would look free, but T at 4B is
    a guess; the policy goes one draft further at a time."""
    policy = AdaptiveSpeculation(AdaptiveSpecConfig(3))
    assert policy.decide(32) == 0
    policy.observe_step(StepCost(32, 0.300, 32, 0, 0.001, 0.0))
    assert policy.decide(32) == 1
    policy.observe_verifications([Verification(1, 1)] * 32)
    policy.observe_step(StepCost(64, 0.300, 32, 1, 0.001, 0.002))
    assert policy.decide(32) == 2
    policy.observe_verifications([Verification(2, 2)] * 32)
    policy.observe_step(StepCost(96, 0.300, 32, 2, 0.001, 0.004))
    assert policy.decide(32) == 3


def after_prefill(policy, batch_size, prompt_tokens, target_s, catch_up_per_row=0.00004):
    """The wave's prefill step: every prompt token through the target and the catch-up."""
    n = batch_size * prompt_tokens
    assert policy.decide(batch_size) == 0  # no T below 2B yet: nothing to weigh drafts against
    policy.observe_step(StepCost(n, target_s(n), batch_size, 0, catch_up_per_row * n, 0.0))


def test_no_draft_is_spent_where_verifying_costs_as_much_as_decoding():
    """Batch 32 on a compute-bound target (T(2B) = 2 T(B)): the prefill measured T at many
    tokens and the first decode step T at B, so even free drafts at the prior acceptance do not
    pay; the policy must not spend a draft step finding out (it used to start with one)."""
    policy = AdaptiveSpeculation(AdaptiveSpecConfig(3))
    after_prefill(policy, 32, 60, compute_bound)
    chosen = simulate(policy, 32, compute_bound, lambda b: 0.0002 * b, [0.6, 0.5, 0.5],
                      steps=48)
    assert chosen == [0] * 48


def test_drafts_from_the_second_decode_step_where_verifying_is_nearly_free():
    """Batch 1, memory bound (T(2) ~ T(1)): after the prefill and one step that measures T(1),
    the prefill's segment predicts T(2), free drafts pay, and it drafts (then learns g, a_j)."""
    policy = AdaptiveSpeculation(AdaptiveSpecConfig(3))
    after_prefill(policy, 1, 64, memory_bound)
    chosen = simulate(policy, 1, memory_bound, lambda b: 0.003, [0.8, 0.75, 0.7], steps=60)
    assert chosen[:2] == [0, 1]
    assert chosen[-30:].count(3) >= 25


def test_the_prefill_catch_up_is_not_taken_for_the_catch_up_without_drafts():
    """The prefill step catches up every prompt row (77 ms here against 4 ms on a decode step).
    Taken as F(B) without drafts it would make no drafting look 12% slower and buy drafts that
    lose (T(2B) = 1.46 T(B), free drafts at the prior promise only 3%, below the margin)."""
    def target(n):
        return 0.100 + 0.0026 * n

    policy = AdaptiveSpeculation(AdaptiveSpecConfig(3))
    policy.observe_step(StepCost(1935, target(1935), 32, 0, 0.077, 0.0))
    policy.observe_step(StepCost(32, target(32), 32, 0, 0.004, 0.0))
    assert policy.decide(32) == 0
    assert policy.predicted_goodput(32, 0) == pytest.approx(32 / (target(32) + 0.004))


def test_drafting_stops_once_predicted_behind_no_drafting():
    """Batch 8, one draft: accepted 80% at first (drafting pays), then 29%, where one draft
    step is predicted 1.2% behind no drafting. Turning drafting on needs `enable_margin`; once
    on, it must stop as soon as no drafting is predicted ahead (a wrong "on" is the costly
    error), not only beyond `switch_margin` (it used to draft on at a loss)."""
    def target(n):
        return 0.060 + 0.003 * n

    policy = AdaptiveSpeculation(AdaptiveSpecConfig(1))
    after_prefill(policy, 8, 40, target)
    chosen = []
    owed = 0.0
    for step in range(400):
        rate = 0.8 if step < 100 else 0.29
        k = policy.decide(8)
        chosen.append(k)
        if k:
            owed += 8 * rate  # accepted drafts, spread evenly over the steps (no noise)
            accepted = int(owed)
            owed -= accepted
            policy.observe_verifications([Verification(1, int(i < accepted)) for i in range(8)])
        policy.observe_step(StepCost(8 * (1 + k), target(8 * (1 + k)), 8, k, 0.001, 0.002 * k))
    assert chosen[60:100].count(1) >= 36  # drafting paid
    assert chosen[-100:].count(0) >= 90


def test_a_slow_step_at_a_smaller_batch_does_not_raise_the_cost_of_no_drafting():
    """Batch 32, requests finishing near the end of a wave: one step at 28 requests measured
    22% slower than the 32-request steps (load). T at 32 is measured 10 times; the one spike
    at fewer tokens must not stand in for it (it used to: T never below a mean at fewer
    tokens), which made no drafting look 18% slower and one draft (1.49x the target time for
    1.48 tokens) look like a win. Pooled by weight, the spike moves T(32) by 2%."""
    policy = AdaptiveSpeculation(AdaptiveSpecConfig(3))
    policy.observe_step(StepCost(692, 1.958, 32, 0, 0.050, 0.0))  # prefill
    policy.observe_step(StepCost(28, 0.211, 28, 0, 0.0004, 0.0))
    for _ in range(10):
        policy.observe_step(StepCost(32, 0.1727, 32, 0, 0.0004, 0.0))
    for _ in range(2):
        policy.observe_verifications([Verification(1, int(i < 15)) for i in range(32)])
        policy.observe_step(StepCost(64, 0.2573, 32, 1, 0.015, 0.0068))
    assert policy.predicted_goodput(32, 0) == pytest.approx(32 / (0.1727 + 0.0004), rel=0.03)
    assert policy.predicted_goodput(32, 1) < policy.predicted_goodput(32, 0)
    assert policy.decide(32) == 0


def test_a_cold_first_draft_step_does_not_stop_drafting_for_good():
    """Batch 1, memory bound, 40% of drafts accepted (drafting pays ~25%). The first step with
    a draft is a cold one (the first forward over two rows: T(2) measured 1.4 T(1), as seen on
    this CPU), its one draft rejected, so one draft looks 20% behind. Not drafting, nothing
    measures T(2) again: the policy must retry it soon and draft on (it used to wait 128 steps
    for a probe, a whole request at batch 1)."""
    policy = AdaptiveSpeculation(AdaptiveSpecConfig(1))
    after_prefill(policy, 1, 64, memory_bound)
    chosen = []
    owed = 0.0
    num_drafted = 0
    for _ in range(60):
        k = policy.decide(1)
        chosen.append(k)
        target_s = memory_bound(1 + k)
        if k:
            num_drafted += 1
            owed += 0.4 if num_drafted > 1 else 0.0
            accepted = int(owed)
            owed -= accepted
            policy.observe_verifications([Verification(1, accepted)])
            if num_drafted == 1:
                target_s *= 1.4
        policy.observe_step(StepCost(1 + k, target_s, 1, k, 0.002 + 0.001 * k, 0.003 * k))
    assert chosen[20:].count(1) >= 32


def test_a_slow_period_after_drafting_was_measured_does_not_make_drafting_look_cheap():
    """Batch 8, one draft accepted 3 times in 8, verifying it costs 32% more target time:
    drafting loses ~1%. After the quiet steps that measured both T(8) and T(16), a slow period
    (every forward 1.4x, as when the machine's other tenants get busy: seen as 72 to 129 ms
    within a wave) measures only T(8), since nothing drafts. As decayed means apart, T(8)
    then catches up with the slow period while T(16) keeps its quiet value, and one draft
    looks nearly free; measured on neighbouring forwards, T(16) / T(8) does not move."""
    def target(n):
        return 0.060 + 0.0035 * n

    policy = AdaptiveSpeculation(AdaptiveSpecConfig(1))
    after_prefill(policy, 8, 40, target)

    def step(k, slow=1.0):
        if k:
            policy.observe_verifications([Verification(1, int(i < 3)) for i in range(8)])
        policy.observe_step(StepCost(8 * (1 + k), slow * target(8 * (1 + k)), 8, k,
                                     slow * (0.001 + 0.004 * k), slow * 0.003 * k))

    for k in (0, 1, 0, 1, 0, 1, 0):  # quiet: both measured, side by side
        step(k)
    assert policy.predicted_goodput(8, 1) < policy.predicted_goodput(8, 0)
    chosen = []
    for _ in range(12):
        k = policy.decide(8)
        chosen.append(k)
        step(k, slow=1.4)
    assert chosen.count(1) <= 1, chosen
    # the drafter's own seconds (catch-up, proposal) keep their quiet means, which the slow
    # period makes look 1.4x cheaper against T(8): a 1-2% shift, below enable_margin
    assert policy.predicted_goodput(8, 1) < 1.02 * policy.predicted_goodput(8, 0)


def test_a_batch_that_shrinks_by_one_borrows_its_neighbours_paired_ratio():
    """Batch 8 measured side by side: one draft accepted 2 times in 8, T(16) = 1.31 T(8), so
    drafting loses. A request finishes; at 7 the first forward at 14 tokens lands in a quick
    moment and the forward at 7 after it in a slow one, and that one pair says T(14) =
    0.95 T(7) (seen on this CPU: 0.94, where the pairs after it said 1.2). Alone it made one
    draft look 18% ahead, and drafting turned on at a loss; filled up with the pairs at 8
    (within 25% of 7), the ratio stays 1.31."""
    def target(n):
        return 0.070 + 0.004 * n

    policy = AdaptiveSpeculation(AdaptiveSpecConfig(1))
    after_prefill(policy, 8, 40, target)

    def step(b, k, scale=1.0):
        if k:
            policy.observe_verifications([Verification(1, int(i < 2)) for i in range(b)])
        policy.observe_step(StepCost(b * (1 + k), scale * target(b * (1 + k)), b, k,
                                     0.001 + 0.004 * k, 0.003 * k))

    for k in (0, 1, 0, 1, 0, 1, 0):
        step(8, k)
    assert policy.predicted_goodput(8, 1) < policy.predicted_goodput(8, 0)
    step(7, 1, scale=0.85)
    step(7, 0, scale=1.15)
    assert policy.predicted_goodput(7, 1) < policy.predicted_goodput(7, 0)
    chosen = []
    for _ in range(12):
        k = policy.decide(7)
        chosen.append(k)
        step(7, k)
    assert chosen.count(1) == 0, chosen


def batch_1_after_early_rejections(acceptance, steps, seed, num_rejected_first=4):
    """Batch 1 after a prefill, T(2) = 1.15 T(1): the first `num_rejected_first` steps with
    drafts have every draft rejected, the rest accept at `acceptance` (per position).
    Returns the chosen draft lengths."""
    def target(n):
        return 0.080 + 0.012 * (n - 1)

    policy = AdaptiveSpeculation(AdaptiveSpecConfig(3))
    after_prefill(policy, 1, 64, target)
    rng = random.Random(seed)
    chosen = []
    num_drafted = 0
    for _ in range(steps):
        k = policy.decide(1)
        chosen.append(k)
        if k:
            num_drafted += 1
            accepted = 0
            if num_drafted > num_rejected_first:
                while accepted < k and rng.random() < acceptance:
                    accepted += 1
            policy.observe_verifications([Verification(k, accepted)])
        policy.observe_step(StepCost(1 + k, target(1 + k), 1, k, 0.003 if k else 0.002,
                                     0.005 * k))
    return chosen


@pytest.mark.parametrize("seed", range(4))
def test_a_few_early_rejections_do_not_leave_drafting_that_pays_untried(seed):
    """45% of drafts accepted (one draft pays ~19% here), but the first four tries are
    rejected: a_1 reads 0.1 and one draft 10% behind. The tries must keep coming every
    probe_interval until acceptance is measured (it used to wait 128 steps per try: 5 drafts
    in 400 steps, seen on the engine at batch 1 as 184 steps without drafts in one round)."""
    chosen = batch_1_after_early_rejections(0.45, steps=400, seed=seed)
    assert sum(1 for k in chosen[-200:] if k) >= 100, "".join(map(str, chosen))


def test_tries_of_drafts_that_keep_failing_thin_out():
    """Random-token prompts: every draft rejected. The optimistic band narrows with every try,
    so after a few tries at probe_interval they come every 8 probe_interval."""
    chosen = batch_1_after_early_rejections(0.0, steps=1500, seed=0)
    tries = [i for i, k in enumerate(chosen) if k]
    assert len(tries) <= 20, tries
    late = [i for i in tries if i >= 300]
    assert all(b - a >= 8 * 16 for a, b in itertools.pairwise(late)), tries


def test_a_draft_length_whose_cost_is_only_the_prefills_guess_is_not_tried_on_a_near_miss():
    """Batch 32. The prefill's rows cost less than decode rows (attention runs per request),
    so the line from T(32) through the prefill predicts T(64) = 1.55 T(32) where a decode step
    over 64 rows costs 1.9x. At the prior acceptance with drafts taken as free, one draft
    looks 3% behind: within the 5% that gets a try every 16 steps once verifying is measured,
    but a try here costs a step at 1.9x (seen on the held-out set: a 48-step run spent 2%
    on one). It needs a predicted gain first."""
    def decode(n):
        return 0.220 * (n / 32) ** 0.93

    def prefill(n):
        return 0.220 + 0.0038 * (n - 32)

    policy = AdaptiveSpeculation(AdaptiveSpecConfig(3))
    after_prefill(policy, 32, 6, prefill)
    chosen = simulate(policy, 32, decode, lambda b: 0.0001 * b, [0.35, 0.3, 0.3], steps=48,
                      catch_up_s=lambda b, k: 0.003)
    assert chosen == [0] * 48, chosen


@pytest.mark.parametrize("lengths", [[0, 1, 3, 0, 1, 3, 2, 0, 2], [0, 1, 3]],
                         ids=["each-length-measured", "two-lengths-measured"])
def test_the_proposal_cost_is_predicted_per_draft_length(lengths):
    # the first draft reads the catch-up's output (one LM-head pass), each further one runs
    # the drafter first: not k times one cost per position (batch 1, built-in EAGLE3 head);
    # a length not measured lies on the line between two that are
    policy = AdaptiveSpeculation(AdaptiveSpecConfig(max_spec_tokens=3))

    def target(n):
        return 0.0303 + 0.0013 * n

    def proposal(k):
        return 0.0 if k == 0 else 0.0012 + 0.0025 * (k - 1)

    for k in lengths * 4:
        if k:
            policy.observe_verifications([Verification(k, min(k, 1))])
        policy.observe_step(StepCost(1 + k, target(1 + k), 1, k, 0.0022, proposal(k)))
    for k in range(4):
        expected = policy.expected_tokens(k) / (target(1 + k) + proposal(k) + 0.0022)
        assert policy.predicted_goodput(1, k) == pytest.approx(expected, rel=1e-9)
