"""A mirror of one vLLM engine's block pool: the evictions a routed request will cause,
known before the engine's events report them.

Owns the router's model of the engine's free-block queue (its eviction order), each block's
reference count and hash, and the blocks each request routed there holds. A vLLM engine
evicts a cached block when an allocation pops it from the queue head; its BlockRemoved event
reaches the router a step later. A request routed in between would be predicted to hit the
block and be served without it. The mirror runs vLLM's pool rules as the router sends
requests, so the hit it predicts is the one the engine will serve:

    free queue   head (evicted first) ... tail (evicted last); blocks with ref 0 only
    allocate n   pop n blocks from the head; a popped block's hash is evicted
    hit          touch the matched blocks (the oldest copy of each hash): out of the
                 queue, ref + 1
    cache        the request's full prompt blocks take their hashes at scheduling (a
                 hash may be held by several blocks: the EAGLE-dropped block recomputed)
    free         at the request's end, its blocks last to first: ref - 1; reaching 0, a
                 cached block goes to the tail, an uncached one to the head

A request is scheduled when routed, and freed when its answer ends. The engine may order
the two differently (a request ends while a later one waits for the next step), so the
engine's events correct the mirror: a BlockRemoved for a hash the mirror keeps on a free
block means the engine evicted that block where the mirror evicted another one; the mirror
gives that block the oldest hash it evicted that no BlockRemoved has confirmed yet (the
block the engine kept), and drops the reported hash. Hashes the engine stored for requests
that did not come through this router (another client, the history replayed to a router
started after the engine) are not mirrored: the fleet counts those from its index, unless
the mirror `evicted` them. A reset through the router clears the
mirror at once; the engine's AllBlocksCleared for it, which comes with its next step, after
requests the router has already routed, is then skipped.

Keys are the low 64 bits of block hashes (as the router index keys them); a block whose
content the router does not know (a decoded block) holds a negative key. Not thread-safe:
the fleet's lock serialises every call.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field

from speckv.events.schema import AllBlocksCleared, BlockRemoved, KVEventBatch, low64


@dataclass(frozen=True)
class PoolShape:
    """What the mirror must know of the engine's pool (its /metrics and flags)."""

    num_blocks: int  # vLLM's num_gpu_blocks, the null block included
    block_size: int  # tokens per block
    lookahead_slots: int = 0  # KV slots an EAGLE-family drafter reserves past the tokens
    group_idx: int = 0  # the KV cache group the engine's events name

    def __post_init__(self) -> None:
        if self.num_blocks < 2 or self.block_size <= 0 or self.lookahead_slots < 0:
            raise ValueError(f"PoolShape: num_blocks >= 2, block_size > 0 and "
                             f"lookahead_slots >= 0, got {self}")


@dataclass
class _Request:
    blocks: list[int]  # block ids, in block-table order
    num_prompt_tokens: int
    # keys this request's scheduling gave to blocks (its uncached prompt blocks)
    introduced: list[int] = field(default_factory=list)


