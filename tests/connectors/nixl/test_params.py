"""`kv_transfer_params` and the peer layout check: a bad field is refused by name."""

import pytest

from speckv.cache.hash_mode import HashMode
from speckv.connectors.nixl.layout_desc import check_peer_layout, describe_layout
from speckv.connectors.nixl.params import (
    HashContract,
    ParamsError,
    parse_transfer_params,
    wants_remote_decode,
    wants_remote_prefill,
)
from tests.connectors.nixl.peer_helpers import CONTRACT, KVShape, make_kv

_CONTRACT = {"hash_algo": "sha256", "hash_seed": "0", "block_size": 4, "lookahead_tokens": 1,
             "drops_last_unit": False}
_PARAMS = {"engine_id": "p", "epoch": "e", "host": "127.0.0.1", "port": 5000, "lease_id": "l",
           "block_ids": [[1, 2]], "num_tokens": 8, "first_token_id": 3,
           "hash_contract": _CONTRACT, "manifest": [["00" * 32, "11" * 32]],
           "do_remote_prefill": True}


def test_params_round_trip_through_json() -> None:
    params = parse_transfer_params(_PARAMS)
    assert params.manifest[0][1] == b"\x11" * 32 and params.num_blocks == 2
    assert parse_transfer_params(params.to_json_obj()) == params
    assert wants_remote_prefill(params.to_json_obj())
    assert wants_remote_decode({"do_remote_decode": True}) and not wants_remote_decode({})


@pytest.mark.parametrize(("change", "field"), [
    ({"num_tokens": 7}, "num_tokens"),
    ({"block_ids": [[1]]}, "block_ids[0]"),
    ({"block_ids": [[-1, 1]]}, "block_ids[0]"),
    ({"block_ids": [[1, 1]]}, "block_ids[0]"),
    ({"manifest": [["00" * 32]]}, "manifest[0]"),
    ({"manifest": [["zz", "00"]]}, "manifest[0][0]"),
    ({"manifest": []}, "manifest"),
    ({"group_block_sizes": [4, 8]}, "group_block_sizes"),
    ({"block_ids": [[1, 2], [3]], "manifest": [["00", "11"], ["22"]],
      "group_block_sizes": [4, 16]}, "num_tokens"),
    ({"port": "x"}, "port"),
    ({"port": 0}, "port"),
    ({"hash_contract": {**_CONTRACT, "block_size": "4"}}, "hash_contract.block_size"),
    ({"lease_id": None}, "lease_id"),
    ({"surprise": 1}, "surprise"),
])
def test_a_bad_field_is_refused_by_name(change: dict, field: str) -> None:
    with pytest.raises(ParamsError) as refused:
        parse_transfer_params({**_PARAMS, **change})
    assert refused.value.field == field
    assert f"kv_transfer_params.{field}:" in str(refused.value)


def test_hash_contract_reads_the_engine_contract_and_names_a_mismatch() -> None:
    contract = {"hash_algo": "sha256", "hash_seed": "0", "block_size": 4,
                "hash_mode": {"lookahead_tokens": 1, "drops_last_unit": False}}
    ours = HashContract.from_contract(contract)
    assert ours == HashContract.of("sha256", "0", 4, HashMode.for_lookahead(1))
    assert ours.mismatch(HashContract.of("sha256", "0", 4, HashMode.legacy_drop())) \
        == "lookahead_tokens"


@pytest.mark.parametrize(("shape", "contract", "field"), [
    (KVShape(block_size=8), CONTRACT, "layout.block_size"),
    (KVShape(dtype="bfloat16"), CONTRACT, "layout.segments[target].dtype"),
    (KVShape(target_layers=3), CONTRACT, "layout.segments[target].planes"),
    (KVShape(head_dim=4), CONTRACT, "layout.segments[target].chunk_shape"),
    (KVShape(), HashContract("sha256", "1", 4, 1, False), "hash_contract.hash_seed"),
])
def test_a_peer_layout_mismatch_names_the_field(shape: KVShape, contract: HashContract,
                                                field: str) -> None:
    local = describe_layout(make_kv(KVShape(), None), "d", "e", "d-agent", CONTRACT)
    peer = describe_layout(make_kv(shape, None), "p", "e", "p-agent", contract)
    with pytest.raises(ParamsError) as refused:
        check_peer_layout(local, peer)
    assert refused.value.field == field


def test_a_peer_without_the_drafter_is_refused() -> None:
    kv = make_kv(KVShape(), None)
    local = describe_layout(kv, "d", "e", "d-agent", CONTRACT)
    from speckv.connectors.layout import DeviceKV
    peer = describe_layout(DeviceKV(kv.caches[0]), "p", "e", "p-agent", CONTRACT)
    with pytest.raises(ParamsError) as refused:
        check_peer_layout(local, peer)
    assert refused.value.field == "layout.segments"
