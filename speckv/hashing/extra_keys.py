"""Extra keys `E(s, e)`: what besides token ids makes a span's KV different.

Owns the per-request hash inputs (`HashInputs`) and the layout of the extra-key tuple, in the
current vLLM release's order, each entry tagged with its source:

    ("lora", name, path)                    the request uses a LoRA adapter
    ("mm", identifier, item_offset - s)     per multimodal item overlapping [s, e); negative when
                                            the item starts before the span
    ("cache_salt", salt)                    only when s == 0
    ("prompt_embeds", sha256 digest)        of the prompt-embedding bytes of [s, e)

`E` is `None` when no entry applies. KV events publish the *untagged* values (`untag`).
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

ExtraKeys = tuple[tuple[Any, ...], ...] | None


@dataclass(frozen=True)
class LoRARef:
    name: str
    path: str


@dataclass(frozen=True)
class MultiModalItem:
    """A placeholder span `[offset, offset + length)` of prompt tokens filled by one item."""

    identifier: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        if self.offset < 0:
            raise ValueError(f"MultiModalItem.offset must be >= 0, got {self.offset}")
        if self.length <= 0:
            raise ValueError(f"MultiModalItem.length must be > 0, got {self.length}")

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True, eq=False)
class HashInputs:
    """Everything besides token ids that enters a request's block hashes."""

    lora: LoRARef | None = None
    mm_items: tuple[MultiModalItem, ...] = ()
    cache_salt: str | None = None
    # [num_prompt_tokens, hidden_size]; hashed row-span by row-span
    prompt_embeds: np.ndarray | None = None
    _mm_ends: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        items = tuple(sorted(self.mm_items, key=lambda item: item.offset))
        for before, after in itertools.pairwise(items):
            if after.offset < before.end:
                raise ValueError(
                    f"multimodal items overlap: {before.identifier!r} ends at {before.end}, "
                    f"{after.identifier!r} starts at {after.offset}"
                )
        object.__setattr__(self, "mm_items", items)
        object.__setattr__(self, "_mm_ends", tuple(item.end for item in items))

    @property
    def is_empty(self) -> bool:
        return (
            self.lora is None
            and not self.mm_items
            and self.cache_salt is None
            and self.prompt_embeds is None
        )

    def span_may_have_keys(self, start: int, end: int) -> bool:
        """Cheap pre-check: False guarantees `extra_keys(start, end)` is None."""
        if self.lora is not None or self.prompt_embeds is not None:
            return True
        if start == 0 and self.cache_salt is not None:
            return True
        if not self.mm_items:
            return False
        first = bisect.bisect_right(self._mm_ends, start)
        return first < len(self.mm_items) and self.mm_items[first].offset < end

    def extra_keys(self, start: int, end: int) -> ExtraKeys:
        """`E(start, end)`: tagged extra keys of the token span `[start, end)`. Pure."""
        keys: list[tuple[Any, ...]] = []
        if self.lora is not None:
            keys.append(("lora", self.lora.name, self.lora.path))
        if self.mm_items:
            # items are sorted and disjoint, so their ends are sorted too
            index = bisect.bisect_right(self._mm_ends, start)
            while index < len(self.mm_items) and self.mm_items[index].offset < end:
                item = self.mm_items[index]
                keys.append(("mm", item.identifier, item.offset - start))
                index += 1
        if start == 0 and self.cache_salt is not None:
            keys.append(("cache_salt", self.cache_salt))
        if self.prompt_embeds is not None:
            rows = np.ascontiguousarray(self.prompt_embeds[start:end])
            keys.append(("prompt_embeds", hashlib.sha256(rows.tobytes()).digest()))
        return tuple(keys) if keys else None


NO_HASH_INPUTS = HashInputs()


def untag(extra: ExtraKeys) -> list[Any] | None:
    """The untagged values that KV-event consumers parse: LoRA name, `(identifier, offset)`
    pairs, the salt string, prompt-embedding digests."""
    if extra is None:
        return None
    values: list[Any] = []
    for entry in extra:
        tag = entry[0]
        if tag == "lora":
            values.append(entry[1])
        elif tag == "mm":
            values.append((entry[1], entry[2]))
        else:  # cache_salt, prompt_embeds
            values.append(entry[1])
    return values
