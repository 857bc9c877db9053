"""Extra keys E(s, e): LoRA, multimodal offsets, cache salt, prompt embeds, untag."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from speckv.hashing.extra_keys import (
    NO_HASH_INPUTS,
    HashInputs,
    LoRARef,
    MultiModalItem,
    untag,
)
from speckv.hashing.formats import format_for
from speckv.hashing.functions import get_hash_algo
from speckv.hashing.request_hasher import hash_prompt

SHA = get_hash_algo("sha256")
NONE_HASH = b"\x01" * 32
TOKENS = list(range(1000, 1040))


def test_empty_is_none() -> None:
    assert NO_HASH_INPUTS.extra_keys(0, 16) is None
    assert untag(None) is None


def test_lora_on_every_span() -> None:
    inputs = HashInputs(lora=LoRARef("sql", "/adapters/sql"))
    assert inputs.extra_keys(16, 32) == (("lora", "sql", "/adapters/sql"),)


def test_mm_offsets_relative_to_span_start_negative_when_before() -> None:
    inputs = HashInputs(mm_items=(MultiModalItem("img", offset=10, length=20),))
    assert inputs.extra_keys(0, 16) == (("mm", "img", 10),)
    assert inputs.extra_keys(16, 32) == (("mm", "img", -6),)  # item started before the block
    assert inputs.extra_keys(32, 48) is None


def test_item_starting_in_lookahead_changes_previous_block_hash() -> None:
    # an image starting at token 4 is the lookahead token of block [0, 4) (B=4, L=1)
    with_item = HashInputs(mm_items=(MultiModalItem("img", offset=4, length=4),))
    plain = hash_prompt(SHA, NONE_HASH, 4, format_for(1), TOKENS[:9])
    hashed = hash_prompt(SHA, NONE_HASH, 4, format_for(1), TOKENS[:9], with_item)
    assert hashed[0] != plain[0]
    # legacy hashes do not see it in block 0
    legacy_plain = hash_prompt(SHA, NONE_HASH, 4, format_for(0), TOKENS[:9])
    legacy = hash_prompt(SHA, NONE_HASH, 4, format_for(0), TOKENS[:9], with_item)
    assert legacy[0] == legacy_plain[0] and legacy[1] != legacy_plain[1]
    assert with_item.extra_keys(0, 5) == (("mm", "img", 4),)


def test_cache_salt_only_on_block_zero() -> None:
    inputs = HashInputs(cache_salt="tenant-a")
    assert inputs.extra_keys(0, 16) == (("cache_salt", "tenant-a"),)
    assert inputs.extra_keys(16, 32) is None


def test_prompt_embeds_digest_of_rows() -> None:
    embeds = np.arange(40 * 3, dtype=np.float32).reshape(40, 3)
    inputs = HashInputs(prompt_embeds=embeds)
    digest = hashlib.sha256(np.ascontiguousarray(embeds[4:9]).tobytes()).digest()
    assert inputs.extra_keys(4, 9) == (("prompt_embeds", digest),)


def test_order_lora_mm_salt_embeds() -> None:
    embeds = np.zeros((8, 2), dtype=np.float32)
    inputs = HashInputs(lora=LoRARef("a", "/a"), mm_items=(MultiModalItem("i", 1, 2),),
                        cache_salt="s", prompt_embeds=embeds)
    tags = [entry[0] for entry in inputs.extra_keys(0, 4)]
    assert tags == ["lora", "mm", "cache_salt", "prompt_embeds"]


def test_overlapping_mm_items_rejected() -> None:
    with pytest.raises(ValueError, match="overlap"):
        HashInputs(mm_items=(MultiModalItem("a", 0, 10), MultiModalItem("b", 5, 10)))
    with pytest.raises(ValueError):
        MultiModalItem("a", -1, 4)
    with pytest.raises(ValueError):
        MultiModalItem("a", 0, 0)


def test_untag_values_consumers_parse() -> None:
    extra = (("lora", "sql", "/p"), ("mm", "img", -3), ("cache_salt", "s"),
             ("prompt_embeds", b"\x00" * 32))
    assert untag(extra) == ["sql", ("img", -3), "s", b"\x00" * 32]


def test_span_may_have_keys_never_misses() -> None:
    inputs = HashInputs(mm_items=(MultiModalItem("a", 5, 3), MultiModalItem("b", 20, 1)),
                        cache_salt="s")
    for start in range(0, 30):
        for end in range(start + 1, 32):
            if inputs.extra_keys(start, end) is not None:
                assert inputs.span_may_have_keys(start, end)
