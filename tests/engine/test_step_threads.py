"""Compute threads per step: steps speckv's one-thread kernels compute keep `threads`,
longer ones (prefill chunks) run on `prefill_threads`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import SamplingParams
from speckv.engine.step_threads import StepThreads, ThreadChooser, step_threads_for
from speckv.models.common.native_linear import set_native_max_rows, single_threaded_max_rows
from speckv.models.common.small_rows import cpu_fp32_linears
from speckv.models.llama.tiny import tiny_model
from tests.models.common.linear_layers import needs_kernel


@pytest.fixture
def torch_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_a_step_past_the_one_thread_kernels_rows_gets_the_prefill_threads(torch_threads):
    choice = StepThreads(threads=1, prefill_threads=3, single_threaded_rows=32)
    assert [choice.for_step(n) for n in (1, 4, 32, 33, 2048)] == [1, 1, 1, 3, 3]
    chooser = ThreadChooser(choice)
    chooser.begin(33)
    assert torch.get_num_threads() == 3
    chooser.end()
    chooser.begin(1)
    assert torch.get_num_threads() == 1
    chooser.end()
    assert "1 compute thread(s) for steps of up to 32 tokens, 3 for longer" in choice.describe()


class _Clock:
    """Seconds a test moves on: each step takes what the test says for its thread count."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run_long_steps(chooser: ThreadChooser, clock: _Clock, seconds_by_threads: dict[int, float],
                    num_steps: int, num_tokens: int = 256) -> list[int]:
    used = []
    for _ in range(num_steps):
        chooser.begin(num_tokens)
        threads = torch.get_num_threads()
        used.append(threads)
        clock.now += seconds_by_threads[threads]
        chooser.end()
    return used


def test_long_steps_move_to_one_thread_where_two_measure_slower(torch_threads):
    from speckv.engine.step_threads import PROBE_INTERVAL

    clock = _Clock()
    chooser = ThreadChooser(StepThreads(1, 2, 32), clock)
    # a busy second core: two threads take longer than one
    used = _run_long_steps(chooser, clock, {1: 1.0, 2: 2.0}, 3 * PROBE_INTERVAL)
    assert used[:PROBE_INTERVAL - 1] == [2] * (PROBE_INTERVAL - 1)  # the idle machine's choice
    assert used[PROBE_INTERVAL - 1] == 1  # one thread tried
    later = used[PROBE_INTERVAL:]
    assert later.count(2) == 2 and later.count(1) == 2 * PROBE_INTERVAL - 2  # probes only
    # the core is free again: the probes of two threads win them back (the mean halves
    # towards each new timing, so the second probe does)
    used = _run_long_steps(chooser, clock, {1: 1.0, 2: 0.2}, 3 * PROBE_INTERVAL)
    assert used[PROBE_INTERVAL:2 * PROBE_INTERVAL - 1] == [1] * (PROBE_INTERVAL - 1)
    assert used[-PROBE_INTERVAL:-1] == [2] * (PROBE_INTERVAL - 1) and used[-1] == 1
    # decode steps never change threads, and a size not timed yet starts on two
    chooser.begin(8)
    assert torch.get_num_threads() == 1
    chooser.end()
    assert _run_long_steps(chooser, clock, {1: 1.0, 2: 2.0}, 1, num_tokens=2048) == [2]


def test_no_choice_unless_prefill_threads_differ(torch_threads):
    torch.set_num_threads(2)
    assert step_threads_for(None, None, 8) is None  # torch's setting, untouched
    assert step_threads_for(3, None, 8) is None
    assert step_threads_for(None, 2, 8) is None  # the same as torch's setting
    assert step_threads_for(None, 1, 8) == StepThreads(2, 1, 8)
    with pytest.raises(ValueError, match="threads >= 1"):
        StepThreads(0, 2, 8)


def test_bad_thread_counts_name_their_flags():
    for field, flag in (("threads", "--threads"), ("prefill_threads", "--prefill-threads")):
        for bad in (0, -2, 1.5, True):
            with pytest.raises(ValueError, match=f"{flag} must be >= 1"):
                engine_config(**{field: bad})


@needs_kernel
def test_decode_steps_keep_threads_and_a_prefill_gets_prefill_threads(torch_threads):
    model = tiny_model()
    set_native_max_rows(cpu_fp32_linears(model), 4)  # as a load measuring 1-4 rows would
    assert single_threaded_max_rows(model) == 4
    seen: list[tuple[int, int]] = []  # (tokens in the forward, torch's threads then)
    model.register_forward_pre_hook(
        lambda _module, args: seen.append((args[0].numel(), torch.get_num_threads())))
    engine = LLMEngine(model, engine_config(block_size=4, num_blocks=64, threads=1,
                                            prefill_threads=2))
    assert engine.step_threads == StepThreads(1, 2, 4)
    engine.add_request(list(range(3, 12)), SamplingParams(max_tokens=3), "a")  # 9 tokens
    while engine.has_unfinished_requests():
        engine.step()
    assert seen[0] == (9, 2)  # the prompt: past the 4 rows the native form computes
    assert seen[1:] and all(entry == (1, 1) for entry in seen[1:])  # decode steps
