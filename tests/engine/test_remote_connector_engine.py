"""The engine (tiny random model, real tensors) with a fake remote engine as its KV connector.

A prefill engine sends a finished request's target and draft KV (`delay_free`: its blocks stay
held until the send is done); a decode engine loads it asynchronously (the request waits in
WAITING_FOR_REMOTE_KVS while the step serves others). The decode engine's output and loaded KV
are those of a synchronous tier hit of the same length (the same computation, exactly), and its
greedy tokens those of a cold run, as for every tier hit.
"""

from __future__ import annotations

import random

import torch

from speckv.bench.draft_kv import kv_at, target_kv
from speckv.drafters.loaders import random_drafter
from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.request import RequestStatus
from speckv.engine.sampling_params import SamplingParams
from speckv.engine.speculative import speculative_args
from tests.doubles.remote import FakeRemoteConnector, RemoteBlocks
from tests.patience import WATCHDOG_S

B = 4
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(96) for _ in range(length)]


def _engine(model, drafter, connector=None, **overrides) -> LLMEngine:
    overrides.setdefault("adaptive_speculation", False)  # a fixed draft length, no clock
    config = engine_config(block_size=B, num_blocks=overrides.pop("num_blocks", 64),
                           hash_seed="0", **speculative_args(drafter, 2), **overrides)
    return LLMEngine(model, config, drafter=drafter, detokenize=False, connector=connector)


def _run(engine: LLMEngine, prompts, params=GREEDY, watch=None):
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    final, kv = {}, None
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                final[output.request_id] = output
        engine.manager.check_integrity()
        if watch is not None and kv is None:
            request = engine.scheduler.get_request(ids[0])
            if request is not None and request.status is RequestStatus.RUNNING:
                kv = watch(engine, ids[0])
    return [final[request_id] for request_id in ids], kv


def _hit_kv(num_tokens: int):
    def read(engine: LLMEngine, request_id: str):
        draft_ids = engine.runner.block_table(request_id, engine.runner.draft_group)
        return (target_kv(engine, request_id, num_tokens),
                kv_at(engine.proposer.kv_cache, draft_ids, num_tokens, B))
    return read


def test_an_async_load_decodes_and_holds_what_a_tier_hit_does(tiny_model):
    drafter = random_drafter("eagle", tiny_model, init_std=0.2, seed=5)
    prompt = _prompt(31, seed=3)
    remote = RemoteBlocks()
    with _engine(tiny_model, drafter, FakeRemoteConnector(
            remote, send_on_finish=True, send_steps=2)) as prefill:
        (sent,), _ = _run(prefill, [prompt])
        assert prefill.scheduler.num_held_requests == 0
    assert sent.kv_transfer_params["num_blocks"] == len(remote.blocks) > 0
    num_hit = 28  # whole blocks before the last token, with lookahead L = 1
    with _engine(tiny_model, drafter, kv_connector="offload", kv_offload_gib=0.01) as tier:
        _run(tier, [prompt])
        assert tier.flush_kv_connector(timeout_s=WATCHDOG_S) and tier.reset_prefix_cache()
        (expected,), (tier_target, tier_draft) = _run(tier, [prompt], watch=_hit_kv(num_hit))
    with _engine(tiny_model, drafter) as plain:
        (cold,), _ = _run(plain, [prompt])
    connector = FakeRemoteConnector(remote, min_load_steps=2, max_load_steps=2)
    with _engine(tiny_model, drafter, connector) as decode:
        other = decode.add_request(_prompt(9, seed=4), GREEDY)
        request_id = decode.add_request(prompt, GREEDY)
        outputs = decode.step()
        assert [output.request_id for output in outputs] == [other]  # served meanwhile
        assert (decode.scheduler.get_request(request_id).status
                is RequestStatus.WAITING_FOR_REMOTE_KVS)
        final, kv = {}, None
        while decode.has_unfinished_requests():
            for output in decode.step():
                if output.finished:
                    final[output.request_id] = output
            decode.manager.check_integrity()
            request = decode.scheduler.get_request(request_id)
            if kv is None and request is not None and request.status is RequestStatus.RUNNING:
                kv = _hit_kv(num_hit)(decode, request_id)
    output = final[request_id]
    assert output.num_cached_tokens == output.num_external_cached_tokens == num_hit
    assert expected.num_external_cached_tokens == num_hit
    assert output.token_ids == expected.token_ids == cold.token_ids
    assert torch.equal(kv[0], tier_target) and torch.equal(kv[1], tier_draft)
    assert connector.loaded_blocks == num_hit // B
