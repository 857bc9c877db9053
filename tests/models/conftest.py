"""Fixtures for model tests (helpers live in speckv_model_test_utils.py)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from tests.models.speckv_model_test_utils import prefill

from speckv.models.llama import ModelOutput


@pytest.fixture
def run_prefill() -> Callable[..., ModelOutput]:
    return prefill
