"""The scheduler's asynchronous KV connector seams, over the toy runner and a fake remote engine.

`FakeRemoteConnector` (speckv.simulation) keeps its blocks in real paged tensors: a prefill engine
sends a finished request's blocks with `delay_free`, a decode engine loads them asynchronously
(WAITING_FOR_REMOTE_KVS) on a seeded schedule. Checked: an async hit holds what a cold run
writes (the toy runner checks every hit slot), the step serves other requests meanwhile, load
failures under both policies, an abort while the load runs, delayed frees, the
`kv_transfer_params` both ways, and pool integrity after every step.
"""

from __future__ import annotations

import random

import pytest

from speckv.cache import FullAttentionSpec, KVCacheManager
from speckv.cache.block import make_cache_key
from speckv.cache.drafter_policy import drafter_policy
from speckv.engine.messages import FinishReason
from speckv.engine.request import Request, RequestStatus
from speckv.engine.sampling_params import SamplingParams
from speckv.engine.speculative import resolve_connector_hash_mode
from speckv.simulation import PagedSymbolicKV, toy_core
from tests.doubles.remote import FakeRemoteConnector, RemoteBlocks

B = 4
POLICY = drafter_policy("eagle", 1)


class Toy:
    """One toy engine over a fake remote connector: the real scheduler and cache manager."""

    def __init__(self, connector: FakeRemoteConnector, num_blocks: int = 24,
                 policy: str = "recompute", max_num_seqs: int = 8) -> None:
        self.connector = connector
        mode = resolve_connector_hash_mode(POLICY, connector=connector,
                                           disable_lookahead_block_hashes=False)
        self.manager = KVCacheManager([FullAttentionSpec(B)], num_blocks, mode)
        self.hashing = self.manager.block_hashing("sha256", "0")
        self.core = toy_core(self.manager, 2, vocab_size=50,
                             kv=PagedSymbolicKV(num_blocks, B, POLICY.draft_kv_lookahead_tokens),
                             connector=connector, check_computed_kv=True,
                             load_failure_policy=policy, max_num_seqs=max_num_seqs)
        self.scheduler = self.core.scheduler
        self.outputs: dict[str, list] = {}

    def add(self, request_id: str, prompt: list[int], max_tokens: int = 3,
            params: dict | None = None) -> None:
        sampling = SamplingParams(max_tokens=max_tokens, kv_transfer_params=params)
        self.scheduler.add_request(Request(request_id, prompt, self.hashing,
                                           max_tokens=max_tokens, sampling_params=sampling))

    def step(self) -> list:
        outputs = self.core.step()
        for output in outputs:
            self.outputs.setdefault(output.request_id, []).append(output)
        self.check()
        return outputs

    def check(self) -> None:
        """Pool integrity, and no block a transfer still touches is free."""
        self.manager.check_integrity()
        pool = self.manager.pool
        for block_id in self.connector.sending_block_ids():
            assert pool.blocks[block_id].ref_cnt > 0, f"block {block_id} freed while sent"
        for request_id in self.connector.receiving:
            for block_id in self.manager.get_block_ids(request_id)[0]:
                assert pool.blocks[block_id].ref_cnt > 0, f"block {block_id} freed while loaded"

    def run(self, max_steps: int = 100) -> None:
        for _ in range(max_steps):
            if not self.scheduler.has_unfinished_requests():
                return
            self.step()
        raise AssertionError("the engine did not finish")

    def tokens(self, request_id: str) -> list[int]:
        return [t for output in self.outputs[request_id] for t in output.new_token_ids]

    def final(self, request_id: str):
        return self.outputs[request_id][-1]


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50) for _ in range(length)]


def _prefilled(prompt: list[int]) -> RemoteBlocks:
    """What a prefill engine sent for `prompt` (run there to the end, its blocks sent)."""
    remote = RemoteBlocks()
    prefill = Toy(FakeRemoteConnector(remote, send_on_finish=True, send_steps=1))
    prefill.add("p", prompt)
    prefill.run()
    assert remote.blocks
    return remote


