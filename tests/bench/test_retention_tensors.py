"""`speckv bench retention --model hybrid-swa`: the sliding-window retention scenario on real
tensors gives the simulator's cached-token table, and every hit reads a cold run's KV (within
fp32 rounding: a hit block may come from an earlier request's forward over fewer rows)."""

from __future__ import annotations

import json

from speckv.bench.retention_tensors import HIT_KV_ROUNDING
from speckv.cli import main


def test_tensor_table_equals_simulator_and_hits_read_cold_kv(capsys):
    assert main(["bench", "retention", "--model", "hybrid-swa", "--prefix-len", "256",
                 "--retention", "128", "--window", "40", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 5
    for row in rows:
        simulator, tensors = row["simulator"], row["tensors"]
        assert tensors["cached_tokens"] == simulator["cached_tokens"], simulator["label"]
        # fp32 rounding only: the block's writer and the cold run ran forwards of different
        # row counts, which CPU matmul kernels round differently
        assert tensors["target_max_abs_diff"] <= HIT_KV_ROUNDING
        assert tensors["draft_max_abs_diff"] is None \
            or tensors["draft_max_abs_diff"] <= HIT_KV_ROUNDING
        assert tensors["num_hit_blocks_checked"] > 0
    by_label = {row["simulator"]["label"]: row["tensors"]["cached_tokens"] for row in rows}
    # the scenario's point, on tensors: without the fix req 2 falls back a checkpoint
    assert by_label["MTP3 legacy drop, no fix"][1] < by_label["MTP3 legacy drop, fix"][1]
    assert by_label["MTP3 lookahead L=1"][3] > by_label["MTP3 legacy drop, fix"][3]


def test_gemma4_with_the_assistant_equals_simulator(capsys):
    """The tiny Gemma 4 target: the gemma4_mtp row runs the Gemma 4 MTP assistant (it drafts,
    writes no draft KV, takes no drop: a sibling diverging after the checkpoint hits it)."""
    assert main(["bench", "retention", "--model", "gemma4", "--prefix-len", "256",
                 "--retention", "128", "--window", "40", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    for row in rows:
        simulator, tensors = row["simulator"], row["tensors"]
        assert tensors["cached_tokens"] == simulator["cached_tokens"], simulator["label"]
        assert tensors["target_max_abs_diff"] == 0
        assert tensors["draft_max_abs_diff"] in (None, 0)
        assert tensors["num_draft_tokens"] > 0, simulator["label"]
    by_label = {row["simulator"]["label"]: row["tensors"]["cached_tokens"] for row in rows}
    assistant = next(v for k, v in by_label.items() if k.startswith("gemma4_mtp"))
    assert assistant[1] == 256 > by_label["MTP3 legacy drop, fix"][1]
    assert by_label["MTP3 legacy drop, no fix"][1] < by_label["MTP3 legacy drop, fix"][1]
