"""scripts/gpu_check.sh: it stops with a clear message without CUDA, and its three checks
(greedy with EAGLE3 equals transformers, hit KV equals cold KV, tokens/s beside transformers)
run on the tiny CPU rehearsal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from speckv.bench import gpu_check
from tests import patience

ROOT = Path(__file__).resolve().parents[2]


def test_without_cuda_it_says_so_and_fails(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_check.main([]) == 1
    err = capsys.readouterr().err
    assert "scripts/gpu_check.sh needs a CUDA GPU" in err and "--device cpu" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check runs")
def test_the_script_exits_1_without_cuda() -> None:
    result = patience.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cpu_budget_s=300)
    assert result.returncode == 1
    assert "needs a CUDA GPU" in result.stderr


@pytest.mark.slow
def test_the_cpu_rehearsal_passes_all_three_checks(capsys: pytest.CaptureFixture[str]) -> None:
    assert gpu_check.main(["--device", "cpu", "--layers", "2", "--num-prompts", "2",
                           "--prompt-len", "40", "--new-tokens", "8", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["passed"] and result["greedy_equal"] and result["first_mismatch"] == ""
    assert result["hit_tokens"] == 32 and result["hit_kv_max_abs_diff"] == 0.0
    assert result["engine_tok_s"] > 0 and result["hf_tok_s"] > 0
    assert result["layout"] == "tiny layout, 2 layers, float32"
