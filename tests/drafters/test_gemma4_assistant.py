"""The Gemma 4 MTP assistant vs transformers' own `Gemma4AssistantForCausalLM` on tiny random
configs (fp32): three draft steps' logits for given target states and KV (the paged KV our
target wrote, read back for transformers), and end to end from transformers' own target; with
the plain LM head and the centroid-masked head; and the HF directory round trip."""

from __future__ import annotations

import pytest
import torch

from speckv.attention import AttentionMetadata
from speckv.attention.grouped import GroupedAttentionMetadata
from speckv.drafters.gemma4_assistant import (
    AssistantConfig,
    build_assistant,
    load_gemma4_assistant,
    random_gemma4_assistant,
    save_gemma4_assistant,
)
from speckv.drafters.gemma4_assistant_proposer import Gemma4AssistantProposer
from speckv.models.gemma.loader import build_gemma, gemma_config_of

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.models.gemma4_assistant")  # transformers >= 5.x
from transformers import (  # noqa: E402
    Gemma4AssistantConfig,
    Gemma4AssistantForCausalLM,
    Gemma4ForCausalLM,
    Gemma4TextConfig,
)

# Same inputs and KV, but our paged SDPA (gathered blocks, masked) and transformers' eager
# attention reduce in another order: fp32 rounding only (measured ~3e-6).
ASSISTANT_ATOL = 1e-5
# From transformers' own target: its KV and hidden state differ from ours by the target's
# rounding (tests/models/gemma/test_gemma4_parity.py: 1e-4), then pass through the assistant.
END_TO_END_ATOL = 1e-4
W, B, VOCAB, STEPS = 6, 4, 64, 3
TARGET = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=W,
              layer_types=["sliding_attention", "full_attention"] * 2, global_head_dim=16,
              num_global_key_value_heads=1, attention_k_eq_v=True,
              max_position_embeddings=256, hidden_size_per_layer_input=0)
ASSISTANT = dict(TARGET, hidden_size=24, intermediate_size=48, num_hidden_layers=3,
                 num_attention_heads=2, vocab_size_per_layer_input=0,
                 layer_types=["sliding_attention", "sliding_attention", "full_attention"])


def hf_models(ordered: bool, seed: int = 0):
    torch.manual_seed(seed)
    target_config = Gemma4TextConfig(**TARGET)
    target_config._attn_implementation = "eager"
    target = Gemma4ForCausalLM(target_config).eval()
    config = Gemma4AssistantConfig(text_config=Gemma4TextConfig(**ASSISTANT).to_dict(),
                                   backbone_hidden_size=32, use_ordered_embeddings=ordered,
                                   num_centroids=8, centroid_intermediate_top_k=2)
    config._attn_implementation = config.text_config._attn_implementation = "eager"
    assistant = Gemma4AssistantForCausalLM(config).eval()
    with torch.no_grad():  # non-trivial norms, layer scalars and token ordering
        for model in (target, assistant):
            for name, p in model.named_parameters():
                p.normal_(1.0, 0.3) if "norm" in name else p.normal_(0.0, 0.2)
        for layer in assistant.model.layers:
            layer.layer_scalar.uniform_(0.5, 1.5)
        if ordered:
            assistant.masked_embedding.token_ordering.copy_(torch.randperm(VOCAB))
    return target, assistant


def ours_of(hf_target, hf_assistant):
    target = build_gemma(gemma_config_of(hf_target.config.to_dict()),
                         hf_target.state_dict().items())
    state = {**hf_assistant.state_dict(), **dict(hf_assistant.named_buffers())}
    config = AssistantConfig.from_hf_config(hf_assistant.config.to_dict())
    return target, build_assistant(config, target, state)


