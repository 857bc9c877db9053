"""The step-cost estimators the adaptive speculation policy predicts with.

Owns `DecayedMeans` (a decayed mean per integer key, fitted non-decreasing, predicted
piecewise-linearly between keys: T(n), F(B)), `DraftCosts` (the proposal's seconds for k drafts
at B requests, G(B, k)) and `PairedRatios` (T(n) / T(m) measured on forwards close in time, so
that the machine's drifting speed cancels). Pure arithmetic over
the seconds `AdaptiveSpeculation` feeds them; see `adaptive.py` for how they are weighed.
"""

from __future__ import annotations

import bisect
import math
import statistics


class DecayedMeans:
    """A decayed mean per integer key, fitted non-decreasing in the key (costs do not fall as
    work grows), and piecewise-linear prediction between keys."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self.means: dict[int, float] = {}
        self.counts: dict[int, int] = {}  # measurements per key
        self._keys: list[int] = []
        self._fitted: dict[int, float] | None = None  # cache of `fitted()`

    def add(self, key: int, value: float) -> None:
        old = self.means.get(key)
        self.counts[key] = self.counts.get(key, 0) + 1
        self._fitted = None
        if old is None:
            bisect.insort(self._keys, key)
            self.means[key] = value
        elif value < old:
            # other processes' load only ever makes a step slower: a faster measurement is
            # the likelier truth, so the mean falls fast and rises at the decay's pace
            self.means[key] = (1.0 - self.decay) * old + self.decay * value
        else:
            self.means[key] = self.decay * old + (1.0 - self.decay) * value

    def __contains__(self, key: int) -> bool:
        return key in self.means

    def max_key(self) -> int:
        return self._keys[-1] if self._keys else 0

    def min_key(self) -> int | None:
        return self._keys[0] if self._keys else None

    def __len__(self) -> int:
        return len(self._keys)

    def fitted(self) -> dict[int, float]:
        """The means made non-decreasing in the key by pooling adjacent violators, weighted by
        their measurement counts (the least-squares monotone fit). A mean above the next
        key's (a load spike, e.g. at a batch size seen once as requests finish) is pooled with
        it by weight: a key measured many times keeps nearly its own mean, and the spike
        neither raises it (which made no drafting look dear) nor makes more work look cheaper
        than less."""
        if self._fitted is None:
            blocks: list[list[float]] = []  # [mean, weight, number of keys]
            for key in self._keys:
                blocks.append([self.means[key], float(self.counts[key]), 1])
                while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
                    v2, w2, n2 = blocks.pop()
                    v1, w1, n1 = blocks[-1]
                    blocks[-1] = [(v1 * w1 + v2 * w2) / (w1 + w2), w1 + w2, n1 + n2]
            keys = iter(self._keys)
            self._fitted = {next(keys): v for v, _, n in blocks for _ in range(int(n))}
        return self._fitted

    @classmethod
    def of(cls, decay: float, means: dict[int, float], counts: dict[int, int]
           ) -> DecayedMeans:
        """Means already measured (key -> mean, key -> measurements), to fit and predict."""
        out = cls(decay)
        out.means, out.counts, out._keys = dict(means), dict(counts), sorted(means)
        return out

    def predict_without(self, excluded: int) -> float | None:
        """`predict(excluded)` from the other keys' measurements only (None: no other key)."""
        return DecayedMeans.of(
            self.decay, {k: v for k, v in self.means.items() if k != excluded},
            {k: c for k, c in self.counts.items() if k != excluded}).predict(excluded)

    def predict(self, key: int) -> float | None:
        """The fitted mean at `key` (`fitted`), interpolated / extrapolated along the nearest
        measured segment (never below 0); with a single key, proportional to the key. None:
        nothing measured."""
        keys = self._keys
        if not keys:
            return None
        means = self.fitted()
        if key in means:
            return means[key]
        if len(keys) == 1:
            return means[keys[0]] * key / keys[0]
        i = bisect.bisect_left(keys, key)
        lo, hi = (keys[0], keys[1]) if i == 0 else (
            (keys[-2], keys[-1]) if i == len(keys) else (keys[i - 1], keys[i]))
        y0, y1 = means[lo], means[hi]
        return max(0.0, y0 + (y1 - y0) / (hi - lo) * (key - lo))


class DraftCosts:
    """G(B, k): the proposal's seconds for k drafts per request at B requests. Per draft
    length a `DecayedMeans` over B; between draft lengths the fitted means at B, made
    non-decreasing in k and piecewise-linear (proportional to k while one length is measured).

    Not k times a mean per draft position: the first draft reads the catch-up's last output
    (one LM-head pass), each further one runs the drafter's forward first. At batch 1 (the
    built-in model's EAGLE3 head, 1 thread) k = 1 took 1.2 ms and k = 3 6.2 ms; a mean per
    position pooled over both (as often) prices 3 drafts ~1.3 ms below their cost and 1 draft
    ~0.4 ms above, and one run drifted to 3 drafts, which ran slower than 1 draft in 6 of 7
    paired comparisons (by up to 13%)."""

    def __init__(self, decay: float) -> None:
        self.decay = decay
        self._by_k: dict[int, DecayedMeans] = {}
        # B -> G(B, k) over the lengths measured, until the next measurement: the policy
        # asks for several k per decision
        self._at_b: dict[int, DecayedMeans] = {}

    def add(self, num_requests: int, num_spec_tokens: int, seconds: float) -> None:
        by_b = self._by_k.setdefault(num_spec_tokens, DecayedMeans(self.decay))
        by_b.add(num_requests, seconds)
        self._at_b.clear()

    def __bool__(self) -> bool:
        return bool(self._by_k)

    def predict(self, num_requests: int, num_spec_tokens: int) -> float | None:
        """G(B, k) (None: no proposal measured)."""
        if num_spec_tokens == 0:
            return 0.0
        over_k = self._at_b.get(num_requests)
        if over_k is None:
            over_k = self._at_b[num_requests] = DecayedMeans.of(
                self.decay, {k: means.predict(num_requests) for k, means in self._by_k.items()},
                {k: sum(means.counts.values()) for k, means in self._by_k.items()})
        return over_k.predict(num_spec_tokens)


