"""JSON <-> frozen dataclass conversion for the manifests and plan headers in `schemas/`.

A manifest is declared once as a tree of frozen dataclasses; this module turns it into the
plain dict ``json.dumps`` writes and back, checking every field against its annotation so a
reader gets a named error (file, field, expected type) instead of a ``KeyError`` deep in a
consumer. A field may carry ``metadata={"json": "class"}`` when its JSON key is not a
Python identifier.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from enum import Enum
from functools import cache
from typing import Any, TypeVar, Union

from packvlm.errors import UsageError

T = TypeVar("T")


class ManifestFormatError(UsageError, ValueError):
    """A JSON document does not have the shape its schema declares."""


def json_key(field: dataclasses.Field[Any]) -> str:
    return str(field.metadata.get("json", field.name))


def to_json(value: Any) -> Any:
    """Plain JSON-safe structure of a dataclass tree (tuples become lists)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {json_key(f): to_json(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {str(k): to_json(v) for k, v in value.items()}
    return value


@cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def from_json(cls: type[T], raw: Any, where: str = "") -> T:
    """Build ``cls`` from ``raw``, checking keys and types; ``where`` names the document."""
    return typing.cast(T, _convert(cls, raw, where or cls.__name__))


def _convert(tp: Any, raw: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return raw
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if raw is None and type(None) in options:
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return _convert(option, raw, where)
            except ManifestFormatError as exc:
                errors.append(str(exc))
        raise ManifestFormatError("; ".join(errors))
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return _dataclass(tp, raw, where)
    if isinstance(tp, type) and issubclass(tp, Enum):
        try:
            return tp(raw)
        except ValueError as exc:
            raise ManifestFormatError(f"{where}: {raw!r} is not one of {[m.value for m in tp]}") from exc
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(raw, list):
            raise ManifestFormatError(f"{where}: expected a list, got {type(raw).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_convert(args[0], v, f"{where}[{i}]") for i, v in enumerate(raw))
        if len(args) != len(raw):
            raise ManifestFormatError(f"{where}: expected {len(args)} items, got {len(raw)}")
        return tuple(_convert(a, v, f"{where}[{i}]") for i, (a, v) in enumerate(zip(args, raw)))
    if origin is dict:
        key_type, value_type = typing.get_args(tp)
        if not isinstance(raw, dict):
            raise ManifestFormatError(f"{where}: expected an object, got {type(raw).__name__}")
        return {_convert(key_type, k, where): _convert(value_type, v, f"{where}.{k}") for k, v in raw.items()}
    if tp is float and isinstance(raw, int) and not isinstance(raw, bool):
        return float(raw)
    if isinstance(tp, type) and isinstance(raw, tp) and not (tp is int and isinstance(raw, bool)):
        return raw
    raise ManifestFormatError(f"{where}: expected {getattr(tp, '__name__', tp)}, got {raw!r}")


def _dataclass(cls: type, raw: Any, where: str) -> Any:
    if not isinstance(raw, dict):
        raise ManifestFormatError(f"{where}: expected an object, got {type(raw).__name__}")
    hints = _hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        key = json_key(f)
        if key in raw:
            kwargs[f.name] = _convert(hints[f.name], raw[key], f"{where}.{key}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise ManifestFormatError(f"{where}: missing field {key!r}")
    return cls(**kwargs)
