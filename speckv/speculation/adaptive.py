"""Adaptive speculation: how many drafts the next step verifies, from what the engine measured.

Owns the decision "does drafting pay at this batch size, and how many tokens?" and the
acceptance statistics behind it. The model runner feeds it typed measurements every step and
asks it for the next step's draft length; it never touches tensors, the scheduler or the cache.
Greedy output does not depend on its choices (verification is lossless); only speed does.

Per step the runner reports (the typed measurements: `measurements.py`; the cost estimators
they feed: `step_costs.py`)
    `StepCost`      the target forward's token count and seconds (`observe_target`, before
                    it asks for the next draft length), the drafter's catch-up seconds (paid
                    whatever the draft length: the draft KV of every position made final
                    must be written) and the proposal seconds for `k` drafts
                    (`observe_drafter`, after the proposals);
    `Verification`  per request, drafts offered and accepted (before any stop cut).

The choice for `B` requests that will decode next, over k = 0 .. max_spec_tokens:

    goodput(k) = B * E[k] / (T(B * (1 + k)) + G(B, k) + F(B))
    E[k]       = 1 + a1 + a1 a2 + ... + a1 .. ak        expected tokens per request per step
    a_j        = P(draft j accepted | drafts 1..j-1 accepted), decayed counts with a prior
    T(n)       = target step seconds for n tokens: a decayed mean per n measured, linear
                 interpolation between measured n, extrapolation along the nearest segment;
                 for k > 0, once forwards close in time measured both B and B (1 + k)
                 tokens, T(B) times their paired ratio (a step's cost drifts with the
                 machine's load, so two means measured at different times are not comparable)
    G(B, k)    = seconds of the proposal of k drafts for B requests: measured per k,
                 piecewise-linear in k between the lengths measured (the first draft reads
                 the catch-up's output, each further one costs a drafter forward more)
    F(B)       = the rest of the step (the drafter's catch-up), paid for every k, but measured
                 apart for k = 0 and k > 0: without drafts the catch-up only writes draft KV,
                 with drafts it also computes the outputs drafting starts from

It starts without drafts: until T is measured below 2B tokens (the prefill steps measure it
at many tokens, the first decode step at B) there is nothing to weigh drafting against. Then,
before any draft is measured, G(B, k) is taken as zero and the catch-up as no dearer than
without drafts: the most one draft could pay at the prior acceptance. T(2B) comes from the measured
segments (B and the prefills' token counts), so where verifying B more tokens costs nearly as
much as B tokens (a compute-bound target: T(2B) ~ 2 T(B)), even that does not pay and no draft
is spent finding out; where it is nearly free (memory-bound, batch 1) the first draft step
measures G and a_1. Only with T measured at a single token count (no slope known) does it
draft once to measure T at 2B. From then on it drafts only where
that is predicted to pay by `enable_margin` (default 6%: with noisy costs a wrong "on" costs
more than a wrong "off" saves) and stops as soon as no drafting is predicted ahead (that band
is the hysteresis), keeps the best k (a switch among draft lengths needs a
`switch_margin` gain), and never considers more drafts than one beyond the token counts
already measured (T beyond them is a guess along the last segment, which noise can make flat);
while G is not measured, no more than one draft.
The catch-up F is measured on decode-only steps: a step with prefill rows (more target tokens
than B requests with k drafts each could verify) catches those rows up too, a cost that is
paid whatever k and says nothing about F(B).
T (and g, F) are fitted non-decreasing in their key by pooling adjacent violators weighted
by measurement counts, and T(B(1 + k)) is never taken below T(B): noise must not make
verifying more tokens look cheaper, and a spike measured once at a smaller batch (as requests
finish) must not raise a T(B) measured many times and make drafting look cheap; a mean falls
fast towards a faster measurement and rises slowly (other processes' load only ever slows a
step down).
Every `probe_interval` steps it tries the runner-up for one step (8x less often when the
runner-up is predicted to lose by more than 5% even with its measured acceptance
`probe_optimism` standard errors up: a few early rejections must not put off the next try;
or, not drafting, where verifying drafts was never measured at or near this batch, predicted
not to gain `enable_margin`: that cost is only a guess from other token counts' line),
so a change in batch size or acceptance is noticed; while drafting it also measures no
drafting again, every `probe_interval` / 4 steps until T at B has 3 measurements, then
every `probe_interval` steps (8x less often when drafting is predicted more than 15% ahead):
one slow measurement of the cost drafting must beat must not keep drafts that lose. The
mirror case: while not drafting, a runner-up whose T was measured only once or twice,
above the other segments' line by enough to hide a gain within 5%, is tried every
`probe_interval` / 4 steps until T there has 3 measurements: one cold first step (the first
forward over a new number of rows) must not stop drafting that pays.

The costs are read from one injectable clock (`AdaptiveSpeculation.clock`, which the runner
and the proposer use too): on CPU the process's CPU time by default, because the steps the
policy compares run at different times and wall time also counts the time other processes
held the cores, which drifts between them; on an accelerator the wall clock.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from speckv.speculation.measurements import SpeculationReport, StepCost, Verification
from speckv.speculation.step_costs import DecayedMeans, DraftCosts, PairedRatios

Clock = Callable[[], float]  # seconds, monotonic within a run


def default_clock(device_type: str) -> Clock:
    """The cost clock for an engine on `device_type` ("cpu", "cuda", ...): see the module
    docstring."""
    return time.process_time if device_type == "cpu" else time.perf_counter


@dataclass(frozen=True)
class AdaptiveSpecConfig:
    max_spec_tokens: int  # the engine's num_spec_tokens: the most drafts per request per step
    probe_interval: int = 16  # steps between tries of the runner-up draft length
    cost_decay: float = 0.7  # weight of the old mean when a cost is measured again
    acceptance_decay: float = 0.98  # per step, on the acceptance counts
    # a_j before any verification, worth `prior_weight` verified drafts: light, because where
    # drafts are never accepted every step spent unlearning the prior costs the draft path
    prior_acceptance: float = 0.5
    prior_weight: float = 1.0
    switch_margin: float = 0.03  # a new k must promise this much more goodput
    # drafting again after none must promise this much more than none: with noisy costs the
    # prediction errs both ways, and a wrong "on" costs more than a wrong "off" saves
    enable_margin: float = 0.06
    # standard errors added to a measured a_j when judging whether a runner-up is worth a
    # probe soon: a few early rejections must not leave drafting that pays untried for long
    probe_optimism: float = 1.0
    adaptive: bool = True  # False: always max_spec_tokens (statistics are still kept)

    def __post_init__(self) -> None:
        if not isinstance(self.max_spec_tokens, int) or self.max_spec_tokens < 1:
            raise ValueError(f"max_spec_tokens must be an int >= 1, got {self.max_spec_tokens!r}")
        if self.probe_interval < 2:
            raise ValueError(f"probe_interval must be >= 2, got {self.probe_interval}")
        for name in ("cost_decay", "acceptance_decay", "prior_acceptance"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {value}")
        if self.prior_weight <= 0 or self.switch_margin < 0 or self.enable_margin < 0:
            raise ValueError("prior_weight must be > 0, switch_margin and enable_margin >= 0")
        if not self.probe_optimism >= 0:
            raise ValueError(f"probe_optimism must be >= 0, got {self.probe_optimism!r}")


@dataclass
class _Counts:
    tested: list[float] = field(default_factory=list)  # decayed drafts verified at j
    accepted: list[float] = field(default_factory=list)


class AdaptiveSpeculation:
    """The draft-length policy of one engine (see the module docstring). Not thread-safe."""

    def __init__(self, config: AdaptiveSpecConfig, clock: Clock = time.perf_counter) -> None:
        self.config = config
        self.clock = clock  # what the runner and the proposer time the step with
        s = config.max_spec_tokens
        self._target = DecayedMeans(config.cost_decay)  # n tokens -> seconds
        # T(B (1 + k)) / T(B) on neighbouring forwards (the drift-free part of T)
        self._paired = PairedRatios(s, config.probe_interval)
        self._draft = DraftCosts(config.cost_decay)  # (B, k) -> proposal seconds
        self._fixed = DecayedMeans(config.cost_decay)  # B -> catch-up seconds, k > 0
        self._fixed_no_draft = DecayedMeans(config.cost_decay)  # B -> catch-up seconds, k = 0
        self._decayed = _Counts([0.0] * s, [0.0] * s)
        self._drafts = [0] * s  # lifetime
        self._accepted = [0] * s
        self._steps_by_k = [0] * (s + 1)
        # no drafting until the costs say drafting pays (by `enable_margin`)
        self._current = 0 if config.adaptive else s
        self._steps_since_probe = 0
        self._steps_since_zero = 0
        self._predicted_speedup: float | None = None

    # ---- measurements -------------------------------------------------------------------------
    def observe_verifications(self, verifications: Sequence[Verification]) -> None:
        """Per-position acceptance from one step's verified requests."""
        self.observe_acceptance([v.num_drafts for v in verifications],
                                [v.num_accepted for v in verifications])

    def observe_acceptance(self, num_drafts: Sequence[int], num_accepted: Sequence[int]
                           ) -> None:
        """`observe_verifications` from the step's counts as two lists (request i verified
        num_drafts[i] drafts and accepted num_accepted[i]): the runner's one count of
        acceptance, without a record per request."""
        if len(num_drafts) != len(num_accepted):
            raise ValueError("num_drafts and num_accepted must have one entry per request")
        for d, a in zip(num_drafts, num_accepted):
            if not 0 <= a <= d:
                raise ValueError(f"accepted {a} of {d} drafts")
        c = self._age_acceptance()
        s = self.config.max_spec_tokens
        drafts, accepted = self._drafts, self._accepted
        tested, accepted_decayed = c.tested, c.accepted
        for d, a in zip(num_drafts, num_accepted):
            for j in range(min(d, s)):
                drafts[j] += 1
            for j in range(min(a, s)):
                accepted[j] += 1
            # conditional: position j counts only when drafts 1..j-1 were accepted
            for j in range(min(d, a + 1, s)):
                tested[j] += 1.0
                if j < a:
                    accepted_decayed[j] += 1.0

    def _age_acceptance(self) -> _Counts:
        """Decay the conditional acceptance counts by one step (before a step's counts join
        them); returns them."""
        c = self._decayed
        decay = self.config.acceptance_decay
        c.tested = [x * decay for x in c.tested]
        c.accepted = [x * decay for x in c.accepted]
        return c

    def observe_acceptance_counts(self, num_drafts: np.ndarray, num_accepted: np.ndarray
                                  ) -> None:
        """`observe_acceptance` from two [n] int arrays (the runner's batch), counted per
        position with array ops. The decayed sums still get 1.0 added once per request, in
        the same order, so they round exactly as there."""
        if num_drafts.shape != num_accepted.shape:
            raise ValueError("num_drafts and num_accepted must have one entry per request")
        if bool(((num_accepted < 0) | (num_accepted > num_drafts)).any()):
            bad = int(np.argmax((num_accepted < 0) | (num_accepted > num_drafts)))
            raise ValueError(f"accepted {int(num_accepted[bad])} of {int(num_drafts[bad])} "
                             "drafts")
        c = self._age_acceptance()
        s = self.config.max_spec_tokens

        def at_least(values: np.ndarray) -> list[int]:
            """[s] requests whose min(value, s) exceeds j, per position j."""
            counts = np.bincount(np.minimum(values, s), minlength=s + 1)
            return np.cumsum(counts[::-1])[::-1][1:].tolist()

        # drafts verified and accepted at j; tested at j: drafts before j all accepted
        # (j < min(d, a + 1)); accepted there: j < a (a <= d)
        drafted, accepted = at_least(num_drafts), at_least(num_accepted)
        tested = at_least(np.minimum(num_drafts, num_accepted + 1))
        tested_decayed, accepted_decayed = c.tested, c.accepted
        for j in range(s):
            self._drafts[j] += drafted[j]
            self._accepted[j] += accepted[j]
            value = tested_decayed[j]
            for _ in range(tested[j]):
                value += 1.0
            tested_decayed[j] = value
            value = accepted_decayed[j]
            for _ in range(accepted[j]):
                value += 1.0
            accepted_decayed[j] = value

    def observe_step(self, cost: StepCost) -> None:
        """A whole step's costs: `observe_target`, then `observe_drafter`."""
        self.observe_target(cost.num_target_tokens, cost.target_s)
        self.observe_drafter(cost)

    def observe_target(self, num_target_tokens: int, target_s: float) -> None:
        """The step's target forward (`StepCost.num_target_tokens`, `target_s`). The runner
        reports it before it asks `decide` for the next step's draft length, and the drafter's
        costs after the proposals (`observe_drafter`): a step that verified drafts for the
        first time then weighs its own T(B (1 + k)), and drafting that loses stops one step
        sooner (with T observed only after the decision, every draft length tried cost two
        steps of drafts: at batch 32 one draft measured 1.5x the target time, and the next
        step drafted again on the guess)."""
        if not target_s >= 0.0:
            raise ValueError(f"target_s must be >= 0 seconds, got {target_s!r}")
        if num_target_tokens > 0:
            self._target.add(num_target_tokens, target_s)
            self._paired.add(num_target_tokens, target_s)

    def observe_drafter(self, cost: StepCost) -> None:
        """The drafter's side of a step: its catch-up and proposal seconds (the target fields
        only tell whether the step was decode-only)."""
        b = cost.num_decode_requests
        if b > 0:
            # more tokens than b decoding requests could verify: prefill rows were caught up
            # too (module docstring), not a measure of F(b)
            decode_only = cost.num_target_tokens <= b * (1 + self.config.max_spec_tokens)
            if cost.num_spec_tokens > 0:
                if decode_only:
                    self._fixed.add(b, cost.catch_up_s)
                self._draft.add(b, cost.num_spec_tokens, cost.propose_s)
            elif decode_only:
                self._fixed_no_draft.add(b, cost.catch_up_s)

    # ---- the decision -------------------------------------------------------------------------
    def acceptance(self, num_std_errors: float = 0.0) -> list[float]:
        """a_j for j = 1..max_spec_tokens (conditional on drafts before j accepted).
        `num_std_errors` > 0: each a_j measured on at least one (decayed) verified draft is
        raised by that many binomial standard errors, sqrt(a_j (1 - a_j) / verified), and
        kept below 1; an a_j that is still the prior alone stays the prior (no count to
        be uncertain about, and a band around a guess would make every draft look worth a
        try)."""
        cfg = self.config
        prior = cfg.prior_acceptance * cfg.prior_weight
        estimates = []
        for a, t in zip(self._decayed.accepted, self._decayed.tested):
            p = (a + prior) / (t + cfg.prior_weight)
            if num_std_errors > 0 and t >= 1.0:
                p = min(1.0 - 1e-6, p + num_std_errors * math.sqrt(p * (1.0 - p) / t))
            estimates.append(p)
        return estimates

    def expected_tokens(self, k: int, num_std_errors: float = 0.0) -> float:
        """E[k]: expected tokens per request per step with k drafts (at `acceptance`'s
        `num_std_errors`)."""
        total, run = 1.0, 1.0
        for a in self.acceptance(num_std_errors)[:k]:
            run *= a
            total += run
        return total

    def predicted_goodput(self, num_requests: int, k: int, unmeasured_drafts_free: bool = False,
                          num_std_errors: float = 0.0) -> float | None:
        """Tokens per second with k drafts for `num_requests` decoding requests (None: the
        costs are not measured yet). `unmeasured_drafts_free`: before drafting is measured,
        its cost is taken as zero (draft positions free, the catch-up no dearer than without
        drafts): the most drafting could pay at the current acceptance. `num_std_errors`:
        the acceptance that many standard errors up (`acceptance`)."""
        b = num_requests
        target = self._target.predict(b * (1 + k))
        if target is None:
            return None
        draft = 0.0
        if k:
            no_draft_target = self._target.predict(b) or 0.0
            # drift between when T(B) and T(B (1 + k)) were measured must not pass for the
            # cost of k drafts: where forwards close in time measured both, their ratio
            ratio = self._paired.ratio(b, b * (1 + k))
            if ratio is not None:
                target = no_draft_target * ratio
            # noise must not make verifying more tokens look cheaper than B tokens
            target = max(target, no_draft_target)
            proposal = self._draft.predict(b, k)
            if proposal is None and not unmeasured_drafts_free:
                return None
            draft = proposal or 0.0
        no_draft = self._fixed_no_draft.predict(b)
        fixed = no_draft if k == 0 else self._fixed.predict(b)
        if fixed is None:
            # k = 0 not measured yet: its catch-up costs at most the drafting one; k > 0 not
            # measured yet (only with unmeasured_drafts_free): at least the one without drafts
            fixed = (self._fixed.predict(b) if k == 0 else no_draft) or 0.0
        return b * self.expected_tokens(k, num_std_errors) / max(1e-9, target + draft + fixed)

    def decide(self, num_requests: int) -> int:
        """The number of drafts per request for the next step of `num_requests` decoding
        requests (0: do not draft)."""
        if num_requests < 1:
            return 0  # nobody to draft for (every request is prefilling or finished)
        k = self._decide(num_requests)
        self._steps_by_k[k] += 1
        return k

    def _decide(self, num_requests: int) -> int:
        s = self.config.max_spec_tokens
        if not self.config.adaptive:
            return s
        low = self._target.min_key()
        if low is None or low >= 2 * num_requests:
            return 0  # T below 2B would be a guess: measure the cost drafting must beat first
        measured = bool(self._draft)
        if not measured and len(self._target) == 1:
            return 1  # T at one token count only, no slope: measure drafting at its cheapest
        # T beyond the most tokens measured is a guess along the last segment, which noise can
        # make flat: explore one draft further than measured at a time, never more; before a
        # draft is measured, at most one (at the most it could pay: module docstring)
        reach = max(1, self._target.max_key() // num_requests) if measured else 1
        goodput = {k: self.predicted_goodput(num_requests, k, unmeasured_drafts_free=True)
                   for k in range(min(s, reach) + 1)}
        known = {k: g for k, g in goodput.items() if g is not None}
        best = max(known, key=lambda k: known[k])
        current = known.get(self._current)
        # on needs enable_margin, off none (a wrong "on" is the costly error; the band between
        # is the hysteresis), a change among draft lengths switch_margin
        margin = (self.config.enable_margin if self._current == 0 and best > 0
                  else 0.0 if best == 0 else self.config.switch_margin)
        if current is None or known[best] > current * (1.0 + margin):
            self._current = best
        if known.get(0):
            self._predicted_speedup = known[self._current] / known[0]
        self._steps_since_probe += 1
        self._steps_since_zero += 1
        interval = self.config.probe_interval
        if self._current > 0 and known.get(0):
            # while drafting, no drafting is measured again: it is the cost drafting must beat,
            # and one noisy measurement must not keep drafting on. Every probe_interval / 4
            # steps until it is measured 3 times at this batch size, then every probe_interval
            # steps, 8x less often where drafting is predicted well ahead
            settled = self._target.counts.get(num_requests, 0) >= 3
            ahead = settled and known[0] < 0.85 * known[self._current]
            wait = interval * 8 if ahead else (interval if settled else max(2, interval // 4))
            if self._steps_since_zero >= wait:
                self._steps_since_zero = 0
                return 0
        ranked = sorted((k for k in known if k not in (self._current, 0)), key=lambda k: -known[k])
        if self._current > 0 or not ranked:
            ranked = sorted((k for k in known if k != self._current), key=lambda k: -known[k])
        if ranked and self._steps_since_probe >= max(2, interval // 4):
            runner_up = ranked[0]
            if self._steps_since_probe >= self._probe_wait(num_requests, runner_up, known):
                self._steps_since_probe = 0
                return runner_up
        return self._current

    def _probe_wait(self, num_requests: int, runner_up: int, known: dict[int, float]) -> int:
        """Steps between tries of `runner_up` (module docstring): `probe_interval` where it is
        predicted within 5% of the current choice with its acceptance `probe_optimism`
        standard errors up (ahead by `enable_margin` where no drafting is current and
        verifying was never measured near this batch), 8x that where even so it loses;
        `probe_interval` / 4 while a cold measurement may hide a gain. Optimism only hastens
        a try, never turns drafting on: a few rejections among a handful of drafts (at
        batch 1 the first four rejected, 45% after) said a_1 = 0.1 and the next try came
        after 128 steps; a drafter whose drafts keep failing narrows its band with every
        try, and the tries thin out to every 8 `probe_interval`."""
        interval = self.config.probe_interval
        if self._current == 0 and self._cold_measurement_hides_a_gain(
                num_requests, runner_up, known[runner_up], known[0]):
            return max(2, interval // 4)
        optimistic = self.predicted_goodput(num_requests, runner_up, True,
                                            self.config.probe_optimism)
        # not drafting, and verifying runner_up drafts never measured at this batch or near
        # it: its cost is the line through other token counts (the prefill's, whose rows cost
        # less than decode rows: at batch 31 it said T(62) = 1.45 T(31), the try measured
        # 1.5-2x), so a try soon needs a predicted gain, as turning drafting on does. (While
        # drafting, one more draft adds a few rows to a verification measured already.)
        unmeasured = self._current == 0 and runner_up > 0 and self._paired.ratio(
            num_requests, num_requests * (1 + runner_up)) is None
        floor = 1.0 + self.config.enable_margin if unmeasured else 0.95
        close = optimistic is not None and optimistic >= floor * known[self._current]
        return interval * (1 if close else 8)

    def _cold_measurement_hides_a_gain(self, num_requests: int, k: int, goodput: float,
                                       no_draft: float) -> bool:
        """Whether T at B(1 + k) tokens is measured only once or twice, above what the other
        token counts' segments predict there, by enough that at their prediction k drafts
        would be within 5% of no drafting. Such a measurement may be a cold first step (the
        first forward over a new number of rows pays one-time costs: seen at batch 1 as
        T(2) = 1.4 T(1), then T(1)), and while no draft runs nothing measures it again."""
        key = num_requests * (1 + k)
        if not 0 < self._target.counts.get(key, 0) < 3:
            return False
        measured = self._target.predict(key)
        others = self._target.predict_without(key)
        if measured is None or others is None or others >= measured:
            return False
        step_s = num_requests * self.expected_tokens(k) / goodput
        return goodput * step_s / (step_s - measured + others) >= 0.95 * no_draft

    # ---- reporting ----------------------------------------------------------------------------
    def stats(self) -> SpeculationReport:
        return SpeculationReport(
            max_spec_tokens=self.config.max_spec_tokens,
            num_drafts_by_position=tuple(self._drafts),
            num_accepted_by_position=tuple(self._accepted),
            steps_by_num_spec_tokens=tuple(self._steps_by_k),
            acceptance_estimate=tuple(self.acceptance()),
            last_num_spec_tokens=self._current,
            predicted_speedup=self._predicted_speedup,
        )
