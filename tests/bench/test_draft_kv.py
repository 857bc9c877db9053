"""`speckv bench draft-kv` on a tiny random model: a hit from the local cache or from a KV tier
reads exactly the KV of a cold run (fp32 max |diff| 0), and the negative control (legacy hashes
without the drop) is caught through the tier as well. Through the shared store the hit is read
by a fresh engine (one server for both engines, started by `measure`)."""

from __future__ import annotations

import random

import pytest

from speckv.bench.draft_kv import measure
from speckv.drafters.loaders import random_drafter


@pytest.mark.exactness
@pytest.mark.parametrize("tier", [None, "offload", "disk", "offload,disk", "store",
                                  "offload,store"])
@pytest.mark.parametrize(("name", "kwargs"), [("eagle", {}), ("mtp", {"num_modules": 2})])
def test_hits_equal_a_cold_run_and_the_control_is_caught(tiny_model, name, kwargs, tier,
                                                         tmp_path):
    drafter = random_drafter(name, tiny_model, init_std=0.2, seed=4, **kwargs)
    prompt = [random.Random(1).randrange(96) for _ in range(30)]
    hit, control = measure(tiny_model, drafter, "float32", prompt, 4, tier, str(tmp_path))
    lookahead = drafter.policy.draft_kv_lookahead_tokens
    assert hit.hit_tokens == (30 - lookahead) // 4 * 4
    assert hit.external_tokens == (hit.hit_tokens if tier else 0)
    assert hit.target_max_abs_diff == 0 and hit.draft_max_abs_diff == 0
    # the control's last hit block carries draft KV written from another successor token
    assert control.external_tokens == (control.hit_tokens if tier else 0)
    assert control.target_max_abs_diff == 0 and control.draft_max_abs_diff > 0
