"""CI's exactness rerun (.ci/run) is worth running only if its kernel settings make a matmul's
rounding depend on its row count on this machine: a test comparing a 5-row forward with a
37-row one bit for bit must fail there. This checks that on the case that once failed on a
user's machine (a hybrid hit's 5-token continuation vs a 37-token cold forward), so the rerun
fails loudly when its settings stop changing anything. Skipped in the main run."""

from __future__ import annotations

import os

import pytest
import torch

from speckv.models.hybrid.loader import tiny_hybrid
from tests.models.hybrid.hybrid_test_utils import OneRequest

pytestmark = [
    pytest.mark.exactness,
    pytest.mark.skipif(not os.environ.get("SPECKV_EXACTNESS_RERUN"),
                       reason="only in CI's exactness rerun (SPECKV_EXACTNESS_RERUN=1)"),
]


def test_the_rerun_settings_make_rounding_depend_on_the_row_count():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(37, 64, generator=gen), torch.randn(256, 64, generator=gen)
    plain = torch.nn.functional.linear(x, w)[32:]
    five = torch.nn.functional.linear(x[32:], w)
    model = tiny_hybrid()
    ids = torch.randint(0, 128, (37,), generator=torch.Generator().manual_seed(4)).tolist()
    cold = OneRequest(model, block_size=4, unit=8)
    cold_logits = cold.forward(ids)
    hit = OneRequest(model, block_size=4, unit=8)
    hit.kv, hit.states = cold.kv, cold.states
    hit.kv_table = cold.kv_table[:8] + list(range(200, 210))
    hit.state_table = cold.state_table[:4] + [250, 251]
    hit.num_computed = 32
    hit_logits = hit.forward(ids[32:])
    settings = {k: os.environ.get(k) for k in ("MKL_CBWR", "ATEN_CPU_CAPABILITY",
                                               "SPECKV_TEST_THREADS")}
    assert not (torch.equal(plain, five) and torch.equal(hit_logits, cold_logits[32:])), (
        f"under {settings} a 5-row and a 37-row forward round alike on this CPU: the rerun "
        "would not catch a bit-exact assertion across shapes; pick other settings in .ci/run")
    # and within rounding, as the tests that compare different shapes assume
    torch.testing.assert_close(hit_logits, cold_logits[32:], atol=1e-4, rtol=1e-5)