class PairedRatios:
    """T(n) / T(m) for token counts m < n, measured on forwards close in time.

    Each forward at n tokens gives one observation of log T(n) - log T(m) for each
    m = n / (1 + k) (k = 1 .. `max_spec_tokens`): against the mean of the forwards at m just
    before it and just after it (the one before only, until the one after comes), each at most
    `window` forwards away, so that a drift of the machine's speed cancels. The ratio is the
    median of the latest `num_kept` observations: one cold first forward over a new number of
    rows (seen at batch 1: T(2) = 1.4 T(1) once, then T(1)) is outvoted by the next two.
    While a pair has fewer than `num_kept` observations of its own, the latest ones of the
    same k at the nearest m' within `neighbour_span` of m fill the median up: the ratio
    changes slowly with m, and as a wave's requests finish every step meets a new m, whose
    first observation alone (one noisy pair) would decide (seen at batch 8 -> 7: T(14) / T(7)
    measured 0.94 once, drafting turned on, the next pairs said 1.2, at m = 8 it was 1.33).
    On a shared machine a step's cost drifts by a third within one wave (seen at batch 8:
    72 to 129 ms of CPU for the same work), so T(2B) measured early and T(B) measured late, as
    two decayed means, can promise drafts a gain the run never sees; their ratio on
    neighbouring forwards drifts little."""

    num_kept = 5
    neighbour_span = 1.25  # m' / m (or m / m') at most, for a pair to lend its observations

    def __init__(self, max_spec_tokens: int, window: int) -> None:
        self.max_spec_tokens = max_spec_tokens
        self.window = window
        self._latest: dict[int, tuple[int, float]] = {}  # n -> (forward index, log seconds)
        self._num_forwards = 0
        # (m, n) -> the latest observations, oldest first
        self._observed: dict[tuple[int, int], list[float]] = {}
        # (m, n) -> ratio(m, n): read for every k at every decision, cleared by a forward
        self._ratio: dict[tuple[int, int], float | None] = {}
        # (m, n) -> the latest forward at n while it waits for the next forward at m:
        # (its index, its log seconds, the log seconds of the forward at m before it or None)
        self._open: dict[tuple[int, int], tuple[int, float, float | None]] = {}

    def add(self, num_tokens: int, seconds: float) -> None:
        self._num_forwards += 1
        now = self._num_forwards
        if seconds <= 0.0:
            return  # a clock too coarse to tell: nothing to compare
        log_s = math.log(seconds)
        for k in range(1, self.max_spec_tokens + 1):
            if num_tokens % (1 + k) == 0:  # as the n of (m, n): against the latest m
                key = (num_tokens // (1 + k), num_tokens)
                before = self._latest.get(key[0])
                before_s = before[1] if before is not None and now - before[0] <= self.window \
                    else None
                if before_s is not None:
                    self._observe(key, log_s - before_s)
                self._open[key] = (now, log_s, before_s)
            key = (num_tokens, num_tokens * (1 + k))  # as the m: closes the open forward at n
            waiting = self._open.pop(key, None)
            if waiting is not None and now - waiting[0] <= self.window:
                _, n_s, before_s = waiting
                if before_s is None:
                    self._observe(key, n_s - log_s)
                else:  # its one-sided observation becomes the two-sided one
                    self._observe(key, n_s - 0.5 * (before_s + log_s), replace_last=True)
        self._latest[num_tokens] = (now, log_s)

    def _observe(self, key: tuple[int, int], value: float, replace_last: bool = False) -> None:
        kept = self._observed.setdefault(key, [])
        if replace_last:
            kept[-1] = value
        else:
            kept.append(value)
            if len(kept) > self.num_kept:
                del kept[0]
        self._ratio.clear()

    def ratio(self, m: int, n: int) -> float | None:
        """T(n) / T(m) from paired forwards: this pair's latest observations, filled up from
        its neighbours' (class docstring). None: no pair measured, here or near."""
        key = (m, n)
        if key not in self._ratio:
            self._ratio[key] = self._pooled_ratio(m, n)
        return self._ratio[key]

    def _pooled_ratio(self, m: int, n: int) -> float | None:
        pooled = list(self._observed.get((m, n), ()))
        if len(pooled) < self.num_kept:
            k = n // m - 1
            near = sorted((abs(math.log(m2 / m)), m2) for m2, n2 in self._observed
                          if m2 != m and n2 == m2 * (1 + k)
                          and max(m2 / m, m / m2) <= self.neighbour_span)
            for _, m2 in near:
                lent = self._observed[(m2, m2 * (1 + k))]
                pooled.extend(lent[-(self.num_kept - len(pooled)):])
                if len(pooled) >= self.num_kept:
                    break
        return math.exp(statistics.median(pooled)) if pooled else None
