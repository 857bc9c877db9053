"""Model-free drivers of the real scheduler: a toy runner and a symbolic KV store.

Property tests, the cache benchmarks, the KV-event samples and the soak run the real
`Scheduler` through `EngineCore` with `ToyRunner` in place of the model: a fixed next-token
rule decides which drafts are accepted, and `SymbolicKV` records what every KV slot was
computed from, so a cache hit can be checked against what a cold run would write.
"""

from speckv.testing.toy_runner import (
    HitMismatch,
    SymbolicKV,
    ToyRunner,
    next_token,
    run_to_completion,
    toy_core,
)

__all__ = ["HitMismatch", "SymbolicKV", "ToyRunner", "next_token", "run_to_completion", "toy_core"]
