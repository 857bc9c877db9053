"""The prefill side's lease table: admitted READs only for live leases and leased blocks."""

import pytest

from speckv.connectors.nixl.lease import LeaseRefused, LeaseTable


def test_lease_lifecycle_expiry_renewal_and_pins() -> None:
    table = LeaseTable(lease_s=30.0)
    lease = table.issue("r", [[4, 5, 6]], now=0.0)
    assert table.admit(lease.lease_id, [[4, 6]], now=1.0, pin_s=5.0).reads == 1
    with pytest.raises(LeaseRefused) as refused:
        table.admit(lease.lease_id, [[4, 7]], now=1.0, pin_s=5.0)
    assert refused.value.field == "block_ids[0]"
    with pytest.raises(LeaseRefused) as refused:
        table.admit(lease.lease_id, [[4], [5]], now=1.0, pin_s=5.0)
    assert refused.value.field == "block_ids"
    assert table.renew(lease.lease_id, now=29.0)  # now alive until 59
    assert table.expire(now=58.0) == []
    assert [dead.request_id for dead in table.expire(now=59.0)] == ["r"]
    with pytest.raises(LeaseRefused, match="no such lease"):
        table.admit(lease.lease_id, [[4]], now=59.0, pin_s=5.0)
    assert not table.renew(lease.lease_id, now=59.0)


def test_a_pinned_lease_outlives_its_expiry_until_the_pin_ends() -> None:
    table = LeaseTable(lease_s=1.0)
    lease = table.issue("r", [[1]], now=0.0)
    table.admit(lease.lease_id, [[1]], now=0.9, pin_s=10.0)
    assert table.expire(now=5.0) == []
    assert table.release(lease.lease_id) is not None
    assert table.release(lease.lease_id) is None  # released once
    assert len(table) == 0


def test_an_expired_lease_refuses_a_read() -> None:
    table = LeaseTable(lease_s=1.0)
    lease = table.issue("r", [[1]], now=0.0)
    with pytest.raises(LeaseRefused, match="expired"):
        table.admit(lease.lease_id, [[1]], now=1.0, pin_s=10.0)
