"""The engine's typed seams: it asks a model and a drafter through their protocols only.

The engine imports no model family (what it needs of a model with linear-attention state is
`TargetModel.make_state_cache` / `plan_state`), every kind of drafter answers the `Drafter`
protocol, and `--speculative-method` words come from one registry.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from speckv.engine.config import DRAFTER_METHODS, SPECULATIVE_METHODS, EngineConfig
from speckv.engine.engine_args import EngineArgs
from speckv.engine.hybrid_state import RunnerStates
from speckv.engine.speculative import load_drafter_model, make_proposer
from speckv.speculation.methods import METHODS, Drafter
from speckv.speculation.ngram import NgramProposer

ENGINE = Path(__file__).resolve().parents[2] / "speckv" / "engine"
# what of speckv.models is family-free: the seam, the shared parts, loading by name
FAMILY_FREE = {"base", "common", "registry"}
DRAFTER_MEMBERS = [name for name in vars(Drafter) if not name.startswith("_")]


def _imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_engine_imports_no_model_family():
    offenders = {
        f"{path.name}: {name}"
        for path in sorted(ENGINE.glob("*.py"))
        for name in _imported_modules(path)
        if name.startswith("speckv.models.") and name.split(".")[2] not in FAMILY_FREE
    }
    assert not offenders


def test_a_model_without_state_refuses_to_make_or_plan_one(tiny_model):
    with pytest.raises(ValueError, match="no linear-attention state"):
        tiny_model.make_state_cache(4)
    with pytest.raises(ValueError, match="no linear-attention state"):
        tiny_model.plan_state(None, [1], [1], [[1]], 4)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no Mamba / GDN state group"):
        RunnerStates(tiny_model, 4, tiny_model.kv_cache_layout(4))


def test_a_hybrid_plans_its_state_through_the_seam(tiny_hybrid_gdn):
    model, _ = tiny_hybrid_gdn
    layout = model.kv_cache_layout(4, 4)
    states = RunnerStates(model, 8, layout)
    plan = model.plan_state(states.cache, [3], [3], [[1]], states.unit)
    assert [segment.num_tokens for segment in plan.segments] == [3]


def test_every_kind_of_drafter_answers_the_drafter_protocol(tiny_model, tiny_hybrid_gdn,
                                                           tiny_hybrid_swa):
    from speckv.drafters.gemma4_assistant import random_gemma4_assistant
    from speckv.drafters.loaders import random_drafter

    _, mtp_head = tiny_hybrid_gdn
    swa_model, _ = tiny_hybrid_swa
    drafters = [random_drafter("eagle", tiny_model, seed=0), mtp_head,
                random_gemma4_assistant(swa_model)]
    assert {"speculative_method", "policy", "num_kv_layers", "make_proposer",
            "named_parameters"} <= set(DRAFTER_MEMBERS)
    for drafter in drafters:
        missing = [name for name in DRAFTER_MEMBERS if not hasattr(drafter, name)]
        assert not missing, f"{type(drafter).__name__} lacks {missing}"
        assert drafter.speculative_method in DRAFTER_METHODS


def test_the_assistant_refuses_a_target_that_is_not_gemma(tiny_model):
    with pytest.raises(ValueError, match="Gemma 3 / 4 target"):
        load_drafter_model("random-assistant", tiny_model, "mtp")


def test_speculative_methods_come_from_the_registry():
    assert tuple(METHODS) == SPECULATIVE_METHODS
    assert tuple(name for name, m in METHODS.items() if m.needs_drafter) == DRAFTER_METHODS
    config = EngineArgs(speculative_method="ngram", num_spec_tokens=2,
                        prompt_lookup_max=4).create_engine_config()
    assert isinstance(config, EngineConfig)
    proposer = make_proposer(config, None, 16)
    assert isinstance(proposer, NgramProposer) and proposer.num_spec_tokens == 2
    drafter_less = EngineArgs(speculative_method="eagle3", num_spec_tokens=2
                              ).create_engine_config()
    with pytest.raises(ValueError, match="needs a drafter: set speculative_model"):
        make_proposer(drafter_less, None, 16)
