"""The pool's batch paths: free-queue batch operations, null prefixes, strided hash views."""

from __future__ import annotations

import pytest

from speckv.cache.block import FreeBlockQueue, KVCacheBlock
from speckv.cache.block_pool import BlockPool, GroupInfo
from speckv.cache.kv_cache_manager import StridedHashes


def test_queue_batches_keep_lru_order() -> None:
    blocks = [KVCacheBlock(i) for i in range(8)]
    queue = FreeBlockQueue(blocks[:6])
    assert [b.block_id for b in queue.popleft_n(2)] == [0, 1]
    queue.remove_n([blocks[3], blocks[5]])
    queue.append_n([blocks[0], blocks[1]])
    queue.appendleft_n([blocks[6], blocks[7]])
    assert [b.block_id for b in queue] == [6, 7, 2, 4, 0, 1]
    assert queue.count_in(blocks) == 6
    with pytest.raises(RuntimeError, match="already in the free queue"):
        queue.append_n([blocks[2]])
    with pytest.raises(RuntimeError, match="not in the free queue"):
        queue.remove_n([blocks[3]])
    with pytest.raises(ValueError, match="only"):
        queue.popleft_n(100)
    assert [b.block_id for b in queue.popleft_n(len(queue))] == [6, 7, 2, 4, 0, 1]


def test_null_prefix_len() -> None:
    pool = BlockPool(6)
    null = pool.null_block
    a, b = pool.get_new_blocks(2)
    assert pool.null_prefix_len([]) == 0
    assert pool.null_prefix_len([a, null]) == 0
    assert pool.null_prefix_len([null, null, a, b]) == 2
    assert pool.null_prefix_len([null] * 5) == 5
    assert pool.null_prefix_len([null, a, null, b]) == 0  # not a clean prefix: no shortcut


def test_touch_and_free_skip_null_prefixes_and_count_free_hits() -> None:
    pool = BlockPool(8)
    blocks = pool.get_new_blocks(3)

    class Request:
        request_id = "r"
        all_token_ids = list(range(12))
        num_prompt_tokens = 12
        lora_name = None

        from speckv.hashing.extra_keys import NO_HASH_INPUTS as hash_inputs

    pool.cache_full_blocks(Request(), blocks, [b"a", b"b", b"c"], 0, 3, GroupInfo(0, 4, 0))
    pool.free_blocks(reversed(blocks))
    hit = [pool.null_block] * 4 + blocks
    assert pool.num_free_among(hit) == 3
    pool.touch(hit)
    assert pool.num_free_among(hit) == 0
    pool.check_integrity({block.block_id: 1 for block in blocks})
    pool.free_blocks(reversed(hit))
    pool.check_integrity()
    assert [b.block_id for b in pool.free_queue][-3:] == [b.block_id for b in reversed(blocks)]


def test_double_free_leaves_the_pool_consistent() -> None:
    pool = BlockPool(6)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks(None, [a], [b"h"], 0, 1, GroupInfo(0, 2, 0))  # type: ignore[arg-type]
    with pytest.raises(RuntimeError, match="double free"):
        pool.free_blocks([a, b, b])
    pool.check_integrity()  # both reached 0 and were queued before the error


@pytest.mark.parametrize("stride", [1, 2, 3, 5])
def test_strided_hashes_slices_equal_item_by_item(stride: int) -> None:
    chain = [bytes([i]) for i in range(23)]
    view = StridedHashes(chain, stride)
    items = [chain[(i + 1) * stride - 1] for i in range(len(chain) // stride)]
    assert len(view) == len(items) and list(view) == items
    for start in range(-3, 9):
        for stop in range(-3, 9):
            for step in (1, 2, -1):
                assert view[start:stop:step] == items[start:stop:step]
