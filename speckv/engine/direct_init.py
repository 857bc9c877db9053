"""`direct_init`: a cheaper `__init__` for the frozen dataclasses built per request per step.

Owns one class decorator. A frozen dataclass's generated `__init__` sets each field through
`object.__setattr__` (its own `__setattr__` refuses); for the messages the engine makes for
every request in every step (`ScheduledRequest`, `EngineCoreOutput`, `RequestOutput`) that is
a few microseconds each at batch 256. The replacement takes the same arguments and defaults and
writes the instance dict directly: the class stays frozen (assignment still raises), equal,
hashable and printable exactly as before. Fields with a default factory, `init=False` fields
and a `__post_init__` are refused (the fast init would skip them).
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING
from typing import Any, TypeVar

T = TypeVar("T")
_SELF, _DICT = "__direct_init_self", "__direct_init_dict"  # names no field may take


def direct_init(cls: type[T]) -> type[T]:
    """Replace the frozen dataclass `cls`'s `__init__` by one that fills `__dict__`."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" in cls.__dict__:
        raise TypeError(f"{cls.__name__}: direct_init is for frozen dataclasses without slots")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"{cls.__name__}: direct_init would skip its __post_init__")
    arguments: list[str] = []
    defaults: dict[str, Any] = {}
    body: list[str] = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.default_factory is not MISSING or not f.init:
            raise TypeError(f"{cls.__name__}.{f.name}: direct_init takes plain fields only")
        if f.kw_only and "*" not in arguments:
            arguments.append("*")  # keyword-only from here on, as the dataclass says
        if f.default is MISSING:
            arguments.append(f.name)
        else:
            defaults[f"_default_{f.name}"] = f.default
            arguments.append(f"{f.name}=_default_{f.name}")
        if f.name in (_SELF, _DICT):
            raise TypeError(f"{cls.__name__}.{f.name}: a field name the init uses itself")
        body.append(f"    {_DICT}[{f.name!r}] = {f.name}\n")
    source = (f"def __init__({_SELF}, {', '.join(arguments)}):\n"
              f"    {_DICT} = {_SELF}.__dict__\n{''.join(body)}")
    namespace: dict[str, Any] = {}
    exec(source, defaults, namespace)  # the source is built from field names only
    init = namespace["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init  # type: ignore[misc]
    return cls
