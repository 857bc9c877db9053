"""Where the EAGLE3 head starts: the target's last decoder layer over the high aux layer and
the target's LM-head rows of the draft vocabulary (`init_from_target`), or a trained head
(`init_from_head`), with the aux features' scale folded into the fusion layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from speckv.drafters.eagle3 import Eagle3Drafter
from speckv.drafters.loaders import load_drafter
from speckv.models.base import TargetModel
from speckv.training.distill import (
    AUX_LAYERS,
    DistillSequence,
)

if TYPE_CHECKING:
    pass


def init_from_target(drafter: Eagle3Drafter, model: TargetModel, vocab: list[int],
                     aux_scale: torch.Tensor) -> None:
    """The head starts as the target's last decoder layer reading the high aux layer (the last
    layer's input), so its first guess is the target's own next token one position early.

    fc = [0 | 0 | I] passes the high aux feature through (times its scale: fc reads scaled
    features while training); q/k/v read it through hidden_norm
    (= the last layer's input norm) with the embedding half zero; o_proj, MLP, norms and the
    LM head rows are the target's. Training then teaches the layer to use the next token.
    """
    m = drafter.module
    src = model.layers[-1]
    h = model.config.hidden_size
    if drafter.aux_layers[-1] != model.config.num_hidden_layers - 2:
        raise ValueError("init_from_target needs the high aux layer to be the last layer's input")
    with torch.no_grad():
        drafter.fc.weight.zero_()
        drafter.fc.weight[:, 2 * h :] = torch.diag(aux_scale[2 * h :])
        attn, src_attn = m.midlayer.self_attn, src.self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            ours, theirs = getattr(attn, name), getattr(src_attn, name)
            ours.weight.zero_()
            ours.weight[:, h:] = theirs.weight
            if ours.bias is not None and theirs.bias is not None:
                ours.bias.copy_(theirs.bias)
        attn.o_proj.load_state_dict(src_attn.o_proj.state_dict())
        m.midlayer.mlp.load_state_dict(src.mlp.state_dict())
        m.midlayer.post_attention_layernorm.load_state_dict(
            src.post_attention_layernorm.state_dict())
        m.midlayer.input_layernorm.weight.fill_(1.0)
        m.midlayer.hidden_norm.weight.copy_(src.input_layernorm.weight)
        m.norm.weight.copy_(model.norm.weight)
        ids = torch.tensor(vocab, dtype=torch.int64)
        m.lm_head.weight.copy_(model.lm_head.weight[ids])
        m.d2t.copy_(ids - torch.arange(len(vocab)))
        m.t2d.zero_()
        m.t2d[ids] = True


def init_from_head(path: Path, model: TargetModel, aux_scale: torch.Tensor,
                   aux_layers: tuple[int, ...] = AUX_LAYERS
                   ) -> tuple[Eagle3Drafter, list[int]]:
    """(a saved EAGLE3 head as an fp32 training start, its draft vocabulary as target ids).

    The saved fc reads raw features; training feeds features divided by `aux_scale`, so fc's
    columns are multiplied by it (the inverse of `fold_aux_scale`).
    """
    drafter = load_drafter(path, model, torch.float32, "cpu")
    if not isinstance(drafter, Eagle3Drafter) or tuple(drafter.aux_layers) != aux_layers:
        raise ValueError(f"--init-from {path}: not an EAGLE3 head on aux layers "
                         f"{[i + 1 for i in aux_layers]} (vLLM numbering)")
    m = drafter.module
    vocab = (torch.arange(m.d2t.shape[0]) + m.d2t).tolist()
    with torch.no_grad():
        drafter.fc.weight.mul_(aux_scale[None, :])
    return drafter, vocab


def aux_feature_scale(data: Sequence[DistillSequence], max_rows: int = 50_000) -> torch.Tensor:
    """Per-channel RMS of the three aux layers' features [3H] (>= 1).

    The target's aux features span four orders of magnitude across channels (a few "massive
    activation" channels reach 1e4 on the first positions), so fc trains on features divided
    by this scale and the scale is folded into fc's columns before saving (`fold_aux_scale`):
    the saved head reads raw features, as the EAGLE3 format and vLLM expect.
    """
    rows, total = [], 0
    for seq in data:
        rows.append(seq.features[:, :3].flatten(1).float())
        total += rows[-1].shape[0]
        if total >= max_rows:
            break
    x = torch.cat(rows)  # [n, 3H]
    return x.pow(2).mean(0).sqrt().clamp_min(1.0)


def fold_aux_scale(drafter: Eagle3Drafter, aux_scale: torch.Tensor) -> None:
    """fc(x / s) == (fc with columns divided by s)(x): make the head read raw features."""
    with torch.no_grad():
        drafter.fc.weight.div_(aux_scale[None, :])
