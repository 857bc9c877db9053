"""`speckv bench soak`: short runs stay clean over group mixes and drafters, and a run whose
cache serves stale draft KV is caught and reported."""

from __future__ import annotations

import pytest

from speckv.bench import soak
from speckv.cache.hash_mode import HashMode


@pytest.mark.parametrize("groups,drafter,modules,legacy", [
    ("full:4", "eagle", 1, False),
    ("full:4", "mtp", 3, False),
    ("full:4", "eagle", 1, True),
    ("full:4,swa:9:4,mamba:16", "eagle", 1, False),
    ("full:2", "none", 1, False),
])
def test_short_soaks_are_clean(groups, drafter, modules, legacy):
    result = soak.run_soak(soak.SoakConfig(num_ops=3000, seed=1, groups=groups, drafter=drafter,
                                           num_modules=modules, legacy=legacy), progress=False)
    assert result.violation is None
    assert result.num_ops == 3000
    assert result.num_finished > 100 and result.num_aborted > 10
    assert result.num_hit_tokens_checked > 0


def test_preemption_happens_under_pressure():
    result = soak.run_soak(soak.SoakConfig(num_ops=5000, seed=2, num_blocks=24),
                           progress=False)
    assert result.violation is None and result.num_preemptions > 0


def test_stale_draft_kv_is_a_violation(monkeypatch):
    # legacy hashes without the drop: a hit may carry draft KV from another successor token
    monkeypatch.setattr(soak, "resolve_hash_mode", lambda *a, **k: HashMode.for_lookahead(0))
    result = soak.run_soak(soak.SoakConfig(num_ops=20000, seed=0), progress=False)
    assert result.violation is not None and "draft KV" in result.violation
    assert result.num_ops < 20000


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="--ops"):
        soak.SoakConfig(num_ops=0)
    with pytest.raises(ValueError, match="unknown drafter"):
        soak.SoakConfig(drafter="medusa")
