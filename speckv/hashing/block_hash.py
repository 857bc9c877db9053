"""Single-block hash functions (pure), vLLM-compatible.

`hash_block_tokens` is vLLM's legacy `hash_block_tokens`; `hash_lookahead_block` is the
lookahead form. Both exist for clarity, tests and consumers (routers); requests hash through
`RequestBlockHasher`, which produces the same bytes faster.
"""

from __future__ import annotations

from collections.abc import Sequence

from speckv.hashing.extra_keys import ExtraKeys
from speckv.hashing.functions import BlockHash, HashAlgo


def hash_block_tokens(
    algo: HashAlgo, parent: BlockHash, token_ids: Sequence[int], extra_keys: ExtraKeys = None
) -> BlockHash:
    """Legacy: `H((parent, tuple(tokens[s:e]), E(s, e)))`."""
    return algo((parent, tuple(token_ids), extra_keys))


def hash_lookahead_block(
    algo: HashAlgo,
    parent: BlockHash,
    token_ids: Sequence[int],
    lookahead_token_ids: Sequence[int],
    extra_keys: ExtraKeys = None,
) -> BlockHash:
    """Lookahead: `H((parent, tuple(tokens[s:e]), (E(s, e + L), *tokens[e:e + L])))`.

    `extra_keys` must be `E` over the block *and* its lookahead tokens.
    """
    if not lookahead_token_ids:
        raise ValueError("a lookahead block hash needs at least one lookahead token")
    return algo((parent, tuple(token_ids), (extra_keys, *lookahead_token_ids)))
