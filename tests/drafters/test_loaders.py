"""Loaders: every public layout round-trips (names, shapes, outputs) and bad inputs are refused."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from speckv.drafters import detect_format, load_drafter, save_drafter
from speckv.drafters.eagle3 import Eagle3Drafter
from tests.drafters.drafter_test_utils import (
    FLAVOUR_IDS,
    FLAVOURS,
    catch_up_all,
    make_drafter,
    random_states,
    read_kv,
    tiny_target,
)

N = 11


@pytest.fixture(scope="module")
def target():
    return tiny_target()


def _outputs(d, target):
    """Draft KV of a catch-up pass plus module 1's (dense) logits at every row."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, target.config.vocab_size, (N + 1,), generator=g).tolist()
    states = random_states(d, N, target.config.hidden_size)
    table = list(range(1, 5))
    kv = d.make_kv_cache(5, 4)
    catch_up_all(d, states, tokens, table, kv, [N])
    out = [read_kv(kv, j, table, range(N - j)) for j in range(d.num_kv_layers)]
    h = d.modules_chain[0].dense_forward(
        torch.tensor(tokens[1:])[None], d.first_hidden(states)[None], torch.arange(N)
    )[0][0]
    return out, d.modules_chain[0].compute_logits(h)


def _names(path):
    with safe_open(str(path / "model.safetensors"), framework="pt") as st:
        return set(st.keys())


@pytest.mark.parametrize(("fmt", "kw"), FLAVOURS, ids=FLAVOUR_IDS)
def test_round_trip_identical_outputs(fmt, kw, target, tmp_path):
    d = make_drafter(fmt, kw, target)
    save_drafter(d, tmp_path, kw.get("layout"))
    assert detect_format(tmp_path) == (fmt, kw.get("layout"))
    loaded = load_drafter(tmp_path, target)
    assert type(loaded) is type(d)
    assert loaded.draft_kv_lookahead_tokens == d.draft_kv_lookahead_tokens
    (kv_a, lg_a), (kv_b, lg_b) = _outputs(d, target), _outputs(loaded, target)
    for a, b in zip(kv_a, kv_b):
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert torch.equal(lg_a, lg_b)


def test_public_names(target, tmp_path):
    n = target.config.num_hidden_layers
    expect = {
        "eagle": {
            "fc.weight",
            "fc.bias",
            "layers.0.self_attn.q_proj.weight",
            "layers.0.mlp.down_proj.weight",
            "layers.0.post_attention_layernorm.weight",
        },
        "eagle3": {
            "fc.weight",
            "midlayer.self_attn.q_proj.weight",
            "midlayer.hidden_norm.weight",
            "midlayer.input_layernorm.weight",
            "norm.weight",
            "lm_head.weight",
            "d2t",
            "t2d",
        },
        "mtp_deepseek": {
            f"model.layers.{n}.eh_proj.weight",
            f"model.layers.{n}.enorm.weight",
            f"model.layers.{n}.hnorm.weight",
            f"model.layers.{n}.shared_head.norm.weight",
            f"model.layers.{n + 2}.self_attn.q_proj.weight",
        },
        "mtp_qwen": {
            "mtp.fc.weight",
            "mtp.pre_fc_norm_embedding.weight",
            "mtp.pre_fc_norm_hidden.weight",
            "mtp.norm.weight",
            "mtp.layers.1.mlp.up_proj.weight",
        },
    }
    for fmt, kw in FLAVOURS:
        d = make_drafter(fmt, kw, target)
        p = tmp_path / f"{fmt}-{kw.get('num_modules', 1)}"
        save_drafter(d, p, kw.get("layout"))
        names = _names(p)
        want = expect[fmt if "layout" not in kw else f"{fmt}_{kw['layout']}"]
        if kw.get("num_modules") == 1:  # only module 1 exists
            want = {x for x in want if f"layers.{n + 2}." not in x}
        assert want <= names, sorted(want - names)
        # The target's embedding / LM head are shared, never stored (EAGLE3 has its own head).
        assert not any("embed_tokens" in x for x in names)
    names = _names(tmp_path / "eagle-1")
    assert "layers.0.input_layernorm.weight" not in names  # EAGLE-1 layout


def test_eagle1_input_layernorm_and_extra_tensors(target, tmp_path):
    """A checkpoint WITH layers.0.input_layernorm (and a shipped embedding) loads as such."""
    d = make_drafter("eagle", {}, target)
    save_drafter(d, tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as st:
        state = {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118
    state["layers.0.input_layernorm.weight"] = torch.full((32,), 2.0)
    state["embed_tokens.weight"] = torch.zeros(61, 32)  # ignored: the target's is used
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = load_drafter(tmp_path, target)
    w = loaded.module.layer.input_layernorm.weight  # type: ignore[attr-defined]
    assert torch.equal(w, torch.full((32,), 2.0))


def test_eagle3_vllm_aux_layer_ids_and_d2t(target, tmp_path):
    d = make_drafter("eagle3", {}, target)
    assert isinstance(d, Eagle3Drafter)
    save_drafter(d, tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    # Stored as vLLM layer INPUT indices: ours + 1.
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [i + 1 for i in d.aux_layers]
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [1, 3, 5]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    loaded = load_drafter(tmp_path, target)
    assert loaded.target_aux_layers == (0, 2, 4)
    logits = loaded.module.compute_logits(torch.randn(3, 32))  # type: ignore[attr-defined]
    assert logits.shape == (3, 61)
    # Only target ids of the draft vocabulary (even ids here) can be drafted.
    assert torch.isinf(logits[:, 1::2]).all() and torch.isinf(logits[:, 60]).all()
    assert torch.isfinite(logits[:, 0:60:2]).all()


def test_mtp_deepseek_own_shared_head(target, tmp_path):
    d = make_drafter("mtp", {"num_modules": 1}, target)
    save_drafter(d, tmp_path, "deepseek")
    n = target.config.num_hidden_layers
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as st:
        state = {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118
    head = torch.randn(61, 32)
    state[f"model.layers.{n}.shared_head.head.weight"] = head
    state["model.layers.0.self_attn.q_proj.weight"] = torch.zeros(1)  # target tensor: ignored
    save_file(state, str(tmp_path / "model.safetensors"))
    loaded = load_drafter(tmp_path, target)
    assert torch.equal(loaded.modules_chain[0].head.weight, head)


def test_refuses_bin_and_wrong_shapes(target, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"speckv_drafter_format": "eagle"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(FileNotFoundError, match="never load"):
        load_drafter(tmp_path, target)
    d = make_drafter("eagle", {}, target)
    p = tmp_path / "ok"
    save_drafter(d, p)
    cfg = json.loads((p / "config.json").read_text())
    (p / "config.json").write_text(json.dumps({**cfg, "hidden_size": 48}))
    with pytest.raises(ValueError, match="hidden_size 48"):
        load_drafter(p, target)
    (p / "config.json").write_text(json.dumps(cfg))
    with safe_open(str(p / "model.safetensors"), framework="pt") as st:
        state = {k: st.get_tensor(k) for k in st.keys()}  # noqa: SIM118
    state["fc.weight"] = torch.zeros(32, 48)
    save_file(state, str(p / "model.safetensors"))
    with pytest.raises(ValueError, match="shape"):
        load_drafter(p, target)
