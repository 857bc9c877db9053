"""Models the engine-process tests build in every process (`ModelSpec.factory`): seeded, so
each process holds the same weights."""

from __future__ import annotations

from speckv.drafters.loaders import random_drafter
from speckv.models.llama.tiny import tiny_model


def tiny_eagle():
    """(tiny model, random EAGLE drafter), the same in every process."""
    model = tiny_model(seed=7)
    return model, random_drafter("eagle", model, init_std=0.2, seed=3)


TINY_EAGLE = "tests.bench.engine_models:tiny_eagle"


def broken():
    """A factory that fails in the worker: the parent must see the worker's traceback."""
    raise ValueError("no weights here")


BROKEN = "tests.bench.engine_models:broken"