def prefill(target, ids: torch.Tensor):
    """Our target over the prompt in paged KV: (hidden [1, h] at the last position, cache,
    layout, block table)."""
    num_blocks = -(-len(ids) // B) + 2
    layout = target.kv_cache_layout(B)
    kv = target.make_layout_kv_cache(layout, num_blocks)
    table = list(range(1, num_blocks))
    groups = tuple(AttentionMetadata.build([len(ids)], [len(ids)], [table], B)
                   for _ in layout.groups)
    metadata = GroupedAttentionMetadata(groups, layout.layer_to_group)
    out = target(ids, groups[0].positions(), kv, metadata)
    return out.hidden_states[-1:], kv, layout, table


def our_drafts(assistant, kv, layout, table, hidden, token, num_keys):
    proposer = Gemma4AssistantProposer(assistant, STEPS)
    proposer.bind_target_kv(kv, layout)
    target_kv = proposer._kv
    metadata = {kind: AttentionMetadata.build([1], [num_keys], [table], B)
                for kind in target_kv.caches}
    positions = torch.tensor([num_keys])
    logits = []
    for _ in range(STEPS):
        y, hidden = assistant.step(assistant.embed(token), hidden, positions, target_kv,
                                   metadata)
        logits.append(assistant.compute_logits(y)[0])
        assert assistant.draft_token_ids(y).item() == logits[-1].argmax().item()
        token = logits[-1].argmax()[None]
    return logits, target_kv


def hf_drafts(hf_target, hf_assistant, shared, hidden, token, position):
    logits = []
    token, hidden = token.view(1, 1), hidden.view(1, 1, -1)
    for _ in range(STEPS):
        embeds = torch.cat([hf_target.get_input_embeddings()(token), hidden], dim=-1)
        out = hf_assistant(inputs_embeds=embeds, position_ids=torch.tensor([[position]]),
                           shared_kv_states=shared)
        logits.append(out.logits[0, 0].float())
        token, hidden = out.logits.argmax(-1), out.last_hidden_state
    return logits


def read_keys(cache, table, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions [lo, hi) of a paged layer as transformers' [1, kv_heads, n, head_dim]."""
    slots = torch.tensor([table[p // B] * B + p % B for p in range(lo, hi)])
    return tuple(t.flatten(0, 1)[slots].permute(1, 0, 2)[None]
                 for t in (cache.key, cache.value))  # type: ignore[return-value]


@pytest.mark.parametrize("ordered", [False, True], ids=["lm-head", "centroid-head"])
@torch.no_grad()
def test_logits_match_transformers(ordered):
    hf_target, hf_assistant = hf_models(ordered)
    target, assistant = ours_of(hf_target, hf_assistant)
    prompt_len = 3 * W + 1
    ids = torch.randint(0, VOCAB, (prompt_len,), generator=torch.Generator().manual_seed(1))
    hidden, kv, layout, table = prefill(target, ids)
    token = target.compute_logits(hidden).argmax(-1)  # t[n-1]; the query sits at n-1
    ours, target_kv = our_drafts(assistant, kv, layout, table, hidden, token, prompt_len)
    # transformers fed the KV our engine reads: every full key, the sliding window's last W
    shared = {"full_attention": read_keys(target_kv.caches["full_attention"], table, 0,
                                          prompt_len),
              "sliding_attention": read_keys(target_kv.caches["sliding_attention"], table,
                                             prompt_len - W, prompt_len)}
    given = hf_drafts(hf_target, hf_assistant, shared, hidden, token, prompt_len)
    for step, (a, b) in enumerate(zip(ours, given)):
        torch.testing.assert_close(a, b, rtol=0, atol=ASSISTANT_ATOL, msg=f"step {step + 1}")
    # end to end: transformers' target, its shared_kv_states and last hidden state
    out = hf_target(ids[None], output_hidden_states=True, return_shared_kv_states=True)
    states = out.shared_kv_states
    shared = {"full_attention": states["full_attention"],
              "sliding_attention": tuple(t[:, :, -W:] for t in states["sliding_attention"])}
    full = hf_drafts(hf_target, hf_assistant, shared, out.hidden_states[-1][0, -1], token,
                     prompt_len)
    for step, (a, b) in enumerate(zip(ours, full)):
        torch.testing.assert_close(a, b, rtol=0, atol=END_TO_END_ATOL, msg=f"step {step + 1}")


@pytest.mark.parametrize("ordered", [False, True], ids=["lm-head", "centroid-head"])
def test_transformers_directory_loads(tmp_path, ordered):
    hf_target, hf_assistant = hf_models(ordered, seed=3)
    hf_assistant.save_pretrained(tmp_path / "assistant")
    target, expected = ours_of(hf_target, hf_assistant)
    loaded = load_gemma4_assistant(tmp_path / "assistant", target)
    for (name, a), (_, b) in zip(sorted(loaded.state_dict().items()),
                                 sorted(expected.state_dict().items())):
        assert torch.equal(a, b), name
    # and our writer's directory reads back the same tensors
    save_gemma4_assistant(tmp_path / "ours", loaded)
    again = load_gemma4_assistant(tmp_path / "ours", target)
    for (name, a), (_, b) in zip(sorted(again.state_dict().items()),
                                 sorted(loaded.state_dict().items())):
        assert torch.equal(a, b), name


def test_refuses_what_it_cannot_run():
    hf_target, hf_assistant = hf_models(False)
    target, _ = ours_of(hf_target, hf_assistant)
    cfg = hf_assistant.config.to_dict()
    with pytest.raises(ValueError, match="backbone_hidden_size"):
        build_assistant(AssistantConfig.from_hf_config({**cfg, "backbone_hidden_size": 48}),
                        target, {})
    text = {**cfg["text_config"], "num_kv_shared_layers": 1}
    with pytest.raises(ValueError, match="every layer"):
        AssistantConfig.from_hf_config({**cfg, "text_config": text})
    wide = random_gemma4_assistant(target)
    wide.layers[0].self_attn.sliding_window = W + 1
    proposer = Gemma4AssistantProposer(wide, 2)
    layout = target.kv_cache_layout(B)
    with pytest.raises(ValueError, match="wider than the target"):
        proposer.bind_target_kv(target.make_layout_kv_cache(layout, 4), layout)
