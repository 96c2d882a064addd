"""Input types of kinds: the JSON Schema a manifest lists, and the decoding of an operation's
input into the kind's parameter (a dataclass, a pydantic model, a dict, or anything)."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import enum
import json
import types
import typing
from typing import Any

__all__ = ["InputError", "schema_of", "decode", "encode_json", "to_jsonable"]

_NoneType = type(None)


class InputError(Exception):
    """An input that does not fit the kind's input type; the message names the field."""


def _is_pydantic_model(tp: Any) -> bool:
    return isinstance(tp, type) and hasattr(tp, "model_validate") and hasattr(tp, "model_json_schema")


def _origin(tp: Any):
    return typing.get_origin(tp)


def _is_union(tp: Any) -> bool:
    o = _origin(tp)
    return o is typing.Union or (hasattr(types, "UnionType") and o is types.UnionType)


def _hints(cls: Any) -> dict:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # unresolvable forward references: take the raw annotations
        return dict(getattr(cls, "__annotations__", {}))


def schema_of(tp: Any) -> dict:
    """A JSON Schema (draft 2020-12) for the input type ``tp``."""
    if tp is None or tp is Any or tp is object or tp is typing.Any:
        return {}
    if _is_pydantic_model(tp):
        return tp.model_json_schema()
    return _schema(tp)


def _schema(tp: Any) -> dict:
    if tp is Any or tp is object:
        return {}
    if tp is _NoneType or tp is None:
        return {"type": "null"}
    if tp is str:
        return {"type": "string"}
    if tp is bool:
        return {"type": "boolean"}
    if tp is int:
        return {"type": "integer"}
    if tp is float:
        return {"type": "number"}
    if tp in (_dt.datetime,):
        return {"type": "string", "format": "date-time"}
    if tp is _dt.date:
        return {"type": "string", "format": "date"}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return {"enum": [m.value for m in tp]}
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        hints = _hints(tp)
        props, required = {}, []
        for f in dataclasses.fields(tp):
            if not f.init:
                continue
            s = dict(_schema(hints.get(f.name, Any)))
            if "description" in f.metadata:
                s["description"] = str(f.metadata["description"])
            if f.default is not dataclasses.MISSING:
                try:
                    json.dumps(f.default)
                    s["default"] = f.default
                except (TypeError, ValueError):
                    pass
            elif f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
                required.append(f.name)
            props[f.name] = s
        out = {"type": "object", "properties": props, "additionalProperties": False}
        if required:
            out["required"] = required
        doc = (tp.__doc__ or "").strip()
        if doc and not doc.startswith(tp.__name__ + "("):
            out["description"] = doc
        return out
    if _is_pydantic_model(tp):
        return {"type": "object"}
    if tp is dict:
        return {"type": "object"}
    if tp is list:
        return {"type": "array"}
    o = _origin(tp)
    args = typing.get_args(tp)
    if _is_union(tp):
        non_null = [a for a in args if a is not _NoneType]
        parts = [_schema(a) for a in non_null]
        if len(non_null) < len(args):
            parts.append({"type": "null"})
        return {"anyOf": parts}
    if o is typing.Literal:
        return {"enum": list(args)}
    if o in (list, typing.List, tuple, set, frozenset) or o is getattr(typing, "Sequence", None):
        if o is tuple and args and args[-1] is not Ellipsis:
            return {"type": "array", "prefixItems": [_schema(a) for a in args],
                    "minItems": len(args), "maxItems": len(args)}
        item = args[0] if args else Any
        return {"type": "array", "items": _schema(item)}
    if o in (dict, typing.Dict) or o is getattr(__import__("collections.abc").abc, "Mapping", None):
        val = args[1] if len(args) == 2 else Any
        s = {"type": "object"}
        vs = _schema(val)
        if vs:
            s["additionalProperties"] = vs
        return s
    return {}


def _kind_of(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, int):
        return "an integer"
    if isinstance(v, float):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    if isinstance(v, dict):
        return "an object"
    return type(v).__name__


def decode(tp: Any, value: Any, path: str = "input") -> Any:
    """``value`` (decoded JSON) as ``tp``; :class:`InputError` naming the field when it does
    not fit."""
    if tp is None or tp is Any or tp is object:
        return value
    if _is_pydantic_model(tp):
        try:
            return tp.model_validate(value)
        except Exception as e:  # pydantic.ValidationError
            errors = getattr(e, "errors", None)
            if callable(errors):
                try:
                    first = errors()[0]
                    loc = "".join(
                        f"[{p}]" if isinstance(p, int) else f".{p}" for p in first.get("loc", ())
                    )
                    raise InputError(f"{path}{loc}: {first.get('msg', 'invalid')}") from None
                except InputError:
                    raise
                except Exception:
                    pass
            raise InputError(f"{path}: {e}") from None
    return _decode(tp, value, path)


