"""`PendingParts`: requests waiting on several parts of a connector to report them done.

Owns the bookkeeping a connector made of parts needs when each part reports a request on its
own (a multi-connector's children finishing saves or sends, a hybrid tier's per-group lanes
finishing saves): the request is done once every part it waits on has reported it.
"""

from __future__ import annotations

from collections.abc import Iterable


class PendingParts:
    """Request id -> the parts (indices) that have not reported it yet."""

    def __init__(self) -> None:
        self._waiting: dict[str, set[int]] = {}

    def expect(self, request_id: str, parts: Iterable[int]) -> None:
        """`request_id` is done once each of `parts` reports it (no parts: nothing to wait
        for, so it is never listed). Mutates."""
        waiting = set(parts)
        if waiting:
            self._waiting[request_id] = waiting

    def report(self, part: int, request_ids: Iterable[str]) -> list[str]:
        """Part `part` is done with `request_ids`; returns those now done by every part (ids
        nothing waits on are ignored). Mutates."""
        done = []
        for request_id in request_ids:
            waiting = self._waiting.get(request_id)
            if waiting is None:
                continue
            waiting.discard(part)
            if not waiting:
                del self._waiting[request_id]
                done.append(request_id)
        return done
