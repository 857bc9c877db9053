"""How long a test may wait, without a wall-clock limit that a busy machine can exceed.

On 2 shared cores at load 10 a test's wall time stretches 5-10x while the CPU time its work
needs does not. So a wait here is bounded by CPU seconds: those spent by this process (every
thread: an in-process server and its engine loop) and by the processes it waits on (and their
children). Only `WATCHDOG_S` is wall time: a hang (a deadlock, a lost wake-up) spends no CPU,
and the watchdog ends it; no load makes a working test take that long.

The one module of the test tree allowed numeric wall limits (`tests/test_no_wall_limits.py`
checks the others).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

# wall seconds: what a hung wait, socket read or subprocess gets before the test fails
WATCHDOG_S = 1800.0
_T = TypeVar("_T")


def _tree_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process `pid`, its live children and its reaped ones;
    0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return 0.0
    ticks = sum(int(value) for value in fields[11:15])  # utime stime cutime cstime
    total = ticks / _TICKS_PER_S
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as children:
            total += sum(_tree_cpu_s(int(child)) for child in children.read().split())
    except (FileNotFoundError, ProcessLookupError):
        pass
    return total


def _ticks_per_s() -> int:
    import os

    return os.sysconf("SC_CLK_TCK")


_TICKS_PER_S = _ticks_per_s()


def cpu_s(pids: Iterable[int] = ()) -> float:
    """CPU seconds spent so far by this process (all threads) and the processes `pids`."""
    return time.process_time() + sum(_tree_cpu_s(pid) for pid in pids)


def wait_until(predicate: Callable[[], _T], what: str, cpu_budget_s: float = 60.0,
               pids: Iterable[int] = (), poll_s: float = 0.01) -> _T:
    """`predicate()`'s first true value; an AssertionError naming `what` once this process and
    `pids` have spent `cpu_budget_s` CPU seconds waiting (the awaited work is that slow, in any
    load), or after `WATCHDOG_S` wall seconds (a hang)."""
    pids = tuple(pids)
    start_cpu, start_wall = cpu_s(pids), time.monotonic()
    while True:
        value = predicate()
        if value:
            return value
        spent = cpu_s(pids) - start_cpu
        assert spent < cpu_budget_s, f"{what}: not after {spent:.1f} CPU seconds"
        assert time.monotonic() - start_wall < WATCHDOG_S, f"{what}: hung ({WATCHDOG_S:.0f} s)"
        time.sleep(poll_s)


def run(command: Sequence[str], cpu_budget_s: float, **kwargs: Any) -> subprocess.CompletedProcess:
    """`subprocess.run(command, **kwargs)` (text output captured unless told otherwise), killed
    with an AssertionError once it and its children spent `cpu_budget_s` CPU seconds, or after
    `WATCHDOG_S` wall seconds."""
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    capture = kwargs.pop("capture_output")
    if capture:
        kwargs.setdefault("stdout", subprocess.PIPE)
        kwargs.setdefault("stderr", subprocess.PIPE)
    process = subprocess.Popen(command, **kwargs)
    start_wall = time.monotonic()
    out = err = None
    cpu = 0.0
    while True:
        try:
            out, err = process.communicate(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            cpu = max(cpu, _tree_cpu_s(process.pid))
            if cpu > cpu_budget_s or time.monotonic() - start_wall > WATCHDOG_S:
                process.kill()
                out, err = process.communicate()
                raise AssertionError(f"{list(command)[:6]} ran past its budget ({cpu:.1f} CPU "
                                     f"seconds of {cpu_budget_s}); stderr: {err}") from None
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)


def stop_process(process: subprocess.Popen, grace_cpu_s: float = 30.0) -> int:
    """Wait for `process` (already told to stop) to exit; killed once it spent `grace_cpu_s`
    CPU seconds or `WATCHDOG_S` wall seconds shutting down. Its exit status."""
    try:
        wait_until(lambda: process.poll() is not None, f"{process.args!r} exits",
                   grace_cpu_s, (process.pid,), poll_s=0.05)
    except AssertionError:
        process.kill()
    return process.wait()
