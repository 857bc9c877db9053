"""The per-step messages are built by keyword: a bare `False, 0` at a call site is unreadable."""

from __future__ import annotations

import pytest

from speckv.engine.messages import EngineCoreOutput, FinishReason, ScheduledRequest


def test_the_step_messages_refuse_positional_fields():
    with pytest.raises(TypeError):
        ScheduledRequest("r", 4, 2, (7,), ([1, 2],), False, 0, True)  # type: ignore[misc]
    with pytest.raises(TypeError):
        EngineCoreOutput("r", [5], FinishReason.STOP, 3)  # type: ignore[misc]


def test_the_step_messages_take_their_fields_by_name():
    item = ScheduledRequest(request_id="r", start=4, num_new_tokens=2, draft_token_ids=(7,),
                            new_block_ids=([1, 2],), replaces_block_table=False,
                            num_hit_tokens=0, samples=True)
    assert item.end == 6 and item.num_drafts == 1 and item.num_external_tokens == 0
    output = EngineCoreOutput(request_id="r", new_token_ids=[5],
                              finish_reason=FinishReason.STOP, num_cached_tokens=3)
    assert output.num_draft_tokens == 0 and output.error is None
