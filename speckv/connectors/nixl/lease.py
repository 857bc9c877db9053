"""The prefill side's lease table: which blocks it keeps for which decode engine, until when.

Owns every lease a prefill engine issued. A lease holds one finished request's blocks (its
`delay_free`) until the decode engine says it is done (its READ completed, or it gave up), or
until the lease expires (30 s by default, renewed by heartbeats). A READ is served only for
blocks under a live lease: the decode engine asks `admit` first, which pins the lease for the
transfer (a pinned lease does not expire before its pin deadline), and `release` ends it.
Time is passed in (`now`, seconds on a monotonic clock), so the table is pure and testable.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

DEFAULT_LEASE_S = 30.0


class LeaseRefused(Exception):
    """A READ the lease table will not serve; `reason` in words, `field` the params field."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field = field
        self.reason = reason


@dataclass
class Lease:
    lease_id: str
    request_id: str
    block_ids: tuple[tuple[int, ...], ...]  # per KV group
    expires_at: float
    pinned_until: float = 0.0
    reads: int = field(default=0)  # admitted READs


class LeaseTable:
    """Leases by id. Not thread-safe: one owner (the connector's scheduler side) calls it."""

    def __init__(self, lease_s: float = DEFAULT_LEASE_S) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s!r}")
        self.lease_s = lease_s
        self._leases: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, lease_id: str) -> bool:
        return lease_id in self._leases

    def get(self, lease_id: str) -> Lease | None:
        return self._leases.get(lease_id)

    def issue(self, request_id: str, block_ids: Sequence[Sequence[int]], now: float,
              lease_s: float | None = None) -> Lease:
        """A new lease over `block_ids` (per KV group), `lease_s` (default: the table's) long."""
        lease = Lease(secrets.token_hex(12), request_id,
                      tuple(tuple(int(b) for b in group) for group in block_ids),
                      now + (self.lease_s if lease_s is None else lease_s))
        self._leases[lease.lease_id] = lease
        return lease

    def _live(self, lease_id: str, now: float) -> Lease:
        lease = self._leases.get(lease_id)
        if lease is None:
            raise LeaseRefused("lease_id", "no such lease (released, expired, or issued by "
                               "another engine or epoch)")
        if now >= lease.expires_at and now >= lease.pinned_until:
            raise LeaseRefused("lease_id", "the lease expired")
        return lease

    def renew(self, lease_id: str, now: float) -> bool:
        """A heartbeat: push the expiry out by a lease period. False if it is not live."""
        try:
            lease = self._live(lease_id, now)
        except LeaseRefused:
            return False
        lease.expires_at = now + self.lease_s
        return True

    def admit(self, lease_id: str, block_ids: Sequence[Sequence[int]], now: float,
              pin_s: float) -> Lease:
        """Allow one READ of `block_ids` (a subset, per group, of the lease's blocks); the lease
        stays alive at least `pin_s` more seconds. LeaseRefused otherwise."""
        lease = self._live(lease_id, now)
        if len(block_ids) > len(lease.block_ids):
            raise LeaseRefused("block_ids", f"{len(block_ids)} KV groups, the lease holds "
                               f"{len(lease.block_ids)}")
        for group, ids in enumerate(block_ids):
            leased = set(lease.block_ids[group])
            stray = [b for b in ids if b not in leased]
            if stray:
                raise LeaseRefused(f"block_ids[{group}]", f"blocks {stray[:4]} are not under "
                                   "this lease")
        lease.pinned_until = max(lease.pinned_until, now + pin_s)
        lease.expires_at = max(lease.expires_at, now + pin_s)
        lease.reads += 1
        return lease

    def release(self, lease_id: str) -> Lease | None:
        """End a lease (the decode side is done with it); its blocks may be freed. None if it
        was not held (already released or expired)."""
        return self._leases.pop(lease_id, None)

    def expire(self, now: float) -> list[Lease]:
        """Remove and return every lease past its expiry and its pin."""
        dead = [lease for lease in self._leases.values()
                if now >= lease.expires_at and now >= lease.pinned_until]
        for lease in dead:
            del self._leases[lease.lease_id]
        return dead
