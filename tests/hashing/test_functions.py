"""Hash functions by name (golden values built by hand), the unknown-name error, NONE_HASH."""

from __future__ import annotations

import hashlib
import pickle

import cbor2
import pytest
import xxhash

from speckv.hashing.functions import HASH_ALGOS, get_hash_algo, make_none_hash

PARENT = bytes(range(32))
OBJ = (PARENT, (1, 2, 3), None)


def test_sha256_is_sha256_of_pickle_protocol_5() -> None:
    expected = hashlib.sha256(pickle.dumps(OBJ, protocol=5)).digest()
    assert get_hash_algo("sha256")(OBJ) == expected
    assert len(expected) == 32


def test_sha256_cbor_is_sha256_of_canonical_cbor() -> None:
    expected = hashlib.sha256(cbor2.dumps(OBJ, canonical=True)).digest()
    assert get_hash_algo("sha256_cbor")(OBJ) == expected


def test_xxhash_is_xxh3_128_of_pickle() -> None:
    expected = xxhash.xxh3_128_digest(pickle.dumps(OBJ, protocol=5))
    assert get_hash_algo("xxhash")(OBJ) == expected
    assert len(expected) == 16


def test_xxhash_cbor_is_xxh3_128_of_canonical_cbor() -> None:
    expected = xxhash.xxh3_128_digest(cbor2.dumps(OBJ, canonical=True))
    assert get_hash_algo("xxhash_cbor")(OBJ) == expected


def test_algorithms_differ_from_each_other() -> None:
    assert len({algo(OBJ) for algo in HASH_ALGOS.values()}) == len(HASH_ALGOS)


def test_unknown_name_lists_the_allowed_names() -> None:
    with pytest.raises(ValueError) as error:
        get_hash_algo("md5")
    for name in HASH_ALGOS:
        assert name in str(error.value)


@pytest.mark.parametrize("name", sorted(HASH_ALGOS))
def test_none_hash_from_pythonhashseed(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    algo = get_hash_algo(name)
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    assert make_none_hash(algo) == algo("1234")
    assert make_none_hash(algo) == make_none_hash(algo)  # separate processes agree


def test_none_hash_random_without_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    algo = get_hash_algo("sha256")
    first, second = make_none_hash(algo), make_none_hash(algo)
    assert len(first) == 32 and len(second) == 32
    assert first != second


def test_explicit_seed_wins() -> None:
    algo = get_hash_algo("xxhash")
    assert make_none_hash(algo, seed="abc") == algo("abc")
