"""Strict JSON → dataclass decoding: every wrong field is a TopologyError naming its path.

    codec.decode(list[NodeTopology], data["nodes"], "cluster.json: nodes")

Encoding is `dataclasses.asdict`: enums are `StrEnum`, so they serialise as their values.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from enum import Enum
from typing import Any

from orchestrator.errors import TopologyError

_FIX = "write the file with `archipelago topology --json FILE`, or fix this field by hand"


def decode(kind: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(kind)
    if origin in (types.UnionType, typing.Union):
        options = typing.get_args(kind)
        if value is None and type(None) in options:
            return None
        (inner,) = [option for option in options if option is not type(None)]
        return decode(inner, value, where)
    if origin is list:
        (item,) = typing.get_args(kind)
        _expect(isinstance(value, list), "a list", value, where)
        return [decode(item, element, f"{where}[{i}]") for i, element in enumerate(value)]
    if origin is dict:
        _, item = typing.get_args(kind)
        _expect(isinstance(value, dict), "an object", value, where)
        return {key: decode(item, element, f"{where}.{key}") for key, element in value.items()}
    if dataclasses.is_dataclass(kind):
        return _decode_dataclass(kind, value, where)
    if isinstance(kind, type) and issubclass(kind, Enum):
        choices = [member.value for member in kind]
        if value not in choices:
            raise TopologyError(f"{value!r} is not one of {', '.join(choices)}", where=where, fix=_FIX)
        return kind(value)
    if kind is float:
        _expect(isinstance(value, int | float) and not isinstance(value, bool), "a number", value, where)
        return float(value)
    if kind is int:
        _expect(isinstance(value, int) and not isinstance(value, bool), "a whole number", value, where)
        return value
    _expect(isinstance(value, kind), {str: "a string", bool: "true or false"}[kind], value, where)
    return value


def _decode_dataclass(kind: type, value: Any, where: str) -> Any:
    _expect(isinstance(value, dict), "an object", value, where)
    hints = typing.get_type_hints(kind)
    fields = {f.name: f for f in dataclasses.fields(kind) if f.init}
    for key in value:
        if key not in fields:
            raise TopologyError(f"unknown field {key!r}", where=where,
                                fix=f"{kind.__name__} has fields {', '.join(fields)}")
    arguments = {}
    for name, spec in fields.items():
        if name in value:
            arguments[name] = decode(hints[name], value[name], f"{where}.{name}")
        elif spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            raise TopologyError(f"missing field {name!r}", where=where, fix=_FIX)
    return kind(**arguments)


def _expect(ok: bool, what: str, value: Any, where: str) -> None:
    if not ok:
        raise TopologyError(f"expected {what}, got {type(value).__name__} {value!r:.40}", where=where, fix=_FIX)
