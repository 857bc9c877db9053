"""Divergent block reuse on real tensors: a request sharing a prefix of whole blocks with a
cached one, then going on differently, hits the whole prefix minus the last L tokens; it reads
a cold run's target and draft KV, and its greedy output is a cold run's."""

from __future__ import annotations

import pytest
import torch

from speckv.drafters.loaders import random_drafter
from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import SamplingParams

B = 4
PREFIX = [(5 * j) % 90 + 1 for j in range(3 * B)]  # three whole blocks, then the tails
TAIL_A = [7, 8, 9, 10, 11]
TAIL_B = [20, 21, 22, 23, 24]  # as long as TAIL_A: the two prefills have the same shapes
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)


def _engine(model, drafter, fmt: str, reuse: bool = True) -> LLMEngine:
    config = engine_config(block_size=B, num_blocks=64, speculative_method=fmt,
                           num_spec_tokens=2, disable_divergent_block_reuse=not reuse)
    return LLMEngine(model, config, drafter=drafter)


def _finish(engine: LLMEngine, request_id: str) -> list[int]:
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.request_id == request_id and output.finished:
                tokens = list(output.token_ids)
        engine.manager.check_integrity()
    return tokens


def _kv(engine: LLMEngine, request_id: str, num_blocks: int) -> tuple[torch.Tensor, ...]:
    """(target, draft) KV of a request's first blocks: [layers, 2, blocks, B, heads, dim]."""
    blocks = engine.manager.get_block_ids(request_id)[0][:num_blocks]
    return (engine.runner.kv_cache.storage[:, :, blocks].clone(),
            engine.proposer.kv_cache.storage[:, :, blocks].clone())


@pytest.mark.exactness
@pytest.mark.parametrize("fmt,kwargs", [("eagle", {}), ("eagle3", {"aux_layers": (0, 1, 1)}),
                                        ("mtp", {"num_modules": 2})])
def test_a_copied_block_reads_a_cold_runs_kv(tiny_model, fmt, kwargs):
    drafter = random_drafter(fmt, tiny_model, init_std=0.2, seed=2, **kwargs)
    lookahead = drafter.draft_kv_lookahead_tokens
    warm = _engine(tiny_model, drafter, fmt)
    warm.add_request(PREFIX + TAIL_A, PARAMS, "a")
    _finish(warm, "a")
    warm.add_request(PREFIX + TAIL_B, PARAMS, "b")
    (first,) = warm.step()
    warm.manager.check_integrity()
    assert first.num_cached_tokens == len(PREFIX) - lookahead  # no drafter: len(PREFIX)
    hit_target, hit_draft = _kv(warm, "b", 3)

    cold = _engine(tiny_model, drafter, fmt)
    cold.add_request(PREFIX + TAIL_B, PARAMS, "b")
    (cold_first,) = cold.step()
    assert cold_first.num_cached_tokens == 0
    cold_target, cold_draft = _kv(cold, "b", 3)

    copied = len(PREFIX) - lookahead
    # positions before the recomputed ones: the bytes request a's prefill wrote, a forward
    # of the same shape over the same tokens as b's cold prefill: bit-exact
    flat = lambda kv: kv.flatten(2, 3)  # noqa: E731  [layers, 2, positions, heads, dim]
    assert torch.equal(flat(hit_target)[:, :, :copied], flat(cold_target)[:, :, :copied])
    assert torch.equal(flat(hit_draft)[:, :, :copied], flat(cold_draft)[:, :, :copied])
    # the last L positions were recomputed by a forward over fewer rows than the cold
    # prefill's (CPU GEMM rounding differs with the row count): fp32 tolerance
    torch.testing.assert_close(flat(hit_target)[:, :, copied:], flat(cold_target)[:, :, copied:],
                               rtol=0, atol=1e-5)
    torch.testing.assert_close(flat(hit_draft)[:, :, copied:], flat(cold_draft)[:, :, copied:],
                               rtol=0, atol=1e-5)
    assert _finish(warm, "b") == _finish(cold, "b")


