"""The LRU bookkeeping of the tiers that own their blocks (the CPU pool, the disk store).

Owns `PinnedLru`: keys in least-recently-used order, a value per key (a slot, a file size),
and pin counts that keep a key from eviction (a key may be pinned before it is present: a load
pins what it is about to read). Not thread-safe on purpose: its owner calls it under its own
lock, in the same critical sections that change the owner's other state (reserved slots, byte
totals, keys being written).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterator
from typing import Generic, TypeVar

from speckv.cache.block import CacheKey

V = TypeVar("V")


class PinnedLru(Generic[V]):
    def __init__(self) -> None:
        self._entries: OrderedDict[CacheKey, V] = OrderedDict()  # oldest use first
        self._pins: Counter[CacheKey] = Counter()

    def __contains__(self, key: CacheKey) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: CacheKey) -> V | None:
        """The key's value, without counting a use."""
        return self._entries.get(key)

    def touch(self, key: CacheKey) -> None:
        """Count a use: the key becomes the most recently used (if present)."""
        if key in self._entries:
            self._entries.move_to_end(key)

    def add(self, key: CacheKey, value: V) -> None:
        """Insert (or replace) as the most recently used."""
        self._entries[key] = value
        self._entries.move_to_end(key)

    def pop(self, key: CacheKey) -> V | None:
        return self._entries.pop(key, None)

    def pin(self, key: CacheKey) -> None:
        self._pins[key] += 1

    def unpin(self, key: CacheKey) -> None:
        if self._pins[key] <= 1:
            del self._pins[key]
        else:
            self._pins[key] -= 1

    def unpinned(self) -> Iterator[tuple[CacheKey, V]]:
        """(key, value) of every unpinned key, least recently used first: eviction order.
        Do not change the LRU while iterating."""
        return ((key, value) for key, value in self._entries.items() if key not in self._pins)

    def take_unpinned(self) -> list[tuple[CacheKey, V]]:
        """Remove every unpinned key; their (key, value), oldest first."""
        taken = list(self.unpinned())
        for key, _ in taken:
            del self._entries[key]
        return taken
