"""A decode engine talks only to prefill engines it was told about, and never waits on one.

Forged params (another host or port than `kv_peers` allows, a missing or wrong signature under
`kv_secret`) are refused when the request is added, naming the field, without a connection.
A black-hole side channel (accepts, never answers) and a killed prefill engine hold only the
request that names them: a concurrent request runs its steps while that transfer hangs. Idle
P/D engines use a few percent of a core, not a polling one.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from types import SimpleNamespace

import httpx
import pytest

from speckv.connectors import TransferParamsError
from speckv.connectors.nixl.config import NixlConfig
from speckv.connectors.nixl.transport import nixl_available
from speckv.connectors.nixl.trust import SECRET_ENV, PeerPolicy
from speckv.engine.engine_args import engine_config
from speckv.engine.request import RequestStatus
from speckv.engine.sampling_params import SamplingParams
from tests.connectors.nixl.pd_helpers import (
    decode,
    make_engine,
    prefill,
    prompt_of,
    run,
    settle,
    step_until,
)
from tests.patience import WATCHDOG_S
from tests.router.fleet_utils import MODEL_NAME
from tests.server.server_test_utils import make_server

pytestmark = pytest.mark.skipif(not nixl_available(), reason="needs nixl-cu12")
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
HANG_S = 60.0  # a transfer timeout no test run reaches: a hang shows as a request still waiting


class Listener:
    """A TCP listener that accepts every connection and never sends a byte."""

    def __init__(self) -> None:
        self.socket = socket.create_server(("127.0.0.1", 0))
        self.port = self.socket.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                self.accepted.append(self.socket.accept()[0])
            except OSError:
                return

    def close(self) -> None:
        self.socket.close()
        for connection in self.accepted:
            connection.close()


@pytest.fixture
def listener():
    hole = Listener()
    yield hole
    hole.close()


def _finished(engine, request_id: str) -> bool:
    return engine.scheduler.get_request(request_id) is None


def _waiting(engine, request_id: str) -> bool:
    request = engine.get_request(request_id)
    return request.status == RequestStatus.WAITING_FOR_REMOTE_KVS and not request.output_token_ids


def _runs_beside(engine, hung_id: str) -> int:
    """Run a plain request next to `hung_id`; its steps, with `hung_id` still waiting for its
    KV when it finished (the engine never waited on that request's peer)."""
    plain = engine.add_request(prompt_of(9, seed=40), GREEDY)
    steps = step_until(engine, lambda: _finished(engine, plain), cpu_budget_s=3 * HANG_S)
    assert _waiting(engine, hung_id), "the hung transfer resolved: a step waited on its peer"
    return steps


def test_the_policy_trusts_loopback_by_default_then_kv_peers_and_signatures(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    params = {"host": "192.0.2.7", "port": 5600, "lease_id": "x"}
    with pytest.raises(TransferParamsError, match="not a loopback address") as refused:
        PeerPolicy.parse(None, None).check(params)
    assert refused.value.param == "kv_transfer_params.host"
    PeerPolicy.parse(None, None).check({**params, "host": "127.0.0.1"})
    PeerPolicy.parse(None, None).check({**params, "host": "::1"})
    peers = PeerPolicy.parse(["192.0.2.7:5600", "[fd00::1]"], None)
    peers.check(params)
    peers.check({**params, "host": "FD00:0::1", "port": 1})
    for forged in ({**params, "port": 5601}, {**params, "host": "127.0.0.1"}):
        with pytest.raises(TransferParamsError, match="kv_peers") as refused:
            peers.check(forged)
        assert refused.value.field == "host"
    signed = PeerPolicy.parse(None, "s3cret")
    good = signed.signed(dict(params))
    signed.check(good)  # any host the signer names
    for forged in (params, {**good, "host": "192.0.2.8"}, {**good, "signature": "0" * 64}):
        with pytest.raises(TransferParamsError) as refused:
            signed.check(forged)
        assert refused.value.param == "kv_transfer_params.signature"
    with pytest.raises(TransferParamsError, match="signed with another secret"):
        PeerPolicy.parse(None, "other").check(good)
    monkeypatch.setenv(SECRET_ENV, "s3cret")
    PeerPolicy.parse(None, None).check(good)


def test_the_transfer_config_reads_kv_peers_and_kv_secret(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    config = NixlConfig.parse({"kv_connector": "nixl", "kv_role": "kv_consumer",
                               "kv_connector_extra_config": {"kv_peers": ["10.0.0.5:5600"],
                                                             "kv_secret": "s"}})
    assert config.policy.describe() == "peers 10.0.0.5:5600; signed params only"
    assert "'s'" not in repr(config)  # the secret stays out of logs
    for extra, words in [({"kv_peer": []}, "kv_peer"), ({"kv_peers": "10.0.0.5"}, "a list"),
                         ({"kv_peers": ["10.0.0.5:x"]}, "no valid port"),
                         ({"kv_secret": ""}, "non-empty")]:
        with pytest.raises(ValueError, match=words):
            NixlConfig.parse({"kv_connector": "nixl", "kv_role": "kv_consumer",
                              "kv_connector_extra_config": extra})


def test_a_forged_host_is_refused_before_any_connection(tiny_model, listener):
    prompt = prompt_of(31, seed=31)
    with make_engine(tiny_model, None, "kv_producer") as p:
        params = prefill(p, prompt).kv_transfer_params
        allowed = {"kv_connector_extra_config": {
            "kv_peers": [f"{params['host']}:{params['port']}"]}}
        with make_engine(tiny_model, None, "kv_consumer", transfer_options=allowed) as d:
            plain = d.add_request(prompt_of(9, seed=40), GREEDY)
            d.step()
            forged = dict(params, port=listener.port)
            with pytest.raises(ValueError, match="not in this decode engine's kv_peers") \
                    as refused:
                d.add_request(prompt, SamplingParams(max_tokens=4, kv_transfer_params=forged))
            assert refused.value.param == "kv_transfer_params.host"
            d.transfer_abandoned(forged)  # a refused request's lease is not released there
            d.transfer_abandoned(dict(params, lease_id="0" * 24))  # a trusted peer's is
            steps = step_until(d, lambda: _finished(d, plain))
            assert steps <= GREEDY.max_tokens  # the plain request never stopped
            got = decode(d, prompt, params)  # the genuine params still transfer
            assert got.num_external_cached_tokens == params["num_tokens"]
            settle(p)
    # the control thread sends in order: the trusted release went after the refused one
    assert listener.accepted == []


def test_signed_params_transfer_and_altered_ones_are_refused(tiny_model, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    prompt = prompt_of(31, seed=32)
    secret = {"kv_connector_extra_config": {"kv_secret": "s3cret"}}
    with make_engine(tiny_model, None) as single:
        expected = run(single, prompt, GREEDY)
    with make_engine(tiny_model, None, "kv_producer", transfer_options=secret) as p, \
            make_engine(tiny_model, None, "kv_consumer", transfer_options=secret) as d, \
            make_engine(tiny_model, None, "kv_producer") as unsigned:
        params = prefill(p, prompt).kv_transfer_params
        assert len(params["signature"]) == 64
        for forged in (dict(params, port=params["port"] + 1),
                       dict(params, num_tokens=params["num_tokens"] - 4),
                       prefill(unsigned, prompt).kv_transfer_params):
            with pytest.raises(ValueError, match=r"kv_transfer_params\.signature"):
                d.add_request(prompt, SamplingParams(max_tokens=4, kv_transfer_params=forged))
        # a router passes the JSON on: a round trip keeps it valid
        got = decode(d, prompt, json.loads(json.dumps(params)), GREEDY.max_tokens)
        assert got.token_ids == expected.token_ids
        assert got.num_external_cached_tokens == params["num_tokens"]
        settle(p)


def test_a_black_hole_peer_holds_only_its_own_request(tiny_model, listener):
    prompt = prompt_of(31, seed=33)
    hang = {"kv_transfer_timeout_s": HANG_S}
    with make_engine(tiny_model, None, "kv_producer") as p, \
            make_engine(tiny_model, None, "kv_consumer", transfer_options=hang) as d:
        params = dict(prefill(p, prompt).kv_transfer_params, port=listener.port)
        hung = d.add_request(prompt, SamplingParams(max_tokens=4, ignore_eos=True,
                                                    kv_transfer_params=params))
        assert _runs_beside(d, hung) <= GREEDY.max_tokens
        assert listener.accepted  # it did try the peer its params name (a trusted one)
        d.abort_request(hung)


def test_a_killed_prefill_engine_holds_only_its_own_request(tiny_model):
    first, second = prompt_of(31, seed=34), prompt_of(27, seed=35)
    hang = {"kv_transfer_timeout_s": HANG_S}
    with make_engine(tiny_model, None, "kv_consumer", transfer_options=hang) as d:
        p = make_engine(tiny_model, None, "kv_producer")
        got = decode(d, first, prefill(p, first).kv_transfer_params)
        assert got.num_external_cached_tokens > 0  # a known peer now
        params = prefill(p, second).kv_transfer_params
        p.close()  # its side channel is gone
        hung = d.add_request(second, SamplingParams(max_tokens=4, ignore_eos=True,
                                                    kv_transfer_params=params))
        assert _runs_beside(d, hung) <= GREEDY.max_tokens
        d.abort_request(hung)


def test_idle_pd_engines_use_little_cpu(tiny_model):
    """Process CPU seconds over a wall-clock window: load elsewhere cannot add to them."""
    with make_engine(tiny_model, None, "kv_producer"), \
            make_engine(tiny_model, None, "kv_consumer"):
        time.sleep(0.5)  # start-up settles
        cpu, wall = time.process_time(), time.monotonic()
        time.sleep(3.0)
        cpu, wall = time.process_time() - cpu, time.monotonic() - wall
    # a polling progress thread costs ~1 CPU second per second per engine
    assert cpu < 0.2 * wall, f"two idle P/D engines used {cpu:.2f} CPU s in {wall:.2f} s"


@pytest.fixture(scope="module")
def decode_server(tiny_chat_model):
    config = engine_config(block_size=4, num_blocks=128, hash_seed="0", kv_transfer_config=
                           json.dumps({"kv_connector": "nixl", "kv_role": "kv_consumer"}))
    server = make_server(tiny_chat_model, config)
    yield SimpleNamespace(url=server.url)
    server.stop()


def test_the_api_answers_a_forged_host_with_a_400_naming_it(decode_server):
    params = {"do_remote_prefill": True, "engine_id": "p", "epoch": "e", "host": "192.0.2.7",
              "port": 5600, "lease_id": "l", "block_ids": [[1]], "num_tokens": 4,
              "first_token_id": 1, "manifest": [["00"]], "hash_contract": {
                  "hash_algo": "sha256", "hash_seed": "0", "block_size": 4,
                  "lookahead_tokens": 1, "drops_last_unit": False}}
    reply = httpx.post(f"{decode_server.url}/v1/completions", timeout=WATCHDOG_S, json={
        "model": MODEL_NAME, "prompt": "alpha beta", "max_tokens": 2,
        "kv_transfer_params": params})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "kv_transfer_params.host" and "192.0.2.7" in error["message"]
