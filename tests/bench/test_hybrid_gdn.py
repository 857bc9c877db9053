"""The GDN-hybrid scenario on tensors: unit 544, a 1,367-token prompt sent twice. Cached 1,088
without a drafter and with MTP + lookahead hashes, 544 under the legacy drop; the GDN state at
the hit equals a cold run's bit for bit (the same prefill on the same shapes wrote both), the
second request's logits equal a cold run's within fp32 rounding (its forward has fewer rows)."""

from __future__ import annotations

import pytest
import torch

from speckv.bench.draft_kv_hybrid import measure_hybrid
from speckv.bench.hybrid_gdn import run_scenario
from speckv.drafters.hybrid_mtp import random_hybrid_drafter
from speckv.models.hybrid.loader import tiny_hybrid


@pytest.mark.exactness
def test_unit_544_scenario_hits_and_equals_a_cold_run():
    model = tiny_hybrid()
    prompt = torch.randint(0, 128, (1367,), generator=torch.Generator().manual_seed(1)).tolist()
    rows = {row.case: row for row in run_scenario(model, prompt)}
    assert {case: row.cached_tokens for case, row in rows.items()} == {
        "no drafter": 1088,
        "MTP, lookahead hashes": 1088,
        "MTP, legacy hashes (block drop)": 544,
    }
    for row in rows.values():
        assert row.state_max_abs_diff == 0.0
        # fp32 rounding: the hit's forward has 279 (or 823) rows, the cold run's 1,367, and
        # GEMM kernels round a row differently by row count (logits are of magnitude ~10)
        assert row.logits_max_abs_diff <= 1e-4


@pytest.mark.exactness
def test_draft_kv_on_the_hybrid_exact_and_stale_control_caught():
    model = tiny_hybrid()
    prompt = torch.randint(0, 128, (40,), generator=torch.Generator().manual_seed(2)).tolist()
    for method in ("mtp", "eagle"):
        drafter = random_hybrid_drafter(method, model)
        hit, control = measure_hybrid(model, drafter, "float32", prompt, 4, 8)
        assert hit.hit_tokens == 32
        assert hit.target_max_abs_diff == hit.draft_max_abs_diff == 0.0
        assert hit.state_max_abs_diff == 0.0
        assert control.hit_tokens == 32 and control.draft_max_abs_diff > 1e-3


@pytest.mark.exactness
def test_cli_draft_kv_on_hybrid_gdn_prints_zero_diffs(capsys):
    import json

    from speckv.cli import main

    assert main(["bench", "draft-kv", "--model", "hybrid-gdn", "--drafters", "mtp",
                 "--mtp-num-modules", "1", "--dtypes", "float32", "--json"]) == 0
    hit, control = json.loads(capsys.readouterr().out)
    assert hit["hit_tokens"] == 128  # two units of 64 (4 blocks of 16) in 130 tokens
    assert hit["target_max_abs_diff"] == hit["draft_max_abs_diff"] == 0.0
    assert hit["state_max_abs_diff"] == 0.0
    assert control["draft_max_abs_diff"] > 0
    assert hit["tier"] == "local" and hit["external_tokens"] == 0


@pytest.mark.exactness
@pytest.mark.parametrize("tier", ["offload", "disk"])
def test_cli_draft_kv_on_hybrid_gdn_through_a_tier_counts_its_tokens(tier, tmp_path, capsys,
                                                                      monkeypatch):
    """With a tier the hit is the tier's (the local cache reset): every hit token counted in
    the "from tier" column, and still the cold run's bytes."""
    from speckv.cli import main

    monkeypatch.setenv("COLUMNS", "200")  # the table on one line per row
    assert main(["bench", "draft-kv", "--model", "hybrid-gdn", "--drafters", "mtp",
                 "--mtp-num-modules", "1", "--dtypes", "float32", "--kv-connector", tier,
                 "--kv-offload-dir", str(tmp_path / "kv")]) == 0
    rows = [[cell.strip() for cell in line.split("│")[1:-1]]
            for line in capsys.readouterr().out.splitlines() if "lookahead hit" in line]
    assert rows and rows[0][3:6] == [tier, "128", "128"]  # tier, hit tokens, from tier
    assert main(["bench", "draft-kv", "--model", "hybrid-gdn", "--drafters", "mtp",
                 "--mtp-num-modules", "1", "--dtypes", "float32", "--kv-connector", tier,
                 "--kv-offload-dir", str(tmp_path / "kv"), "--json"]) == 0
    import json

    hit, control = json.loads(capsys.readouterr().out)
    assert (hit["tier"], hit["hit_tokens"], hit["external_tokens"]) == (tier, 128, 128)
    assert hit["target_max_abs_diff"] == hit["draft_max_abs_diff"] == 0.0
    assert hit["state_max_abs_diff"] == 0.0
    assert control["external_tokens"] > 0 and control["draft_max_abs_diff"] > 0


@pytest.mark.exactness
def test_unit_544_table_through_every_tier(tmp_path):
    """`bench hybrid-gdn --tiers`: a fresh engine hits 1,088 / 1,088 / 544 through the CPU
    tier, the disk tier and the store, as the local cache does, and reads the cold run's
    bytes (target KV, draft KV, GDN state) at the hit."""
    from speckv.bench.hybrid_tiers import tier_row
    from speckv.connectors.embedded_valkey import EmbeddedValkey
    from speckv.drafters.gated_mtp import random_gated_mtp

    model = tiny_hybrid()
    drafter = random_gated_mtp(model)
    prompt = torch.randint(0, 128, (1367,), generator=torch.Generator().manual_seed(1)).tolist()
    with EmbeddedValkey(256 << 20) as valkey:
        for case, d, legacy, hit in (("none", None, False, 1088), ("mtp", drafter, False, 1088),
                                     ("legacy", drafter, True, 544)):
            row = tier_row(model, d, "mtp", prompt, label="tiny", case=case, block_size=16,
                           unit=544, legacy=legacy, directory=tmp_path, store_url=valkey.url,
                           gib=0.05)
            assert (row.local_tokens, row.cpu_tokens, row.disk_tokens, row.store_tokens) == \
                (hit,) * 4
            assert row.max_abs_diff == 0.0
