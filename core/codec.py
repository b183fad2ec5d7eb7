"""Strict JSON → dataclass decoding: every wrong field is a TopologyError naming its path.

    data = codec.parse_json(text, error=TopologyError, where="cluster.json", fix="write it with …")
    fields = codec.check_header(data, format="archipelago.topology", version=1, noun="topology",
                                command="archipelago topology --json FILE", error=TopologyError, where="cluster.json")
    codec.decode(list[NodeTopology], fields["nodes"], "cluster.json: nodes")

Encoding is `dataclasses.asdict`: enums are `StrEnum`, so they serialise as their values.
Decoders are built once per type and cached, so a 1,024-node map loads in about a second.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import types
import typing
from collections.abc import Callable, Hashable
from enum import Enum
from typing import Any

from core.errors import ArchipelagoError, TopologyError

_FIX = "write the file with `archipelago topology --json FILE`, or fix this field by hand"
Decoder = Callable[[Any, str], Any]


def parse_json(text: str, *, error: type[ArchipelagoError], where: str, fix: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise error(f"not JSON: {e.msg} at line {e.lineno} column {e.colno}", where=where, fix=fix) from None


def check_header(data: object, *, format: str, version: int, noun: str, command: str,
                 error: type[ArchipelagoError], where: str) -> dict[str, Any]:
    """The fields of an archipelago JSON document after its "format" and "version", once those say
    it is a `format` document of `version`; `error` naming `where` and `command` otherwise."""
    if not isinstance(data, dict) or data.get("format") != format:
        raise error(f"not an archipelago {noun} (no \"format\": \"{format}\")", where=where,
                    fix=f"write it with `{command}`")
    if data.get("version") != version:
        raise error(f"{noun} version {data.get('version')!r}; this archipelago reads {version}",
                    where=f"{where}: version", fix=f"write it again with `{command}`")
    return {key: value for key, value in data.items() if key not in ("format", "version")}


def decode(kind: Any, value: Any, where: str) -> Any:
    return _decoder(kind)(value, where)


@functools.cache
def _decoder(kind: Any) -> Decoder:
    origin = typing.get_origin(kind)
    if origin in (types.UnionType, typing.Union):
        (inner,) = [option for option in typing.get_args(kind) if option is not type(None)]
        decode_inner = _decoder(inner)
        return lambda value, where: None if value is None else decode_inner(value, where)
    if origin is list:
        decode_item = _decoder(typing.get_args(kind)[0])

        def decode_list(value, where):
            _expect(isinstance(value, list), "a list", value, where)
            return [decode_item(element, f"{where}[{i}]") for i, element in enumerate(value)]
        return decode_list
    if origin is dict:
        decode_item = _decoder(typing.get_args(kind)[1])

        def decode_dict(value, where):
            _expect(isinstance(value, dict), "an object", value, where)
            return {key: decode_item(element, f"{where}.{key}") for key, element in value.items()}
        return decode_dict
    if dataclasses.is_dataclass(kind):
        return _dataclass_decoder(kind)
    if isinstance(kind, type) and issubclass(kind, Enum):
        return _enum_decoder(kind)
    return _scalar_decoder(kind)


def _dataclass_decoder(kind: type) -> Decoder:
    hints = typing.get_type_hints(kind)
    fields = [f for f in dataclasses.fields(kind) if f.init]
    decoders = {f.name: _decoder(hints[f.name]) for f in fields}
    required = [f.name for f in fields
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]

    def decode_dataclass(value, where):
        _expect(isinstance(value, dict), "an object", value, where)
        for key in value:
            if key not in decoders:
                raise TopologyError(f"unknown field {key!r}", where=where,
                                    fix=f"{kind.__name__} has fields {', '.join(decoders)}")
        for name in required:
            if name not in value:
                raise TopologyError(f"missing field {name!r}", where=where, fix=_FIX)
        return kind(**{name: decoders[name](element, f"{where}.{name}") for name, element in value.items()})
    return decode_dataclass


def _enum_decoder(kind: type[Enum]) -> Decoder:
    members = {member.value: member for member in kind}

    def decode_enum(value, where):
        if not isinstance(value, Hashable) or value not in members:  # a list or object is no member either
            raise TopologyError(f"{value!r:.40} is not one of {', '.join(map(str, members))}", where=where, fix=_FIX)
        return members[value]
    return decode_enum


def _scalar_decoder(kind: type) -> Decoder:
    if kind is float:
        def decode_float(value, where):
            _expect(type(value) in (int, float), "a number", value, where)
            return float(value)
        return decode_float
    expected = {int: "a whole number", str: "a string", bool: "true or false"}[kind]

    def decode_scalar(value, where):
        _expect(type(value) is kind, expected, value, where)  # `type is`: a bool is not an int here
        return value
    return decode_scalar


def _expect(ok: bool, what: str, value: Any, where: str) -> None:
    if not ok:
        raise TopologyError(f"expected {what}, got {type(value).__name__} {value!r:.40}", where=where, fix=_FIX)
