"""`speckv bench route` as a real subprocess on the tiny chat model: two engines, the kv and
round-robin routers, the overhead probe; JSON, results file and chart."""

from __future__ import annotations

import json
import sys

import pytest

from tests import patience
from tests.router.fleet_utils import ENV, save_fleet_models

pytestmark = pytest.mark.slow


def test_bench_route_runs_the_policies(tmp_path, tiny_chat_model):
    models = save_fleet_models(tmp_path / "models", tiny_chat_model)
    out = tmp_path / "out"
    result = patience.run(
        [sys.executable, "-m", "speckv.cli", "bench", "route", "--model",
         str(models["model"]), "--speculative-method", "eagle", "--speculative-model",
         str(models["eagle"]), "--num-spec-tokens", "2", "--block-size", "4",
         "--num-blocks", "40", "--prefix-len", "24", "--suffix-len", "4", "--num-prefixes",
         "4", "--num-prompts", "12", "--output-len", "2", "--max-concurrency", "2",
         "--policies", "kv,round-robin", "--no-oracle", "--overhead-requests", "2",
         "--json", "--output-dir", str(out)],
        cpu_budget_s=600, env=ENV)
    assert result.returncode == 0, result.stderr
    payload = json.loads(result.stdout)
    kv, rr = payload["runs"]
    assert (kv["name"], rr["name"]) == ("kv", "round-robin")
    for run in payload["runs"]:
        assert (run["num_completed"], run["num_failed"]) == (12, 0)
        assert run["prediction_checks"] == 12
        assert sum(run["per_engine"].values()) == 12
    assert rr["decisions"] == {"round-robin": 12}
    assert kv["hit_rate"] > 0 and set(kv["decisions"]) <= {"prefix", "load", "spill"}
    assert payload["router_overhead"]["router_ttft_median_ms"] > 0
    assert (out / "route.png").stat().st_size > 0
    assert json.loads((out / "results.json").read_text())["runs"] == payload["runs"]
