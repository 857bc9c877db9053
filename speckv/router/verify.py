"""Recomputing a `BlockStored` event's block hashes from its fields alone, as the router's
index verifies every event it applies: the chain over the event's blocks (legacy or lookahead
hashes, LoRA / multimodal / salt extra keys retagged), and a hybrid group's coarser blocks
rebuilt as the run of hash-unit blocks its hashes chain over.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from speckv.events.schema import BlockStored, ExtraKeysError, retag_extra_keys
from speckv.hashing.block_hash import hash_block_tokens, hash_lookahead_block
from speckv.hashing.formats import format_for
from speckv.hashing.functions import HashAlgo
from speckv.hashing.request_hasher import hash_prompt


class VerifyError(ValueError):
    """An event that cannot be checked (not a wrong hash: unknown inputs)."""


def recompute_block_hashes(
    event: BlockStored,
    algo: HashAlgo,
    parent: bytes,
    lora_paths: Mapping[str, str],
) -> list[bytes]:
    """The full hashes of an event's blocks, from its fields alone (plus the parent's full hash
    and the LoRA paths). Raises `VerifyError` when the event's shape is inconsistent. Pure."""
    block_size = event.block_size
    num_blocks = len(event.block_hashes)
    tokens = event.token_ids
    if block_size <= 0 or len(tokens) != block_size * num_blocks:
        raise VerifyError(
            f"{len(tokens)} token ids for {num_blocks} blocks of {block_size}"
        )
    lookahead = event.lookahead_token_ids
    if lookahead is not None and len(lookahead) != num_blocks:
        raise VerifyError(f"{len(lookahead)} lookahead lists for {num_blocks} blocks")
    extra = event.extra_keys
    if extra is not None and len(extra) != num_blocks:
        raise VerifyError(f"{len(extra)} extra-key entries for {num_blocks} blocks")
    num_lookahead = len(lookahead[0]) if lookahead else 0
    if lookahead and any(len(ids) != num_lookahead for ids in lookahead):
        raise VerifyError("lookahead lists of different lengths in one event")
    if lookahead is not None and num_lookahead == 0:
        raise VerifyError("empty lookahead lists (L = 0 must omit the field)")

    if extra is None and _chain_is_contiguous(tokens, lookahead, block_size, num_lookahead):
        # Fast path: the run is one token sequence; the request hasher encodes it in bulk.
        sequence = [*tokens, *lookahead[-1]] if lookahead else tokens
        hashes = hash_prompt(algo, parent, block_size, format_for(num_lookahead), sequence)
        if len(hashes) == num_blocks:
            return hashes
    hashes = []
    for index in range(num_blocks):
        block = tokens[index * block_size : (index + 1) * block_size]
        try:
            keys = retag_extra_keys(extra[index] if extra else None, event.lora_name, lora_paths)
        except ExtraKeysError as err:
            raise VerifyError(str(err)) from None
        if lookahead:
            parent = hash_lookahead_block(algo, parent, block, lookahead[index], keys)
        else:
            parent = hash_block_tokens(algo, parent, block, keys)
        hashes.append(parent)
    return hashes


def _chain_is_contiguous(
    tokens: Sequence[int], lookahead: Sequence[Sequence[int]] | None, block_size: int, num: int
) -> bool:
    """Each block's lookahead equals the next block's first tokens (so one sequence holds it)."""
    if not lookahead:
        return True
    if num > block_size:
        return False
    num_blocks = len(lookahead)
    for index in range(num_blocks - 1):
        start = (index + 1) * block_size
        if list(lookahead[index]) != list(tokens[start : start + num]):
            return False
    return True


def at_hash_unit(event: BlockStored, unit: int) -> BlockStored:
    """A hybrid group's event whose blocks are m hash units each (a Mamba checkpoint every
    544 tokens over a 16-token hash unit), as the m-times-longer run of hash-unit blocks its
    hashes chain over: each unit's lookahead is the L tokens after it (inside the block, or
    the block's own lookahead for its last unit). Raises `VerifyError` when that cannot be
    rebuilt from the event (extra keys are per group block, not per unit). Pure."""
    size = event.block_size
    if size == unit:
        return event
    if size <= 0 or unit <= 0 or size % unit:
        raise VerifyError(f"blocks of {size} tokens over a hash unit of {unit}")
    if any(event.extra_keys or ()):  # vLLM sends one None per block without extra keys
        raise VerifyError("extra keys of a group block cannot be split into hash units")
    stride = size // unit
    num_blocks = len(event.block_hashes)
    tokens = event.token_ids
    if len(tokens) != size * num_blocks:
        raise VerifyError(f"{len(tokens)} token ids for {num_blocks} blocks of {size}")
    lookahead = event.lookahead_token_ids
    unit_lookahead: list[list[int]] | None = None
    if lookahead is not None:
        if len(lookahead) != num_blocks:
            raise VerifyError(f"{len(lookahead)} lookahead lists for {num_blocks} blocks")
        unit_lookahead = []
        for index, after in enumerate(lookahead):
            extended = [*tokens[index * size:(index + 1) * size], *after]
            num = len(after)
            unit_lookahead.extend(extended[(j + 1) * unit:(j + 1) * unit + num]
                                  for j in range(stride))
    return BlockStored(
        block_hashes=[b""] * (num_blocks * stride), parent_block_hash=event.parent_block_hash,
        token_ids=tokens, block_size=unit, lora_id=None, medium=event.medium,
        lora_name=event.lora_name, lookahead_token_ids=unit_lookahead)
