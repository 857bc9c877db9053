"""`speckv bench spec-decode --model DIR --speculative-model ASSISTANT_DIR`: a Gemma 4 target
with its MTP assistant (tiny, random-init, in the transformers layout): the mtp modes decode
the plain run's greedy tokens and report the assistant's acceptance (an assistant set to draft
its input token again, which the repetitive random target accepts)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from speckv import cli
from speckv.drafters.gemma4_assistant import save_gemma4_assistant
from speckv.models.gemma.gemma4 import Gemma4ForCausalLM
from speckv.models.gemma.loader import gemma_config_of, hf_state_items
from tests.doubles.assistant import echo_assistant

transformers = pytest.importorskip("transformers")
from transformers import Gemma4TextConfig  # noqa: E402


def test_spec_decode_reports_the_assistants_acceptance(tmp_path, capsys):
    # a small vocabulary and large weights: repetitive greedy text, so drafts get accepted
    cfg = Gemma4TextConfig(
        vocab_size=24, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=10,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=24, num_kv_shared_layers=2,
        final_logit_softcapping=30.0).to_dict()
    torch.manual_seed(4)
    target = Gemma4ForCausalLM.from_config(gemma_config_of(cfg), init_std=0.4)
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text(json.dumps(cfg))
    save_file({name: t.contiguous() for name, t in hf_state_items(target)},
              str(tmp_path / "target" / "model.safetensors"))
    # drafts its input token again: the random target repeats one token, so drafts are taken
    save_gemma4_assistant(tmp_path / "assistant", echo_assistant(target))
    assert cli.main(["bench", "spec-decode", "--model", str(tmp_path / "target"),
                     "--speculative-model", str(tmp_path / "assistant"), "--modes",
                     "none,mtp,mtp-fixed", "--batch-sizes", "1,3", "--num-prompts", "3",
                     "--max-tokens", "12", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {row["mode"] for row in rows} == {"none", "mtp", "mtp-fixed"}
    assert all(row["identical_to_no_spec"] for row in rows)
    fixed = [row for row in rows if row["mode"] == "mtp-fixed"]
    assert all(len(row["acceptance_by_position"]) == 3 for row in fixed)
    assert all(row["mean_acceptance_length"] > 2.0 for row in fixed)
    assert all(row["acceptance_by_position"][0] > 0.5 for row in fixed)


def test_mtp_modes_need_a_drafter_before_the_model_loads(monkeypatch, capsys):
    import speckv.engine.llm as llm

    def no_model(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(llm, "load_model", no_model)
    assert cli.main(["bench", "spec-decode", "--model", "/some/gemma4", "--modes",
                     "none,mtp"]) == 2
    assert "--speculative-model" in capsys.readouterr().err