def test_an_async_hit_reads_what_a_cold_run_writes_and_the_step_goes_on_meanwhile():
    prompt = _prompt(21, seed=1)
    remote = _prefilled(prompt)
    cold = Toy(FakeRemoteConnector(RemoteBlocks()))
    cold.add("c", prompt)
    cold.run()
    decode = Toy(FakeRemoteConnector(remote, min_load_steps=2, max_load_steps=2))
    decode.add("c", prompt)
    decode.add("other", _prompt(6, seed=2))
    decode.step()
    # the other request ran; ours waits for its KV without blocking the step
    assert [output.request_id for output in decode.outputs["other"]] == ["other"]
    assert decode.scheduler.get_request("c").status is RequestStatus.WAITING_FOR_REMOTE_KVS
    assert "c" not in decode.outputs
    decode.run()
    final = decode.final("c")
    assert final.num_cached_tokens == final.num_external_cached_tokens == 20
    assert decode.core.runner.num_hits_checked >= 20  # every loaded slot matched a cold run
    assert decode.tokens("c") == cold.tokens("c")
    assert decode.scheduler.num_held_requests == 0


def test_a_loaded_block_is_cached_only_once_the_load_succeeded():
    prompt = _prompt(21, seed=3)
    decode = Toy(FakeRemoteConnector(_prefilled(prompt), min_load_steps=3, max_load_steps=3))
    decode.add("c", prompt)
    decode.step()
    # while the load runs, a second request with the same prompt finds nothing local
    assert decode.manager.get_computed_blocks(decode.scheduler.get_request("c")
                                              ).num_computed_tokens == 0
    decode.run()
    decode.add("again", prompt)
    decode.step()
    again = decode.final("again")
    assert again.num_cached_tokens == 20 and again.num_external_cached_tokens == 0


@pytest.mark.parametrize("failed_block", [0, 2])
def test_a_failed_async_load_recomputes_from_the_first_failed_token(failed_block):
    prompt = _prompt(21, seed=4)
    remote = _prefilled(prompt)
    cold = Toy(FakeRemoteConnector(RemoteBlocks()))
    cold.add("c", prompt)
    cold.run()
    probe = Toy(FakeRemoteConnector(remote))
    probe.add("c", prompt)
    hashes = probe.scheduler.get_request("c").get_block_hashes(probe.manager.hash_mode
                                                                .lookahead_tokens)
    bad = make_cache_key(hashes[failed_block], 0)
    decode = Toy(FakeRemoteConnector(remote, max_load_steps=2, seed=7,
                                     fail_blocks=frozenset({bad})))
    decode.add("c", prompt)
    decode.run()
    final = decode.final("c")
    assert final.finish_reason is FinishReason.LENGTH
    assert final.num_external_cached_tokens == failed_block * B
    assert decode.tokens("c") == cold.tokens("c")
    # the failed blocks were recomputed, never cached from the failed load
    decode.add("again", prompt)
    decode.step()
    assert decode.final("again").num_cached_tokens == 20


def test_the_fail_policy_ends_the_request_with_an_error_and_frees_its_blocks():
    prompt = _prompt(21, seed=5)
    remote = _prefilled(prompt)
    decode = Toy(FakeRemoteConnector(remote, fail_rate=1.0), policy="fail")
    free_before = decode.manager.get_num_free_blocks()
    decode.add("c", prompt)
    decode.add("other", _prompt(7, seed=6))
    decode.run()
    final = decode.final("c")
    assert final.finish_reason is FinishReason.ERROR
    assert "--kv-load-failure-policy fail" in final.error
    assert decode.final("other").finish_reason is FinishReason.LENGTH
    assert decode.scheduler.num_held_requests == 0
    # every block is free again (cached ones are free too)
    assert decode.manager.get_num_free_blocks() == free_before


