"""The scheduler through its public messages: token budget, chunked prefill, preemption order,
aborts while waiting / running / mid-speculation, block-id deltas, a request that no longer
fits. Driven by the toy runner (`speckv.simulation`) so each step's outcome is exact."""

from __future__ import annotations

import random

import pytest

from speckv.cache import FullAttentionSpec, KVCacheManager
from speckv.cache.hash_mode import HashMode
from speckv.engine.messages import FinishReason
from speckv.engine.request import Request, RequestStatus
from speckv.simulation import SymbolicKV, toy_core


def _prompt(length: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 30000) for _ in range(length)]


def _setup(num_blocks=64, block_size=4, num_spec=0, budget=1 << 20, max_num_seqs=64,
           lookahead=0):
    manager = KVCacheManager([FullAttentionSpec(block_size)], num_blocks,
                             HashMode.for_lookahead(lookahead))
    kv = SymbolicKV(num_blocks, block_size, max(lookahead, 1))
    core = toy_core(manager, num_spec, kv=kv, max_num_batched_tokens=budget,
                    max_num_seqs=max_num_seqs)
    hashing = manager.block_hashing("sha256", "0")

    def request(request_id, length, max_tokens=4, seed=0):
        return Request(request_id, _prompt(length, seed), hashing, max_tokens=max_tokens)

    return core, manager, request


def _step(core):
    """One step by hand: the scheduler output, then the update (as EngineCore.step does)."""
    scheduler_output = core.scheduler.schedule()
    outputs = core.scheduler.update_from_output(
        scheduler_output, core.runner.execute_model(scheduler_output))
    core.scheduler.manager.check_integrity()
    return scheduler_output, outputs


def test_chunked_prefill_respects_the_token_budget():
    core, _, request = _setup(budget=8)
    core.scheduler.add_request(request("a", 20))
    chunks = []
    while core.scheduler.has_unfinished_requests():
        scheduler_output, _ = _step(core)
        assert scheduler_output.num_scheduled_tokens <= 8
        chunks.append([(s.start, s.num_new_tokens, s.samples)
                       for s in scheduler_output.scheduled])
    # 20 prompt tokens in chunks of 8: only the chunk that reaches the last token samples
    assert chunks[:3] == [[(0, 8, False)], [(8, 8, False)], [(16, 4, True)]]
    assert len(chunks) == 3 + 3  # then one decode step per remaining output token


def test_running_requests_come_first_and_waiting_ones_fill_the_budget():
    core, _, request = _setup(budget=10)
    core.scheduler.add_request(request("a", 6, max_tokens=8))
    _step(core)
    core.scheduler.add_request(request("b", 20, seed=1))
    scheduler_output, _ = _step(core)
    assert [(s.request_id, s.num_new_tokens) for s in scheduler_output.scheduled] == [
        ("a", 1), ("b", 9)]


def test_block_ids_travel_as_deltas():
    core, manager, request = _setup(block_size=4)
    core.scheduler.add_request(request("a", 6, max_tokens=8))
    first, _ = _step(core)
    (item,) = first.scheduled
    assert item.replaces_block_table and [d.request_id for d in first.new_requests] == ["a"]
    table = list(item.new_block_ids[0])
    while core.scheduler.has_unfinished_requests():
        scheduler_output, _ = _step(core)
        for scheduled in scheduler_output.scheduled:
            assert not scheduled.replaces_block_table and not scheduler_output.new_requests
            table += scheduled.new_block_ids[0]
            assert table == core.runner.block_table("a")
        if core.scheduler.has_unfinished_requests():
            assert table == manager.get_block_ids("a")[0]


