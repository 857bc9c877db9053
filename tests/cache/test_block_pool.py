"""Block pool: free-queue order, eviction, hashless-first reuse, reset, integrity."""

from __future__ import annotations

import pytest

from speckv.cache.block import FreeBlockQueue, KVCacheBlock
from speckv.cache.block_pool import BlockPool, GroupInfo
from speckv.cache.events import AllBlocksCleared, BlockRemoved, KVEventSink


class FakeRequest:
    def __init__(self, tokens):
        from speckv.hashing.extra_keys import NO_HASH_INPUTS

        self.request_id = "fake"
        self.all_token_ids = tokens
        self.num_prompt_tokens = len(tokens)
        self.hash_inputs = NO_HASH_INPUTS
        self.lora_name = None


GROUP = GroupInfo(group_id=0, block_size=2, lookahead_tokens=0)


def test_free_queue_remove_from_middle_and_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    queue.check_links()
    assert [b.block_id for b in queue] == [0, 1, 3, 4]
    queue.appendleft(blocks[2])
    assert queue.popleft() is blocks[2]
    assert queue.num_free_blocks == 4
    with pytest.raises(RuntimeError):
        queue.remove(blocks[2])


def test_null_block_is_never_handed_out():
    pool = BlockPool(4)
    handed = pool.get_new_blocks(3)
    assert pool.null_block not in handed
    with pytest.raises(ValueError, match="only 0 free"):
        pool.get_new_blocks(1)
    pool.check_integrity({b.block_id: 1 for b in handed})


def test_freed_chain_tail_is_evicted_first_and_hashless_reused_first():
    pool = BlockPool(8, event_sink=KVEventSink())
    blocks = pool.get_new_blocks(3)
    request = FakeRequest([1, 2, 3, 4, 5, 6])
    pool.cache_full_blocks(request, blocks, [b"h0", b"h1", b"h2"], 0, 3, GROUP)
    plain = pool.get_new_blocks(1)
    pool.free_blocks(reversed(blocks))  # tail first, as managers free
    pool.free_blocks(plain)
    pool.check_integrity()
    # hashless first, then the untouched free blocks... cached ones last, tail before head
    order = [b.block_id for b in pool.free_queue]
    assert order[0] == plain[0].block_id
    assert order[-3:] == [blocks[2].block_id, blocks[1].block_id, blocks[0].block_id]
    # Exhausting the pool evicts the chain tail before its head.
    pool.event_sink.take()
    taken = pool.get_new_blocks(pool.get_num_free_blocks() - 1)
    assert pool.get_cached_block(b"h0", 0) is blocks[0]
    assert pool.get_cached_block(b"h2", 0) is None
    removed = [e for e in pool.event_sink.take() if isinstance(e, BlockRemoved)]
    assert [h for e in removed for h in e.block_hashes] == [b"h2", b"h1"]
    pool.check_integrity({b.block_id: 1 for b in taken})


def test_touch_takes_cached_block_off_the_queue():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(1)
    pool.cache_full_blocks(FakeRequest([1, 2]), blocks, [b"h"], 0, 1, GROUP)
    pool.free_blocks(blocks)
    assert pool.get_num_free_blocks() == 3
    hit = pool.get_cached_block(b"h", 0)
    pool.touch([hit])
    assert pool.get_num_free_blocks() == 2
    pool.check_integrity({hit.block_id: 1})
    pool.touch([hit])
    pool.check_integrity({hit.block_id: 2})


def test_double_free_raises():
    pool = BlockPool(4)
    blocks = pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks(blocks)


def test_duplicate_content_keeps_one_cached_copy():
    pool = BlockPool(6)
    first, second = pool.get_new_blocks(1), pool.get_new_blocks(1)
    request = FakeRequest([1, 2])
    pool.cache_full_blocks(request, first, [b"same"], 0, 1, GROUP)
    pool.cache_full_blocks(request, second, [b"same"], 0, 1, GROUP)
    assert pool.get_cached_block(b"same", 0) is first[0]
    assert second[0].cache_key is None
    pool.check_integrity({first[0].block_id: 1, second[0].block_id: 1})


def test_same_hash_in_two_groups_is_two_entries():
    pool = BlockPool(6)
    a, b = pool.get_new_blocks(1), pool.get_new_blocks(1)
    request = FakeRequest([1, 2])
    pool.cache_full_blocks(request, a, [b"h"], 0, 1, GROUP)
    pool.cache_full_blocks(request, b, [b"h"], 0, 1, GroupInfo(1, 2, 0))
    assert pool.get_cached_block(b"h", 0) is a[0]
    assert pool.get_cached_block(b"h", 1) is b[0]


def test_reset_refuses_while_in_use_then_clears():
    sink = KVEventSink()
    pool = BlockPool(4, event_sink=sink)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(FakeRequest([1, 2, 3, 4]), blocks, [b"a", b"b"], 0, 2, GROUP)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(b"a", 0) is blocks[0]
    pool.free_blocks(reversed(blocks))
    assert pool.reset_prefix_cache() is True
    assert pool.cached_blocks == {}
    assert isinstance(sink.take()[-1], AllBlocksCleared)
    pool.check_integrity()


def test_integrity_check_catches_a_leak():
    pool = BlockPool(4)
    block = pool.get_new_blocks(1)[0]
    block.ref_cnt = 0  # simulate a bug outside the pool
    with pytest.raises(AssertionError, match="leak"):
        pool.check_integrity()
