"""`direct_init` keeps a frozen dataclass's behaviour: same arguments and defaults, frozen,
equal and hashable as before; it refuses the classes whose init it would get wrong."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from speckv.engine.direct_init import direct_init
from speckv.engine.messages import EngineCoreOutput, FinishReason, ScheduledRequest
from speckv.engine.outputs import RequestOutput


@dataclasses.dataclass(frozen=True)
class _Plain:
    a: int
    b: list[int]
    c: str | None = None
    d: int = 3


_Fast = direct_init(dataclasses.make_dataclass(
    "_Fast", [("a", int), ("b", list), ("c", str | None, None), ("d", int, 3)], frozen=True))


def test_the_direct_init_builds_what_the_generated_one_builds():
    for args, kwargs in [((1, [2]), {}), ((1, [2], "x"), {"d": 7}), ((), {"a": 0, "b": []})]:
        plain, fast = _Plain(*args, **kwargs), _Fast(*args, **kwargs)
        assert dataclasses.asdict(plain) == dataclasses.asdict(fast)
        assert fast == _Fast(*args, **kwargs)
    assert hash(_Fast(1, (), "x")) == hash(_Fast(1, (), "x"))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        _Fast(1)  # a required argument missing, as before
    with pytest.raises(dataclasses.FrozenInstanceError):
        _Fast(1, [2]).a = 5


def test_the_step_messages_stay_frozen_and_round_trip():
    item = ScheduledRequest(request_id="r", start=4, num_new_tokens=2, draft_token_ids=(7,),
                            new_block_ids=([1, 2],), replaces_block_table=False,
                            num_hit_tokens=0, samples=True)
    assert item.end == 6 and item.num_external_tokens == 0
    output = EngineCoreOutput(request_id="r", new_token_ids=[5],
                              finish_reason=FinishReason.STOP, num_cached_tokens=3)
    assert output.num_draft_tokens == 0 and output.error is None
    request_output = RequestOutput("r", [1], [5], "a", [5], "a", 0, None, "stop")
    for message in (item, output, request_output):
        with pytest.raises(dataclasses.FrozenInstanceError):
            message.request_id = "other"  # type: ignore[misc]
        assert pickle.loads(pickle.dumps(message)) == message
        assert dataclasses.replace(message, request_id="x").request_id == "x"


def test_classes_it_would_get_wrong_are_refused():
    @dataclasses.dataclass(frozen=True)
    class WithPostInit:
        a: int

        def __post_init__(self) -> None: ...

    @dataclasses.dataclass(frozen=True)
    class WithFactory:
        a: list[int] = dataclasses.field(default_factory=list)

    @dataclasses.dataclass
    class NotFrozen:
        a: int

    for cls in (WithPostInit, WithFactory, NotFrozen):
        with pytest.raises(TypeError):
            direct_init(cls)


def test_the_step_messages_refuse_positional_fields():
    # a bare `False, 0` in a message is unreadable at the call site: keywords only
    with pytest.raises(TypeError):
        ScheduledRequest("r", 4, 2, (7,), ([1, 2],), False, 0, True)  # type: ignore[misc]
    with pytest.raises(TypeError):
        EngineCoreOutput("r", [5], FinishReason.STOP, 3)  # type: ignore[misc]