def _decode(tp: Any, v: Any, path: str) -> Any:
    if tp is Any or tp is object:
        return v
    if tp is _NoneType or tp is None:
        if v is not None:
            raise InputError(f"{path}: expected null, got {_kind_of(v)}")
        return None
    if tp is str:
        if not isinstance(v, str):
            raise InputError(f"{path}: expected a string, got {_kind_of(v)}")
        return v
    if tp is bool:
        if not isinstance(v, bool):
            raise InputError(f"{path}: expected a boolean, got {_kind_of(v)}")
        return v
    if tp is int:
        if isinstance(v, bool) or not isinstance(v, int):
            if isinstance(v, float) and v.is_integer():
                return int(v)
            raise InputError(f"{path}: expected an integer, got {_kind_of(v)}")
        return v
    if tp is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise InputError(f"{path}: expected a number, got {_kind_of(v)}")
        return float(v)
    if tp is _dt.datetime or tp is _dt.date:
        if not isinstance(v, str):
            raise InputError(f"{path}: expected a {'date-time' if tp is _dt.datetime else 'date'} string, got {_kind_of(v)}")
        try:
            return parse_datetime(v) if tp is _dt.datetime else _dt.date.fromisoformat(v)
        except ValueError:
            raise InputError(f"{path}: {v!r} is not an RFC 3339 {'date-time' if tp is _dt.datetime else 'date'}") from None
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        try:
            return tp(v)
        except ValueError:
            raise InputError(f"{path}: expected one of {[m.value for m in tp]}, got {v!r}") from None
    if _is_pydantic_model(tp):
        return decode(tp, v, path)
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if not isinstance(v, dict):
            raise InputError(f"{path}: expected an object, got {_kind_of(v)}")
        hints = _hints(tp)
        fields = [f for f in dataclasses.fields(tp) if f.init]
        names = {f.name for f in fields}
        for k in v:
            if k not in names:
                raise InputError(
                    f"{path}.{k}: unknown field (the fields are {', '.join(sorted(names)) or 'none'})"
                )
        kwargs = {}
        for f in fields:
            ftp = hints.get(f.name, Any)
            if f.name in v:
                kwargs[f.name] = _decode(ftp, v[f.name], f"{path}.{f.name}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:  # type: ignore[misc]
                s = _schema(ftp)
                what = {"string": "a string", "integer": "an integer", "number": "a number",
                        "boolean": "a boolean", "object": "an object", "array": "an array"}.get(
                    s.get("type", ""), "a value")
                raise InputError(f"{path}.{f.name}: missing ({what} is required)")
        return tp(**kwargs)
    if tp is dict:
        if not isinstance(v, dict):
            raise InputError(f"{path}: expected an object, got {_kind_of(v)}")
        return v
    if tp is list:
        if not isinstance(v, list):
            raise InputError(f"{path}: expected an array, got {_kind_of(v)}")
        return v
    o = _origin(tp)
    args = typing.get_args(tp)
    if _is_union(tp):
        if v is None and _NoneType in args:
            return None
        errors = []
        for a in args:
            if a is _NoneType:
                continue
            try:
                return _decode(a, v, path)
            except InputError as e:
                errors.append(str(e))
        if len(errors) == 1:
            raise InputError(errors[0])
        raise InputError(f"{path}: fits none of the allowed types, got {_kind_of(v)}")
    if o is typing.Literal:
        if v not in args:
            raise InputError(f"{path}: expected one of {list(args)!r}, got {v!r}")
        return v
    if o in (list, tuple, set, frozenset):
        if not isinstance(v, list):
            raise InputError(f"{path}: expected an array, got {_kind_of(v)}")
        if o is tuple and args and args[-1] is not Ellipsis:
            if len(v) != len(args):
                raise InputError(f"{path}: expected {len(args)} items, got {len(v)}")
            return tuple(_decode(a, x, f"{path}[{i}]") for i, (a, x) in enumerate(zip(args, v)))
        item = args[0] if args else Any
        items = [_decode(item, x, f"{path}[{i}]") for i, x in enumerate(v)]
        return o(items) if o is not list else items
    if o is dict:
        if not isinstance(v, dict):
            raise InputError(f"{path}: expected an object, got {_kind_of(v)}")
        val = args[1] if len(args) == 2 else Any
        return {k: _decode(val, x, f"{path}.{k}") for k, x in v.items()}
    return v


def parse_datetime(text: str) -> _dt.datetime:
    """An RFC 3339 timestamp (any number of fractional digits, ``Z`` or an offset), aware."""
    s = text.strip()
    if s.endswith(("Z", "z")):
        s = s[:-1] + "+00:00"
    # Python before 3.11 takes at most 6 fractional digits: cut the rest (chrono sends 9).
    if "." in s:
        head, _, rest = s.partition(".")
        digits = ""
        while rest and rest[0].isdigit():
            digits, rest = digits + rest[0], rest[1:]
        s = head + ("." + digits[:6].ljust(6, "0") if digits else "") + rest
    s = s.replace("t", "T") if "T" not in s else s
    d = _dt.datetime.fromisoformat(s)
    if d.tzinfo is None:
        d = d.replace(tzinfo=_dt.timezone.utc)
    return d


def to_jsonable(value: Any) -> Any:
    """``json.dumps``'s ``default``: dataclasses, pydantic models, datetimes, UUIDs, enums,
    sets and tuples."""
    if _is_pydantic_model(type(value)):
        return value.model_dump(mode="json")
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    if isinstance(value, (_dt.datetime, _dt.date)):
        return value.isoformat()
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    import uuid as _uuid

    if isinstance(value, _uuid.UUID):
        return str(value)
    if hasattr(value, "to_json") and callable(value.to_json):
        return value.to_json()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def encode_json(value: Any) -> bytes:
    """Compact JSON bytes (non-ASCII kept as UTF-8); ``TypeError``/``ValueError`` when
    ``value`` is not JSON (NaN included)."""
    return json.dumps(value, default=to_jsonable, separators=(",", ":"), ensure_ascii=False,
                      allow_nan=False).encode()
