"""Model-free drivers of the real scheduler: a toy runner and a symbolic KV store.

Property tests, the cache benchmarks, the KV-event samples and the soak run the real
`Scheduler` through `EngineCore` with `ToyRunner` in place of the model: a fixed next-token
rule decides which drafts are accepted, and `SymbolicKV` records what every KV slot was
computed from, so a cache hit can be checked against what a cold run would write.
`PagedSymbolicKV` keeps those facts in real paged tensors so real KV connectors can move them
(`tiers.py` checks every block a tier stores or serves, and injects load failures).
The cache benchmarks, the soak and `speckv events publish-sample` run on it as a model-free
engine; the test doubles (a fake remote engine, an echo assistant) live in `tests/doubles/`.
"""

from speckv.simulation.paged_kv import PagedSymbolicKV
from speckv.simulation.symbolic_kv import HitMismatch, SymbolicKV
from speckv.simulation.tiers import CheckedStore, instrument_tiers
from speckv.simulation.toy_runner import (
    ToyRunner,
    next_token,
    run_to_completion,
    toy_core,
)

__all__ = [
    "CheckedStore",
    "HitMismatch",
    "PagedSymbolicKV",
    "SymbolicKV",
    "ToyRunner",
    "instrument_tiers",
    "next_token",
    "run_to_completion",
    "toy_core",
]