@pytest.mark.parametrize("fmt,kwargs", [("eagle", {}), ("mtp", {"num_modules": 2})])
def test_the_copied_block_needed_its_last_positions_recomputed(tiny_model, fmt, kwargs):
    """Negative control: the source block's draft KV at its last L positions came from
    another successor and differs from a cold run's; without reuse the hit is a block less."""
    drafter = random_drafter(fmt, tiny_model, init_std=0.2, seed=2, **kwargs)
    lookahead = drafter.draft_kv_lookahead_tokens
    warm = _engine(tiny_model, drafter, fmt)
    warm.add_request(PREFIX + TAIL_A, PARAMS, "a")
    warm.step()  # a's prefill: its blocks hold its KV (a still runs)
    _, source_draft = _kv(warm, "a", 3)
    cold = _engine(tiny_model, drafter, fmt)
    cold.add_request(PREFIX + TAIL_B, PARAMS, "b")
    cold.step()
    _, cold_draft = _kv(cold, "b", 3)
    last = slice(len(PREFIX) - lookahead, len(PREFIX))
    differs = (source_draft.flatten(2, 3)[:, :, last] - cold_draft.flatten(2, 3)[:, :, last])
    assert differs.abs().max() > 1e-3

    plain = _engine(tiny_model, drafter, fmt, reuse=False)
    plain.add_request(PREFIX + TAIL_A, PARAMS, "a")
    _finish(plain, "a")
    plain.add_request(PREFIX + TAIL_B, PARAMS, "b")
    (first,) = plain.step()
    assert first.num_cached_tokens == len(PREFIX) - B


# A first wave sharing a template: block 3 of "b" starts as "a"'s (the same parent hash for
# L <= 2) and then holds other tokens; "c" and "d" hold "a"'s block 3 under other successors.
TEMPLATE = [(7 * j) % 90 + 1 for j in range(3 * B)]
BLOCK = [31, 32, 33, 34]
WAVE = {"a": TEMPLATE + BLOCK + [40, 41, 42],
        "b": TEMPLATE + BLOCK[:2] + [50, 51] + [52, 53, 54],
        "c": TEMPLATE + BLOCK + [60, 61, 62],
        "d": TEMPLATE + BLOCK + [70, 71, 72]}


def _run_wave(engine: LLMEngine, prompts: dict[str, list[int]], kv_after_step: int = 0):
    """Add every prompt at once, step to the end: (outputs, the last output of each request,
    each request's KV of its first four blocks after step `kv_after_step`)."""
    for request_id, prompt in prompts.items():
        engine.add_request(prompt, PARAMS, request_id)
    tokens: dict[str, list[int]] = {}
    last: dict[str, object] = {}
    kv: dict[str, tuple[torch.Tensor, ...]] = {}
    step = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            last[output.request_id] = output
            if output.finished:
                tokens[output.request_id] = list(output.token_ids)
        step += 1
        engine.manager.check_integrity()
        if step == kv_after_step:
            kv = {request_id: _kv(engine, request_id, 4) for request_id in prompts}
    return tokens, last, kv


@pytest.mark.exactness
@pytest.mark.parametrize("fmt,kwargs", [("eagle", {}), ("eagle3", {"aux_layers": (0, 1, 1)}),
                                        ("mtp", {"num_modules": 2})])
def test_a_first_wave_sharing_a_template_computes_no_more_than_without_a_drafter(
        tiny_model, fmt, kwargs):
    """Siblings arriving together copy the block their template shares (one step late:
    it is computed in the first), so the wave computes the target tokens an engine without
    a drafter computes plus the L recomputed positions of each copy; outputs and KV are a
    cold run's."""
    drafter = random_drafter(fmt, tiny_model, init_std=0.2, seed=2, **kwargs)
    lookahead = drafter.draft_kv_lookahead_tokens
    warm = _engine(tiny_model, drafter, fmt)
    tokens, last, kv = _run_wave(warm, WAVE, kv_after_step=2)
    plain = LLMEngine(tiny_model, engine_config(block_size=B, num_blocks=64))
    plain_tokens, plain_last, _ = _run_wave(plain, WAVE)
    assert tokens == plain_tokens  # greedy: speculation changes no token

    def computed(outputs):
        return sum(len(WAVE[r]) - outputs[r].num_cached_tokens for r in WAVE)

    assert [last[r].num_cached_tokens for r in "cd"] == [4 * B - lookahead] * 2
    assert computed(last) == computed(plain_last) + 2 * lookahead
    for request_id in "cd":
        cold = _engine(tiny_model, drafter, fmt)
        cold_tokens, _, cold_kv = _run_wave(cold, {request_id: WAVE[request_id]},
                                            kv_after_step=1)
        assert cold_tokens[request_id] == tokens[request_id]
        # target and draft KV of the four prompt blocks: a cold run's (the wave's prefill
        # ran over other row counts: fp32 tolerance)
        for hit, expected in zip(kv[request_id], cold_kv[request_id]):
            torch.testing.assert_close(hit, expected, rtol=0, atol=1e-5)