def test_preemption_takes_the_most_recent_request_and_it_rehits_its_blocks():
    # 10 usable blocks of 4: two 13-token prompts fit, their decodes do not
    core, manager, request = _setup(num_blocks=11, block_size=4)
    core.scheduler.add_request(request("old", 13, max_tokens=12))
    core.scheduler.add_request(request("new", 13, max_tokens=12, seed=1))
    preempted_first = None
    while core.scheduler.has_unfinished_requests() and preempted_first is None:
        scheduler_output, _ = _step(core)
        if scheduler_output.preempted_request_ids:
            preempted_first = set(scheduler_output.preempted_request_ids)
    assert preempted_first == {"new"}
    victim = core.scheduler.get_request("new")
    assert victim.status is RequestStatus.PREEMPTED and victim.num_computed_tokens == 0
    hits_before = core.runner.num_hits_checked
    finals = {}
    while core.scheduler.has_unfinished_requests():
        _, outputs = _step(core)
        finals.update({o.request_id: o for o in outputs if o.finish_reason})
    assert finals["new"].num_preemptions >= 1
    # the resumed request re-hit the blocks it had computed, and read a cold run's KV there
    assert core.runner.num_hits_checked > hits_before
    assert manager.get_num_free_blocks() == 10


@pytest.mark.parametrize("when", ["waiting", "running", "mid-speculation", "mid-prefill"])
def test_abort_frees_every_block(when):
    core, manager, request = _setup(num_spec=2, budget=6, lookahead=1)
    core.scheduler.add_request(request("a", 13, max_tokens=10))
    if when != "waiting":
        _step(core)
    if when in ("running", "mid-speculation"):
        while core.scheduler.get_request("a").num_computed_tokens < 13:
            _step(core)
        _step(core)
    state = core.scheduler.get_request("a")
    if when == "mid-speculation":
        assert state.spec_token_ids, "drafts are waiting for verification"
    if when == "mid-prefill":
        assert 0 < state.num_computed_tokens < 13
    core.scheduler.finish_requests(["a"], FinishReason.ABORT)
    assert state.status is RequestStatus.FINISHED_ABORTED
    assert not core.scheduler.has_unfinished_requests()
    assert manager.get_num_free_blocks() == 63
    manager.check_integrity()
    scheduler_output, outputs = _step(core)
    assert outputs == [] and scheduler_output.is_empty
    # the runner is told to forget it (unless it never saw it)
    assert ("a" in scheduler_output.finished_request_ids) is (when != "waiting")
    assert "a" not in core.runner.requests


def test_a_request_that_no_longer_fits_ends_with_an_error():
    core, manager, request = _setup(num_blocks=5, block_size=4)  # 16 tokens in all
    core.scheduler.add_request(request("a", 10, max_tokens=40))
    finals = []
    for _ in range(40):
        _, outputs = _step(core)
        finals += [o for o in outputs if o.finish_reason is not None]
        if finals:
            break
    (final,) = finals
    assert final.finish_reason is FinishReason.ERROR
    assert "no longer fit in the KV cache" in final.error
    assert manager.get_num_free_blocks() == 4


def test_an_id_in_use_is_refused():
    core, _, request = _setup()
    core.scheduler.add_request(request("a", 5))
    with pytest.raises(ValueError, match="already in use"):
        core.scheduler.add_request(request("a", 5))


def test_a_request_waiting_a_step_for_its_divergent_block_holds_up_no_one(world_factory):
    """Divergent block reuse: c's block 2 (a's tokens, another successor) is computed in this
    step by a, so c waits one step and copies it then, keeping its place in the queue; d,
    behind c, is admitted at once."""
    world = world_factory(block_size=4)
    core = toy_core(world.manager, 2, vocab_size=50, kv=SymbolicKV(64, 4, 1))
    shared = _prompt(12)
    a, c, d, e = (world.request(prompt) for prompt in (
        shared + [1, 2, 3], shared + [4, 5, 6], _prompt(10, seed=7), _prompt(9, seed=8)))
    for request in (a, c, d, e):
        core.scheduler.add_request(request)
    first, _ = _step(core)
    assert [s.request_id for s in first.scheduled] == [a.request_id, d.request_id, e.request_id]
    assert [r.request_id for r in core.scheduler.waiting] == [c.request_id]
    second, _ = _step(core)
    (admitted,) = [s for s in second.scheduled if s.replaces_block_table]
    assert admitted.request_id == c.request_id and admitted.num_hit_tokens == 11
    assert len(second.block_copies) == 1
    while core.scheduler.has_unfinished_requests():
        _step(core)  # the toy runner checks every hit's and every copy's KV
    assert core.runner.num_block_copies == 1
