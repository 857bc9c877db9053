"""Model-free drivers of the real scheduler: a toy runner and a symbolic KV store.

Property tests, the cache benchmarks, the KV-event samples and the soak run the real
`Scheduler` through `EngineCore` with `ToyRunner` in place of the model: a fixed next-token
rule decides which drafts are accepted, and `SymbolicKV` records what every KV slot was
computed from, so a cache hit can be checked against what a cold run would write.
`PagedSymbolicKV` keeps those facts in real paged tensors so real KV connectors can move them
(`tiers.py` checks every block a tier stores or serves, and injects load failures).
`FakeRemoteConnector` (`remote.py`) is a remote engine in process: asynchronous loads and
delayed frees on a seeded schedule.
"""

from speckv.testing.paged_kv import PagedSymbolicKV
from speckv.testing.remote import FakeRemoteConnector, RemoteBlocks
from speckv.testing.tiers import CheckedStore, instrument_tiers
from speckv.testing.toy_runner import (
    HitMismatch,
    SymbolicKV,
    ToyRunner,
    next_token,
    run_to_completion,
    toy_core,
)

__all__ = [
    "CheckedStore",
    "FakeRemoteConnector",
    "HitMismatch",
    "PagedSymbolicKV",
    "RemoteBlocks",
    "SymbolicKV",
    "ToyRunner",
    "instrument_tiers",
    "next_token",
    "run_to_completion",
    "toy_core",
]
