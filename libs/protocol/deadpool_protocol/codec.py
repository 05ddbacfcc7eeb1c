"""msgpack encoding of control-plane messages, validated on decode.

`decode` never trusts its input: it checks the protocol version, the kind, every field's type (from
the dataclass annotations, recursively; a number must be finite: a NaN time or step size poisons every
computation it enters) and the message's own `check()`. Anything wrong raises
`ProtocolError` with a reason fit for a log line; callers log it and carry on.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import types
import typing
from typing import Any, TypeVar

import msgpack

from deadpool_protocol.messages import (
    ChildExit,
    Commit,
    Failure,
    FenceReply,
    FenceRequest,
    GenerationVoid,
    GroupBroken,
    Heartbeat,
    HeartbeatBatch,
    HelloReply,
    Incident,
    JobFinished,
    MemberDone,
    MemberError,
    MemberHello,
    Message,
    Placement,
    ProtocolError,
    Rebuild,
    RebuildAck,
    Replicate,
    SnapshotComplete,
    StepResumed,
    StoreStatus,
    Straggler,
)

__all__ = [
    "MESSAGE_BYTES_MAX",
    "PROTOCOL_VERSION",
    "decode",
    "decode_any",
    "encode",
    "from_fields",
    "to_fields",
]

PROTOCOL_VERSION = 1
MESSAGE_BYTES_MAX = 1024 * 1024
"""NATS' default max payload; a bigger control message is a bug or an attack."""

M = TypeVar("M", bound=Message)

_KINDS: dict[str, type[Message]] = {
    cls.KIND: cls
    for cls in (
        MemberHello,
        HelloReply,
        Heartbeat,
        HeartbeatBatch,
        MemberError,
        MemberDone,
        StepResumed,
        Straggler,
        GroupBroken,
        ChildExit,
        Failure,
        Rebuild,
        RebuildAck,
        Placement,
        Replicate,
        FenceRequest,
        FenceReply,
        GenerationVoid,
        SnapshotComplete,
        Commit,
        JobFinished,
        Incident,
        StoreStatus,
    )
}


def to_fields(value: Any) -> Any:
    """A dataclass (recursively) as plain maps and lists that msgpack and JSON can carry."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_fields(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, list | tuple):
        return [to_fields(v) for v in value]
    if isinstance(value, dict):
        return {k: to_fields(v) for k, v in value.items()}
    return value


def encode(message: Message) -> bytes:
    body = to_fields(message)
    body["v"] = PROTOCOL_VERSION
    body["kind"] = message.KIND
    data: bytes = msgpack.packb(body, use_bin_type=True)
    return data


def decode(data: bytes, expected: type[M]) -> M:
    """Decode one message that must be of type `expected`."""
    message = decode_any(data)
    if not isinstance(message, expected):
        raise ProtocolError(f"expected a {expected.KIND} message, got {message.KIND}")
    return message


def decode_any(data: bytes) -> Message:
    if len(data) > MESSAGE_BYTES_MAX:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MESSAGE_BYTES_MAX}")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"not msgpack: {exc.__class__.__name__}: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"message is a {type(body).__name__}, not a map")
    version = body.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {version!r} (this side speaks {PROTOCOL_VERSION})")
    kind = body.pop("kind", None)
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {kind!r}")
    message = from_fields(cls, body, kind)
    message.check()
    return message


D = TypeVar("D")


def from_fields(cls: type[D], body: Any, where: str) -> D:
    """Build dataclass `cls` from a decoded map, checking every field's type.

    Scalar fields are checked inline, against a per-class plan built once: the detector decodes
    every heartbeat of every member, and the generic path cost most of its CPU.
    """
    if not isinstance(body, dict):
        raise ProtocolError(f"{where}: expected a map, got {type(body).__name__}")
    plan, names = _plan(cls)  # type: ignore[arg-type]  # classes are hashable
    values: dict[str, Any] = {}
    for name, hint, scalar, required in plan:
        if name in body:
            value = body[name]
            kind = type(value)
            if scalar is None:
                values[name] = _check_type(value, hint, f"{where}.{name}")
            elif kind is scalar and (kind is not float or math.isfinite(value)):
                values[name] = value
            elif scalar is float and kind is int:
                values[name] = float(value)
            else:
                values[name] = _check_type(value, hint, f"{where}.{name}")  # raises with the precise reason
        elif required:
            raise ProtocolError(f"{where}: missing field {name!r}")
    if len(body) > len(values):
        unknown = set(body) - names
        if unknown:
            raise ProtocolError(f"{where}: unknown fields {sorted(unknown)}")
    return cls(**values)


_SCALARS: tuple[type, ...] = (int, str, float, bool, bytes)


@functools.cache
def _plan(cls: type) -> tuple[list[tuple[str, Any, type | None, bool]], frozenset[str]]:
    """(name, hint, the exact scalar type or None, required) per field, and the field names."""
    hints = typing.get_type_hints(cls)
    plan = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        scalar = hint if hint in _SCALARS else None
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        plan.append((f.name, hint, scalar, required))
    return plan, frozenset(f.name for f in dataclasses.fields(cls))


def _check_type(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ProtocolError(f"{where}: expected a number, got {type(value).__name__}")
        if not math.isfinite(value):
            raise ProtocolError(f"{where}: {value} is not a finite number")
        return float(value)
    if hint in (int, str, bytes, bool):
        if isinstance(value, bool) and hint is int:
            raise ProtocolError(f"{where}: expected an int, got a bool")
        if not isinstance(value, hint):
            raise ProtocolError(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ProtocolError(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(hint)
        return [_check_type(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected a map, got {type(value).__name__}")
        key_t, val_t = typing.get_args(hint)
        return {
            _check_type(k, key_t, f"{where}.<key>"): _check_type(v, val_t, f"{where}[{k!r}]") for k, v in value.items()
        }
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            if option is type(None) and value is None:
                return None
            if option is not type(None):
                try:
                    return _check_type(value, option, where)
                except ProtocolError:
                    continue
        raise ProtocolError(f"{where}: {type(value).__name__} matches none of {hint}")
    if dataclasses.is_dataclass(hint):
        return from_fields(typing.cast(type, hint), value, where)
    raise TypeError(f"{where}: the codec does not know type {hint!r}")  # a bug in messages.py
