"""Drafter policies and the hash-mode decision (`speckv.cache.drafter_policy`)."""

from __future__ import annotations

import pytest

from speckv.cache.drafter_policy import DRAFTER_NAMES, drafter_policy, resolve_hash_mode
from speckv.cache.hash_mode import HashMode


class Connector:
    def __init__(self, supports):
        self.supports_lookahead_block_hashes = supports


@pytest.mark.parametrize("name,lookahead", [
    ("none", 0), ("ngram", 0), ("draft_model", 0), ("eagle", 1), ("eagle3", 1),
    ("dflash", 0), ("dspark", 0), ("gemma4_mtp", 0),
])
def test_default_modes(name, lookahead):
    mode = resolve_hash_mode(drafter_policy(name))
    assert mode.lookahead_tokens == lookahead
    assert not mode.drops_last_unit


@pytest.mark.parametrize("modules", [1, 2, 4])
def test_mtp_lookahead_is_its_module_count(modules):
    assert resolve_hash_mode(drafter_policy("mtp", modules)).lookahead_tokens == modules


@pytest.mark.parametrize("name", ["eagle", "eagle3", "mtp"])
def test_disable_restores_legacy_and_drop(name):
    mode = resolve_hash_mode(drafter_policy(name), disable_lookahead_block_hashes=True)
    assert (mode.lookahead_tokens, mode.drops_last_unit) == (0, True)


def test_connector_capability_seam():
    eagle = drafter_policy("eagle")
    assert resolve_hash_mode(eagle, connector=Connector(False)).drops_last_unit
    assert resolve_hash_mode(eagle, connector=Connector(True)).lookahead_tokens == 1


@pytest.mark.parametrize("name", ["none", "gemma4_mtp", "dflash", "ngram"])
def test_non_eagle_drafters_never_drop(name):
    policy = drafter_policy(name)
    for mode in (resolve_hash_mode(policy, disable_lookahead_block_hashes=True),
                 resolve_hash_mode(policy, connector=Connector(False))):
        assert (mode.lookahead_tokens, mode.drops_last_unit) == (0, False)


def test_prefix_caching_off_means_plain_legacy():
    mode = resolve_hash_mode(drafter_policy("eagle"), enable_prefix_caching=False)
    assert (mode.lookahead_tokens, mode.drops_last_unit) == (0, False)


def test_bad_values_are_rejected_with_the_field_name():
    with pytest.raises(ValueError, match="unknown drafter 'medusa'"):
        drafter_policy("medusa")
    with pytest.raises(ValueError, match="num_modules"):
        drafter_policy("mtp", 0)
    with pytest.raises(ValueError, match="eagle has one module"):
        drafter_policy("eagle", 2)
    with pytest.raises(ValueError, match="exclusive"):
        HashMode(1, True, "x")
    assert "mtp" in DRAFTER_NAMES


def test_hash_mode_constructors():
    assert HashMode.for_lookahead(3).lookahead_tokens == 3
    assert HashMode.for_lookahead(0).label == "legacy"
    assert HashMode.legacy_drop().label == "legacy+drop"


def test_a_drafter_exposes_its_policy(tiny_model):
    from speckv.drafters.loaders import random_drafter

    eagle3 = random_drafter("eagle3", tiny_model, aux_layers=(0, 1, 1))
    assert eagle3.policy == drafter_policy("eagle3")
    mtp = random_drafter("mtp", tiny_model, num_modules=3)
    assert mtp.policy == drafter_policy("mtp", 3)
    assert mtp.draft_kv_lookahead_tokens == 3
