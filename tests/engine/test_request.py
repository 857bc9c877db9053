"""Request lifecycle on the scheduler side: validation, drafts never hashed, verification."""

from __future__ import annotations

import pytest

from speckv.cache import FullAttentionSpec, KVCacheManager, MambaSpec
from speckv.cache.hash_mode import HashMode
from speckv.engine.request import Request, RequestStatus
from speckv.hashing.formats import format_for
from speckv.hashing.functions import get_hash_algo, make_none_hash
from speckv.hashing.request_hasher import hash_prompt

ALGO = get_hash_algo("sha256")
NONE_HASH = make_none_hash(ALGO, "0")
# a hybrid manager: attention groups hash with L = 1, the Mamba group with L = 0
HASHING = KVCacheManager([FullAttentionSpec(2), MambaSpec(2)], 16, HashMode.for_lookahead(1)
                         ).block_hashing("sha256", "0")


def test_bad_prompts_are_rejected_clearly():
    with pytest.raises(ValueError, match="prompt is empty"):
        Request("a", [], HASHING)
    with pytest.raises(ValueError, match=r"prompt\[1\] = 99 is outside the vocabulary"):
        Request("a", [1, 99], HASHING, vocab_size=50)
    with pytest.raises(ValueError, match="not an integer"):
        Request("a", [1, "x"], HASHING)
    with pytest.raises(ValueError, match="max_tokens"):
        Request("a", [1], HASHING, max_tokens=0)


def test_drafts_are_not_hashed_and_verification_appends_real_tokens():
    request = Request("a", [1, 2, 3], HASHING, max_tokens=10)
    assert len(request.get_block_hashes(0)) == 1
    assert len(request.get_block_hashes(1)) == 1
    request.num_computed_tokens = 3
    request.append_output_token_ids([4])
    request.spec_token_ids = [5, 6, 7]
    assert len(request.get_block_hashes(1)) == 1  # [2, 4) waits for token 4
    request.num_computed_tokens += 4
    rejected = request.apply_verification(3, [5, 9])
    assert rejected == 2
    assert request.all_token_ids == [1, 2, 3, 4, 5, 9]
    assert request.num_computed_tokens == 5
    assert request.spec_token_ids == []
    assert request.get_block_hashes(1) == hash_prompt(ALGO, NONE_HASH, 2, format_for(1),
                                                      [1, 2, 3, 4, 5, 9])


def test_verification_rejects_impossible_acceptance():
    request = Request("a", [1, 2], HASHING)
    with pytest.raises(ValueError, match="only 1 scheduled"):
        request.apply_verification(1, [1, 2, 3])


def test_preempt_resets_computed_state():
    request = Request("a", [1, 2, 3], HASHING)
    request.num_computed_tokens = 3
    request.spec_token_ids = [1]
    request.preempt()
    assert (request.num_computed_tokens, request.spec_token_ids) == (0, [])
    assert request.status is RequestStatus.PREEMPTED and request.num_preemptions == 1