def test_an_abort_while_the_load_runs_frees_the_blocks_only_after_it_landed():
    prompt = _prompt(21, seed=8)
    decode = Toy(FakeRemoteConnector(_prefilled(prompt), min_load_steps=3, max_load_steps=3))
    free_before = decode.manager.get_num_free_blocks()
    decode.add("c", prompt)
    decode.step()
    block_ids = list(decode.manager.get_block_ids("c")[0])
    assert block_ids and "c" in decode.connector.receiving
    decode.scheduler.finish_requests(["c"], FinishReason.ABORT)
    assert decode.scheduler.num_held_requests == 1
    # the load still writes these blocks: a filler that needs them waits for them
    decode.add("filler", _prompt(80, seed=9), max_tokens=2)
    while True:
        decode.step()
        if "c" not in decode.connector.receiving:
            break
        assert list(decode.manager.get_block_ids("c")[0]) == block_ids
        assert "filler" not in decode.outputs
    decode.run()
    assert decode.final("filler").finish_reason is FinishReason.LENGTH
    assert decode.scheduler.num_held_requests == 0
    assert decode.manager.get_num_free_blocks() == free_before


def test_delay_free_keeps_the_blocks_until_finished_sending_then_frees_them():
    prompt = _prompt(21, seed=10)
    remote = RemoteBlocks()
    prefill = Toy(FakeRemoteConnector(remote, send_on_finish=True, send_steps=3),
                  num_blocks=10)
    free_before = prefill.manager.get_num_free_blocks()
    prefill.add("p", prompt, max_tokens=1)
    prefill.step()
    final = prefill.final("p")
    assert final.finish_reason is FinishReason.LENGTH
    assert final.kv_transfer_params == {"remote_engine": "remote", "remote_request_id": "p",
                                        "num_blocks": 5}
    held = list(prefill.manager.get_block_ids("p")[0])
    assert prefill.scheduler.num_held_requests == 1 and not remote.blocks
    # a filler that needs every free block: it must wait, not take the sending blocks
    prefill.add("filler", _prompt(30, seed=11), max_tokens=1)
    while True:
        prefill.step()
        if not prefill.connector.sending:
            break
        assert list(prefill.manager.get_block_ids("p")[0]) == held
        assert "filler" not in prefill.outputs
    assert prefill.scheduler.num_held_requests == 0
    prefill.run()
    assert prefill.manager.get_num_free_blocks() == free_before
    # what was sent is the cold run's KV: a decode engine loading it checks every slot
    decode = Toy(FakeRemoteConnector(remote))
    decode.add("c", prompt)
    decode.run()
    assert decode.final("c").num_external_cached_tokens == 20


def test_a_request_id_stays_in_use_while_its_blocks_are_sent():
    prefill = Toy(FakeRemoteConnector(RemoteBlocks(), send_on_finish=True, send_steps=2))
    prefill.add("p", _prompt(9, seed=12), max_tokens=1)
    prefill.step()
    with pytest.raises(ValueError, match="already in use"):
        prefill.add("p", _prompt(9, seed=12))
    prefill.run()
    prefill.add("p", _prompt(9, seed=12))  # freed now


def test_kv_transfer_params_reach_the_connector():
    decode = Toy(FakeRemoteConnector(RemoteBlocks()))
    decode.add("c", _prompt(9, seed=13), params={"remote_engine": "prefill-0"})
    decode.step()
    assert decode.connector.seen_params["c"] == {"remote_engine": "prefill-0"}


def test_the_load_failure_policy_is_a_validated_flag():
    import argparse

    from speckv.engine.cli_args import add_engine_arguments, engine_args_from_cli
    from speckv.engine.engine_args import engine_config

    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    add_engine_arguments(parser)
    args = parser.parse_args(["builtin", "--kv-connector", "offload",
                              "--kv-load-failure-policy", "fail"])
    # the engine's one policy (tiers and transfer alike), not a connector config's copy
    assert engine_args_from_cli(args).create_engine_config().kv_load_failure_policy == "fail"
    config = engine_config(kv_connector="offload", kv_load_failure_policy="fail")
    assert config.kv_load_failure_policy == "fail"
    assert engine_config().kv_load_failure_policy == "recompute"  # no connector: the default
    with pytest.raises(ValueError, match="--kv-load-failure-policy"):
        engine_config(kv_connector="offload", kv_load_failure_policy="drop")
