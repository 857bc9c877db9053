"""Engine worker processes: a worker that fails reports its traceback to the parent, and the
benches refuse `--engines` settings they cannot run."""

from __future__ import annotations

import pytest

from speckv.bench.prefix_repetition import RunOptions, run_benchmark
from speckv.cluster.engine_pool import EngineWorkers, ModelSpec, WorkerError
from tests.bench.engine_models import BROKEN


def test_a_failing_worker_reports_its_traceback():
    with pytest.raises(WorkerError, match="ValueError: no weights here"):
        EngineWorkers(ModelSpec(factory=BROKEN), 1)


def test_engine_counts_are_checked():
    with pytest.raises(ValueError, match="--engines"):
        RunOptions(num_engines=0)
    with pytest.raises(ValueError, match="--engines"):
        EngineWorkers(ModelSpec(factory=BROKEN), 0)
    with pytest.raises(ValueError, match="ModelSpec"):
        run_benchmark(None, None, [], RunOptions(num_engines=2, progress=False))
