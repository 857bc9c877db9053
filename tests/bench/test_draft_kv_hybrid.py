"""`speckv bench draft-kv --model hybrid-swa`: target KV (both KV cache groups) and draft KV
of a hit equal a cold run's (fp32 max |diff| 0); the stale-successor control is caught."""

from __future__ import annotations

import json

from speckv.cli import main


def test_draft_kv_on_hybrid_swa(capsys):
    assert main(["bench", "draft-kv", "--model", "hybrid-swa", "--drafters", "eagle,mtp",
                 "--mtp-num-modules", "2", "--dtypes", "float32", "--prompt-len", "200",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {(row["drafter"], row["case"]) for row in rows} == {
        (d, c) for d in ("eagle", "mtp") for c in ("lookahead hit", "negative control")}
    for row in rows:
        assert row["hit_tokens"] > 128 + 16  # past the 128-token window: blocks were freed
        assert row["target_max_abs_diff"] == 0
        if row["case"] == "lookahead hit":
            assert row["draft_max_abs_diff"] == 0
        else:
            assert row["draft_max_abs_diff"] > 1e-3
