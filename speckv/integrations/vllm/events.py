"""`BlockStored` with `lookahead_token_ids`: the KV event the plugin's engines publish.

Owns the event subclass and its construction. It keeps vLLM's tag ("BlockStored") and every
field vLLM sets, and adds speckv's one field (as `speckv.events.schema` publishes it):

    lookahead_token_ids  one list of L tokens per block: tokens[e:e+L] after block [s, e)
    extra_keys           per block, the untagged E(s, e + L) its hash covers

A consumer that does not know the field ignores it (msgspec skips unknown map keys).
"""

from __future__ import annotations

from typing import Any

import msgspec

_classes: dict[type, type] = {}


def lookahead_block_stored(block_stored: type) -> type:
    """vLLM's `BlockStored` plus `lookahead_token_ids`, same wire tag (one class per base)."""
    cls = _classes.get(block_stored)
    if cls is None:
        cls = msgspec.defstruct(
            "BlockStored",
            [("lookahead_token_ids", list[list[int]] | None, None)],
            bases=(block_stored,),
            tag="BlockStored",
            module=__name__,
        )
        _classes[block_stored] = cls
    return cls


def event_with_lookahead(event: Any, request: Any, start: int, end: int, block_size: int,
                         lookahead: int, targets: Any) -> Any:
    """The event vLLM built for blocks [start, end) of `request`, with each block's L
    successor tokens and its extra keys over [s, e + L). Unchanged when some blocks in the
    range were masked out (sparse groups never get lookahead hashes)."""
    starts = range(start, end, block_size)
    if event.block_hashes is None or len(event.block_hashes) != len(starts):
        return event
    tokens = request.all_token_ids
    utils = targets.kv_cache_utils
    extra_keys = [utils.generate_block_hash_extra_keys(request, s, s + block_size + lookahead,
                                                        0)[0] for s in starts]
    fields = msgspec.structs.asdict(event)
    fields["extra_keys"] = utils.to_event_extra_keys(extra_keys)
    cls = lookahead_block_stored(type(event))
    return cls(**fields, lookahead_token_ids=[
        list(tokens[s + block_size : s + block_size + lookahead]) for s in starts])
