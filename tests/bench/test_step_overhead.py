"""`speckv bench step-overhead`: the table with every phase, the vLLM column skipped with a
message when vLLM is not importable, the phase timer, and bad flags named in the error."""

from __future__ import annotations

import argparse
import sys

import pytest

from speckv.bench import step_overhead


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    step_overhead.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_runs_every_phase_and_skips_vllm_with_a_message(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "vllm", None)  # imports fail as for an absent package
    args = _args("--batch-sizes", "2", "--drafter", "none,eagle3", "--steps", "2",
                 "--rounds", "1", "--prompt-len", "20", "--no-detokenize")
    assert step_overhead.run(args) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "vLLM column skipped: vllm is not importable here" in text
    for phase in step_overhead.PHASES:
        assert phase in text
    assert "none, batch 2" in text and "eagle3, batch 2" in text


def test_phase_timer_counts_the_outermost_call_only() -> None:
    ticks = iter(range(100))
    timer = step_overhead.PhaseTimer(clock=lambda: float(next(ticks)))

    class Owner:
        def outer(self) -> None:
            self.inner()

        def inner(self) -> None:
            pass

    owner = Owner()
    timer.wrap(owner, "inner", "phase")
    timer.wrap(owner, "outer", "phase")
    owner.outer()  # clock read twice (outer), the nested call not at all
    assert timer.take() == {"phase": 1.0}
    assert timer.take() == {}


@pytest.mark.parametrize("argv, message", [
    (("--batch-sizes", "a"), "--batch-sizes"),
    (("--batch-sizes", "0"), "--batch-sizes"),
    (("--drafter", "medusa"), "--drafter"),
    (("--steps", "0"), "--steps"),
])
def test_bad_flags_are_named(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        step_overhead.run(_args(*argv, "--no-vllm"))
