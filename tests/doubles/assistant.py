"""A Gemma 4 MTP assistant whose drafts a repetitive target accepts (tests, benches).

Owns `echo_assistant`: a random-init assistant (`speckv.drafters.gemma4_assistant`) whose
weights are then set so that it drafts its input token again: pre_projection passes the
target's token embedding through, the layers add only a small random residual (their
attention over the target's KV still runs), and the LM head is the target's embedding table,
so argmax(E[t] . E[v]) = t. Random-init targets with a small vocabulary decode long runs of
one token; this assistant's drafts are then accepted, which random weights almost never are.
"""

from __future__ import annotations

import torch

from speckv.drafters.gemma4_assistant import Gemma4Assistant, random_gemma4_assistant


def echo_assistant(target, residual_std: float = 0.01, seed: int = 0) -> Gemma4Assistant:
    """An assistant of the target's width that drafts the last token again (see above)."""
    assistant = random_gemma4_assistant(target, seed=seed, init_std=residual_std)
    hidden = target.config.hidden_size
    with torch.no_grad():
        eye = torch.eye(hidden, dtype=assistant.dtype, device=assistant.device)
        assistant.pre_projection.weight.zero_()
        assistant.pre_projection.weight[:, :hidden].copy_(eye)  # [embedding ; hidden] -> emb
        for name, p in assistant.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
        assistant.lm_head.weight.copy_(target.embed_tokens.weight)
    return assistant
