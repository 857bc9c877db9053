"""Routing policies: which healthy engine gets a request, and why. Pure apart from the
round-robin counter.

    kv            cost(e) = prefill_load_scale * (N - cached(e))
                          + request_load_tokens * load(e) + kv_usage_tokens * kv_usage(e)
                  over the engines with load(e) <= min_e' load(e') + max_imbalance;
                  the cheapest wins (ties: more cached tokens, then less load, then
                  equal engines take turns)
    round-robin   the next healthy engine in turn
    least-loaded  the smallest load (then KV usage)

N is the prompt's token count, cached(e) the tokens engine e will serve from its prefix cache
(its published blocks plus the blocks routed to it whose events are pending, under its own
hit rule), load(e) its running + waiting requests (the router's own in flight now, plus
those the engine's `/metrics` showed at the last poll beyond the router's), kv_usage(e) in
[0, 1]. Costs are in prefill tokens: one
uncached prompt token costs `prefill_load_scale`. The `max_imbalance` cap keeps a hot prefix
from pinning all traffic to one engine (its requests spill to the next cheapest engine).

Reasons (the `reason` label of the router's request counter): `prefix` (the chosen engine
serves part of the prompt from cache), `spill` (the engine with the longest cached prefix was
over the load cap), `load` (no engine holds any of it: chosen by load), `round-robin`,
`least-loaded`, `retry` (the first engine failed before answering), `only-engine`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

POLICIES = ("kv", "round-robin", "least-loaded")


@dataclass(frozen=True)
class ScoringConfig:
    prefill_load_scale: float = 1.0  # cost of one uncached prompt token
    request_load_tokens: float = 32.0  # cost of one running or waiting request, in tokens
    kv_usage_tokens: float = 128.0  # cost of a full KV cache, in tokens
    max_imbalance: int = 4  # requests above the least-loaded engine before a prefix spills

    def __post_init__(self) -> None:
        for name in ("prefill_load_scale", "request_load_tokens", "kv_usage_tokens"):
            value = getattr(self, name)
            if not value >= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0, got {value}")
        if self.max_imbalance < 0:
            raise ValueError(f"--max-imbalance must be >= 0, got {self.max_imbalance}")


@dataclass(frozen=True)
class EngineView:
    """One healthy engine as the policy sees it for one request."""

    name: str
    cached_tokens: int  # what it will serve from cache, pending routed blocks included
    load_requests: int  # running + waiting
    kv_usage: float  # 0..1


@dataclass(frozen=True)
class Decision:
    engine: str
    reason: str
    costs: dict[str, float]  # engine -> cost (kv policy; empty otherwise)


def kv_cost(view: EngineView, num_prompt_tokens: int, scoring: ScoringConfig) -> float:
    return (scoring.prefill_load_scale * (num_prompt_tokens - view.cached_tokens)
            + scoring.request_load_tokens * view.load_requests
            + scoring.kv_usage_tokens * view.kv_usage)


class Policy:
    def __init__(self, name: str, scoring: ScoringConfig | None = None) -> None:
        if name not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {name!r}")
        self.name = name
        self.scoring = scoring or ScoringConfig()
        self._turn = itertools.count()

    def choose(self, views: Sequence[EngineView], num_prompt_tokens: int) -> Decision | None:
        """The engine for one request among `views` (healthy engines, in configured order);
        None when there is none."""
        if not views:
            return None
        if len(views) == 1:
            return Decision(views[0].name, "only-engine", {})
        if self.name == "round-robin":
            return Decision(views[next(self._turn) % len(views)].name, "round-robin", {})
        if self.name == "least-loaded":
            best = min(views, key=lambda v: (v.load_requests, v.kv_usage))
            return Decision(best.name, "least-loaded", {})
        costs = {v.name: kv_cost(v, num_prompt_tokens, self.scoring) for v in views}
        cap = min(v.load_requests for v in views) + self.scoring.max_imbalance
        allowed = [v for v in views if v.load_requests <= cap]
        ranked = sorted(allowed, key=lambda v: (costs[v.name], -v.cached_tokens,
                                                 v.load_requests))
        top = ranked[0]
        tied = [v for v in ranked if (costs[v.name], v.cached_tokens, v.load_requests)
                == (costs[top.name], top.cached_tokens, top.load_requests)]
        best = tied[next(self._turn) % len(tied)] if len(tied) > 1 else top  # take turns
        longest = max(v.cached_tokens for v in views)
        if longest > best.cached_tokens and all(
                v.load_requests > cap for v in views if v.cached_tokens == longest):
            reason = "spill"
        elif best.cached_tokens > 0:
            reason = "prefix"
        else:
            reason = "load"
        return Decision(best.name, reason, costs)
