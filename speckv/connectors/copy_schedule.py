"""When a tier's queued stores run: on the copy thread, or at points a seeded schedule picks.

Owns the `CopySchedule` seam of `TierConnector`. By default a tier stores its snapshots on a
real copy thread, so which stores have settled when the engine thread looks (a lookup, a pin,
a load, the next snapshot) depends on timing, and a run that found a race may not find it
again. Under a schedule there is no thread: the connector calls `copies_at(point, queued)` at
every place the thread could have run between two engine-thread actions, and runs that many
queued stores right there, on the engine thread. A seeded schedule therefore draws the
interleaving from its seed, and the same seed replays it exactly.

    engine thread  lookup ─ pin ─ snapshot(save 1) ─ snapshot(save 2) ─ fetch ─ fetch ─ ...
    copy thread        ^      ^                    ^                  ^       ^
                       └──────┴──── CopyPoint: where a schedule may run k queued stores

The points (`CopyPoint`) are the engine thread's reads and writes of state the copy thread
also touches: the tier's index (lookups, pins), the staging slots (snapshots, fetches) and
the settled / in-flight bookkeeping (finished saves).
"""

from __future__ import annotations

import enum
import random
from typing import Protocol


class CopyPoint(enum.Enum):
    LOOKUP = "lookup"  # before a scheduler-side lookup of one block
    BEFORE_PIN = "before_pin"  # between a request's lookup and the pins of its load
    BUILD_META = "build_meta"  # a step's metadata is about to be built
    AFTER_QUEUE = "after_queue"  # a save's snapshots were just queued (more may follow)
    BEFORE_FETCH = "before_fetch"  # a load is about to read one block
    AFTER_LOADS = "after_loads"  # the step's loads are done
    FINISHED = "finished"  # the step's finished saves are about to be reported


class CopySchedule(Protocol):
    def copies_at(self, point: CopyPoint, num_queued: int) -> int:
        """How many of the `num_queued` queued stores to run now (0..num_queued)."""
        ...


class SeededCopySchedule:
    """Runs a random number of queued stores at each point, drawn from `seed`: at each point,
    with probability `eagerness` some stores run (how many: uniform in 1..queued), otherwise
    none. Low eagerness keeps the queue long (full queues, in-flight loads); high eagerness
    settles stores right after they are queued (slot reuse within one step)."""

    def __init__(self, seed: int, eagerness: float = 0.3) -> None:
        if not 0.0 <= eagerness <= 1.0:
            raise ValueError(f"eagerness must be in [0, 1], got {eagerness}")
        self._rng = random.Random(seed)
        self.eagerness = eagerness
        self.num_points = 0  # points passed (for reports)
        self.num_copies = 0  # stores run

    def copies_at(self, point: CopyPoint, num_queued: int) -> int:
        self.num_points += 1
        if num_queued == 0 or self._rng.random() >= self.eagerness:
            return 0
        count = self._rng.randint(1, num_queued)
        self.num_copies += count
        return count


class ScriptedCopySchedule:
    """Runs stores where a test says: `script[(point, n)]` stores at the n-th time (from 0)
    `point` is passed; none elsewhere. For regression tests of one exact interleaving."""

    def __init__(self, script: dict[tuple[CopyPoint, int], int]) -> None:
        self.script = dict(script)
        self._seen: dict[CopyPoint, int] = {}

    def copies_at(self, point: CopyPoint, num_queued: int) -> int:
        index = self._seen.get(point, 0)
        self._seen[point] = index + 1
        return min(num_queued, self.script.get((point, index), 0))


COPY_MODES = ("threaded", "replayable")