_NULL = 0  # vLLM's null block: never free, never cached


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class PoolMirror:
    """One vLLM engine's block pool as the router models it."""

    def __init__(self, shape: PoolShape) -> None:
        self.shape = shape
        self._queue: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, shape.num_blocks))
        self._ref = [0] * shape.num_blocks
        # a free block's place in the queue: smaller is nearer the head
        self._place = list(range(shape.num_blocks))
        self._head_place, self._tail_place = 0, shape.num_blocks
        self._key: dict[int, int] = {}  # block -> key
        self._copies: dict[int, list[int]] = {}  # key -> blocks holding it, oldest first
        self._requests: dict[Hashable, _Request] = {}
        # keys the mirror evicted that no BlockRemoved has confirmed yet, oldest first
        self._unconfirmed: deque[int] = deque()
        self._num_unconfirmed: dict[int, int] = {}  # key -> times in `_unconfirmed`
        self._unknown = itertools.count(-1, -1)  # keys of blocks of unknown content
        self.corrections = 0  # BlockRemoved events the mirror had not predicted
        self._clears_ahead = 0  # resets the router applied before the engine's event came

    # ---- reading -----------------------------------------------------------------------------
    def evicted(self, key: int) -> bool:
        """Whether the mirror evicted `key` and no BlockRemoved has confirmed it yet (the
        engine's events may still show it cached). Pure."""
        return key in self._num_unconfirmed

    def matched_blocks(self, keys: Sequence[int],
                       published: Callable[[int], bool] | None = None) -> int:
        """Leading keys of a prompt's chain the pool holds; with `published` (the engine's
        events), also those only the events show (stored for another client, or before the
        router started) unless the mirror evicted them. Pure."""
        matched = 0
        for key in keys:
            if key not in self._copies and not (
                    published is not None and published(key)
                    and key not in self._num_unconfirmed):
                break
            matched += 1
        return matched

    @property
    def num_free_blocks(self) -> int:
        return len(self._queue)

    def holds(self, key: int) -> bool:
        return key in self._copies

    # ---- requests ----------------------------------------------------------------------------
    def schedule(self, request: Hashable, keys: Sequence[int], num_prompt_tokens: int,
                 cached_tokens: int, divergent_source: int | None = None) -> None:
        """The engine schedules `request`: `cached_tokens` of its prompt served from the
        leading blocks of `keys` (its prompt's chain), and past a whole block from the block
        cached under key `divergent_source` (copied into a block of its own: the source is
        touched for the copy, then released to the tail); the rest allocated and its full
        prompt blocks cached. A request that does not fit takes the blocks there are (vLLM
        would make it wait; the mirror does not model its queue). Mutates."""
        size = self.shape.block_size
        num_hit = min(cached_tokens // size, len(keys))
        held = self.matched_blocks(keys[:num_hit])
        # hit blocks only the engine's events show stand as the null block (never free,
        # never cached): positions in `blocks` stay block indices
        blocks = [self._copies[key][0] for key in keys[:held]] + [_NULL] * (num_hit - held)
        source = None
        if divergent_source in self._copies and cached_tokens % size:
            source = self._copies[divergent_source][-1]  # the engine's index: the latest
        for block in blocks[:held] + ([source] if source is not None else []):  # touch
            if self._ref[block] == 0:
                del self._queue[block]
            self._ref[block] += 1
        needed = _cdiv(num_prompt_tokens + self.shape.lookahead_slots, size) - num_hit
        blocks += self._allocate(needed)
        if source is not None:  # the copy ran: released
            self._free([source])
        state = _Request(blocks, num_prompt_tokens)
        for index in range(num_hit, min(len(keys), num_prompt_tokens // size, len(blocks))):
            self._cache(blocks[index], keys[index])
            state.introduced.append(keys[index])
        self._requests[request] = state

    def finish(self, request: Hashable, num_output_tokens: int | None,
               confirmed: Callable[[int], bool] = lambda key: True) -> None:
        """The answer to `request` ended after `num_output_tokens`: its decode blocks
        allocated (those full cached under keys the router does not know), then all its
        blocks freed, last first. `num_output_tokens` None: it failed, maybe before the engine
        scheduled it, and the hashes its scheduling gave that the engine's events have not
        `confirmed` are dropped. Mutates."""
        state = self._requests.pop(request, None)
        if state is None:
            return
        size = self.shape.block_size
        blocks = state.blocks
        if num_output_tokens:
            num_tokens = state.num_prompt_tokens + num_output_tokens - 1
            blocks += self._allocate(_cdiv(num_tokens + self.shape.lookahead_slots, size)
                                     - len(blocks))
            for index in range(min(num_tokens // size, len(blocks))):
                if blocks[index] != _NULL and blocks[index] not in self._key:
                    self._cache(blocks[index], next(self._unknown))
        elif num_output_tokens is None:  # the engine may never have scheduled it
            for block in blocks:
                key = self._key.get(block)
                if key is not None and key in state.introduced and not confirmed(key):
                    self._uncache(block)
        self._free(list(reversed(blocks)))

    def _free(self, blocks: list[int]) -> None:
        """vLLM's `free_blocks`, in eviction order: reaching ref 0, cached blocks to the tail
        in this order, uncached ones to the head in this order."""
        first: list[int] = []
        for block in blocks:
            if block == _NULL:
                continue
            self._ref[block] -= 1
            if self._ref[block]:
                continue
            if block in self._key:
                self._queue[block] = None
                self._tail_place += 1
                self._place[block] = self._tail_place
            else:
                first.append(block)
        for block in reversed(first):
            self._queue[block] = None
            self._queue.move_to_end(block, last=False)
            self._head_place -= 1
            self._place[block] = self._head_place

    # ---- events ------------------------------------------------------------------------------
    def apply_batch(self, batch: KVEventBatch) -> None:
        """Correct the mirror by the engine's events. Mutates."""
        group = self.shape.group_idx
        for event in batch.events:
            if isinstance(event, BlockRemoved) and (event.group_idx or 0) == group:
                for block_hash in event.block_hashes:
                    self._removed(low64(block_hash))
            elif isinstance(event, AllBlocksCleared):
                if self._clears_ahead:  # applied when the router reset the engine
                    self._clears_ahead -= 1
                else:
                    self.clear()

    def clear(self, event_to_come: bool = False) -> None:
        """The engine's prefix cache was reset: no block holds a hash. `event_to_come`: the
        router reset it, and the engine's AllBlocksCleared (published with its next step)
        is to be skipped: requests routed before it came already hold hashes. Mutates."""
        self._clears_ahead += event_to_come
        self._key.clear()
        self._copies.clear()
        self._unconfirmed.clear()
        self._num_unconfirmed.clear()

    def _removed(self, key: int) -> None:
        if key in self._num_unconfirmed:  # evicted here too
            self._unconfirmed.remove(key)
            self._forget_unconfirmed(key)
            return
        holders = self._copies.get(key)
        if not holders:
            return
        # the engine evicted a block the mirror keeps: the free copy nearest the head
        free = [block for block in holders if self._ref[block] == 0]
        block = min(free, key=self._place.__getitem__) if free else holders[0]
        self._uncache(block)
        self.corrections += 1
        if free and self._unconfirmed:
            # ... where the mirror evicted another: the engine kept that one, in this place
            kept = self._unconfirmed.popleft()
            self._forget_unconfirmed(kept)
            self._cache(block, kept)

    # ---- the pool's rules --------------------------------------------------------------------
    def _allocate(self, count: int) -> list[int]:
        """Pop `count` blocks from the queue head, evicting their keys."""
        blocks = []
        for _ in range(max(0, min(count, len(self._queue)))):
            block, _ = self._queue.popitem(last=False)
            key = self._key.get(block)
            if key is not None:
                self._uncache(block)
                if key >= 0:
                    self._unconfirmed.append(key)
                    self._num_unconfirmed[key] = self._num_unconfirmed.get(key, 0) + 1
                    if len(self._unconfirmed) > self.shape.num_blocks:
                        self._forget_unconfirmed(self._unconfirmed.popleft())
            self._ref[block] = 1
            blocks.append(block)
        return blocks

    def _forget_unconfirmed(self, key: int) -> None:
        count = self._num_unconfirmed[key] - 1
        if count:
            self._num_unconfirmed[key] = count
        else:
            del self._num_unconfirmed[key]

    def _cache(self, block: int, key: int) -> None:
        self._key[block] = key
        self._copies.setdefault(key, []).append(block)

    def _uncache(self, block: int) -> None:
        key = self._key.pop(block)
        holders = self._copies[key]
        holders.remove(block)
        if not holders:
            del self._copies[key]
