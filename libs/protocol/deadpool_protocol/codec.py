"""msgpack encoding of control-plane messages, validated on decode.

`decode` never trusts its input: it checks the protocol version, the kind, every field's type (from
the dataclass annotations, recursively; a number must be finite: a NaN time or step size poisons every
computation it enters), every field's size against its bound (`bounds`: a string, bytes, a list or a
map, each checked before anything is built from it) and the message's own `check()`. Anything wrong
raises `ProtocolError` with a reason fit for a log line, which names the field (and the bound it
broke) but never quotes more than a few characters of what was sent; callers log it and carry on.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import itertools
import math
import types
import typing
from collections.abc import Callable, Sized
from typing import Any, TypeVar

import msgpack

from deadpool_protocol.bounds import Bound, bound_of
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
    PlacementDelta,
    ProtocolError,
    Rebuild,
    RebuildAck,
    RebuildAckBatch,
    RebuildDelta,
    Replicate,
    Reserve,
    RunReply,
    RunStart,
    SnapshotComplete,
    SnapshotInterval,
    StepResumed,
    StepResumedBatch,
    StoreStatus,
    Straggler,
)
from deadpool_protocol.subjects import PREFIX, SERVICE_TOPICS, store_announce

__all__ = [
    "MESSAGE_BYTES_MAX",
    "PROTOCOL_VERSION",
    "decode",
    "decode_any",
    "decode_on",
    "encode",
    "from_fields",
    "shown",
    "subject_refusal",
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
        StepResumedBatch,
        SnapshotInterval,
        Straggler,
        GroupBroken,
        ChildExit,
        Failure,
        Rebuild,
        RebuildDelta,
        RebuildAck,
        RebuildAckBatch,
        Placement,
        PlacementDelta,
        Replicate,
        Reserve,
        RunStart,
        RunReply,
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


def to_fields(value: Any, omit_defaults: bool = False) -> Any:
    """A dataclass (recursively) as plain maps and lists that msgpack and JSON can carry. With
    `omit_defaults` (on the wire), less every field that holds its plain default: a receiver reads a
    missing field as its default (`from_fields`), so it means the same in fewer bytes and fewer
    checks. A heartbeat's usual fields (not waiting, no section, no skipped snapshot...) are left
    out: the detector decodes every beat of every member."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    defaults = _dataclass_defaults(kind)  # type: ignore[arg-type]  # classes are hashable
    if defaults is not None:
        fields = {}
        for name, default in defaults:
            field_value = getattr(value, name)
            if omit_defaults and (field_value is default or _same_scalar(field_value, default)):
                continue
            # A plain field is itself (most are): no call for it. An ack took 12 µs, now 6.7.
            fields[name] = field_value if type(field_value) in _PLAIN else to_fields(field_value, omit_defaults)
        return fields
    if kind is list or kind is tuple:
        if all(type(v) in _PLAIN for v in value):
            return list(value)  # a rank map, a member list: thousands of items, each as it is
        if all(type(v) is list for v in value) and all(type(x) in _PLAIN for v in value for x in v):
            return [list(v) for v in value]  # a placement: a list of stores per rank, in one pass
    if isinstance(value, list | tuple):
        return [to_fields(v, omit_defaults) for v in value]
    if isinstance(value, dict):
        return {k: to_fields(v, omit_defaults) for k, v in value.items()}
    return value


_PLAIN = frozenset({str, int, float, bool, bytes, type(None)})
"""Types `to_fields` carries as they are (not their subclasses: an enum member goes the long way)."""
_NO_DEFAULT = object()


@functools.cache
def _dataclass_defaults(kind: type) -> tuple[tuple[str, Any], ...] | None:
    """`_defaults` of a dataclass, None for any other type (known once per type, not asked per value)."""
    return _defaults(kind) if dataclasses.is_dataclass(kind) else None


@functools.cache
def _defaults(cls: type) -> tuple[tuple[str, Any], ...]:
    """Each field's name and plain default (`_NO_DEFAULT` for a field with none, or a factory's)."""
    return tuple(
        (f.name, f.default if f.default is not dataclasses.MISSING else _NO_DEFAULT) for f in dataclasses.fields(cls)
    )


def _same_scalar(value: Any, default: Any) -> bool:
    """Whether `value` equals a field's plain scalar default, of the same type (0 is not False)."""
    return type(value) is type(default) and type(default) in (int, str, float, bool, bytes) and value == default


def encode(message: Message) -> bytes:
    body = to_fields(message, omit_defaults=True)
    body["v"] = PROTOCOL_VERSION
    body["kind"] = message.KIND
    data: bytes = msgpack.packb(body, use_bin_type=True)
    return data


def decode(data: bytes, expected: type[M], bytes_max: int = MESSAGE_BYTES_MAX) -> M:
    """Decode one message that must be of type `expected` (of at most `bytes_max`: one frame's bound,
    or a message put together from parts, `message_parts`)."""
    message = decode_any(data, bytes_max)
    if not isinstance(message, expected):
        raise ProtocolError(f"expected a {expected.KIND} message, got {message.KIND}")
    return message


def subject_refusal(subject: str, message: Message) -> str:
    """Why `message` may not arrive on `subject` ('' if it may). A job's message is taken only on that
    job's own subjects, `deadpool.<job>.…`: the server lets a job's key publish there alone, and the
    payload names its job too. Without this check job J's key spoke for any job by naming it in the
    payload, on J's subjects: a hello for another job, answered with that job's token and seal key.
    Likewise a store's announcements and reports come on its own subjects only."""
    if isinstance(message, StoreStatus) and subject != store_announce(message.store):
        return f"store {message.store}'s announcement on {subject}: another store's subject"
    if isinstance(message, SnapshotComplete) and not subject.endswith(f".{message.store}"):
        return f"store {message.store}'s report on {subject}: another store's subject"
    kind = _subject_kind(subject)
    if kind is not None and not isinstance(message, kind):
        return f"a {message.KIND} on {subject}, where only {kind.KIND} events go"
    job = getattr(message, "job", None)
    if not isinstance(job, str) or not subject.startswith(PREFIX + "."):
        return ""
    owner = subject.split(".", 2)[1]
    if owner not in SERVICE_TOPICS and owner != job:
        return f"a message of job {job} on {subject}: another job's subject"
    return ""


_SUBJECT_KINDS: tuple[tuple[str, str], ...] = (
    ("member.hello", "member_hello"),
    ("member.heartbeat", "heartbeat"),
    ("member.error", "member_error"),
    ("member.done", "member_done"),
    ("member.ack", "rebuild_ack"),
    ("member.resumed", "step_resumed"),
    ("member.interval", "snapshot_interval"),
    ("launcher.run", "run_start"),
    ("launcher.exit", "child_exit"),
    ("launcher.heartbeats", "heartbeat_batch"),
    ("launcher.acks", "rebuild_ack_batch"),
    ("launcher.resumed", "step_resumed_batch"),
    ("launcher.*.ack", "rebuild_ack"),
    ("launcher.*.resumed", "step_resumed"),
    ("launcher.*.heartbeat", "heartbeat"),
    ("launcher.*.fence", "fence_request"),
    ("failure", "failure"),
    ("straggler", "straggler"),
    ("group.broken", "group_broken"),
    ("rebuild", "rebuild"),
    ("rebuild_delta", "rebuild_delta"),
    ("void", "generation_void"),
    ("placement", "placement"),
    ("placement_delta", "placement_delta"),
    ("commit", "commit"),
    ("finished", "job_finished"),
    ("incident", "incident"),
    ("snapshot.complete.*", "snapshot_complete"),
)
"""Each of a job's subjects (after `deadpool.<job>.`; `*` where a launcher's or a store's name goes)
and the one kind of message taken there (`Subjects`)."""
SUBJECTS_KNOWN_MAX = 4096
"""Subjects whose kind is remembered: a detector reads every job's batches on one subject per job,
and parsed each one's subject again (a twentieth of its CPU at 4,096 members)."""
_STORE_SUBJECT_KINDS = (("announce", "store_status"), ("replicate", "replicate"), ("reserve", "reserve"))
"""Each of a store's subjects (after `deadpool.store.<store>.`) and its one kind."""


@functools.cache
def _subject_kinds(of_store: bool) -> tuple[tuple[tuple[str, ...], type[Message]], ...]:
    table = _STORE_SUBJECT_KINDS if of_store else _SUBJECT_KINDS
    return tuple((tuple(topic.split(".")), _KINDS[kind]) for topic, kind in table)


@functools.lru_cache(maxsize=SUBJECTS_KNOWN_MAX)
def _subject_kind(subject: str) -> type[Message] | None:
    """The one kind of message `subject` carries, if it is one of DeadPool's (see `_SUBJECT_KINDS`): a
    job's key may publish on its job's report subjects, and a verdict sent there was still a verdict
    to a reader that took any kind."""
    tokens = subject.split(".")
    if len(tokens) < 3 or tokens[0] != PREFIX:
        return None
    of_store = tokens[1] == "store"
    rest = tokens[3:] if of_store else tokens[2:]
    for topic, kind in _subject_kinds(of_store):
        if len(rest) == len(topic) and all(t in ("*", r) for t, r in zip(topic, rest, strict=True)):
            return kind
    return None


def decode_on(subject: str, data: bytes, expected: type[M], bytes_max: int = MESSAGE_BYTES_MAX) -> M:
    """Decode one message of type `expected` that arrived on `subject`, and check that it may arrive
    there (`subject_refusal`)."""
    message = decode(data, expected, bytes_max)
    refused = subject_refusal(subject, message)
    if refused:
        raise ProtocolError(refused)
    return message


def decode_any(data: bytes, bytes_max: int = MESSAGE_BYTES_MAX) -> Message:
    if len(data) > bytes_max:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {bytes_max}")
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types on garbage
        raise ProtocolError(f"not msgpack: {exc.__class__.__name__}: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"message is a {type(body).__name__}, not a map")
    version = body.pop("v", None)
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"unsupported protocol version {shown(version)} (this side speaks {PROTOCOL_VERSION})")
    kind = body.pop("kind", None)
    cls = _KINDS.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ProtocolError(f"unknown message kind {shown(kind)}")
    message = from_fields(cls, body, kind)
    message.check()
    return message


SHOWN_CHARS_MAX = 64
"""How much of a value that was refused a reason quotes."""
ENUM_CHARS_MAX = 64
"""The longest value of a `StrEnum` field looked up (every value is a short word)."""


def shown(value: Any) -> str:
    """`value` as a refusal quotes it: its repr, cut short (a hostile peer chooses its size)."""
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS_MAX else f"{text[:SHOWN_CHARS_MAX]}..."


D = TypeVar("D")


def from_fields(cls: type[D], body: Any, where: str) -> D:
    """Build dataclass `cls` from a decoded map, checking every field's type and bound."""
    decoder: Callable[[Any, str], D] = _decoder(cls)  # type: ignore[arg-type]  # classes are hashable
    return decoder(body, where)


def _field_value(f: _Field, value: Any, where: str) -> Any:
    """Field `f`'s `value`, checked: every case, in the order `_decoder`'s fast paths take them."""
    kind = type(value)
    if f.named is not None and (kind is str or value is None) and value in f.named:
        return f.named[value]  # a StrEnum's value (or None where the field may be None)
    if f.items is not None and kind is list:
        return _checked_list(value, f.items, f"{where}.{f.name}")
    if f.nested is not None and kind is dict:
        return from_fields(f.nested, value, f"{where}.{f.name}")
    if value is None and f.nullable:
        return None
    if f.scalar is not None and kind is f.scalar:
        if f.most >= 0:
            if len(value) <= f.most and (f.counted or value.isascii()):
                return value  # within its bound for sure (a str bounded in UTF-8 bytes that is not
                # ASCII is measured by `_check_type`)
        elif kind is not float or math.isfinite(value):
            return value
    if f.scalar is float and kind is int:
        return float(value)
    return _check_type(value, f.hint, f"{where}.{f.name}")  # refused with the precise reason (or measured)


@functools.cache
def _decoder(cls: type) -> Callable[[Any, str], Any]:
    """A function that builds `cls` from a decoded map: `_field_value` for each field, with its common
    case (a str within its bound, an int, a finite float, an enum's value) written inline.

    Generated once per class, as `dataclasses` writes `__init__`: the detector decodes every beat of
    every member (14 fields each), and a loop over a plan of the fields spent half a microsecond on
    each, three times what the check itself costs. Any value the inline test does not pass goes to
    `_field_value`, so the two cannot disagree on what is accepted.
    """
    plan, required = _plan(cls)
    assert not any(f.kw_only or not f.init for f in dataclasses.fields(cls)), f"{cls.__name__}: every field by position"
    env: dict[str, Any] = {
        "_cls": cls,
        "_field_value": _field_value,
        "_checked_list": _checked_list,
        "_from_fields": from_fields,
        "_isfinite": math.isfinite,
        "_missing": _MISSING,
        "_unknown": _unknown_fields,
        "ProtocolError": ProtocolError,
    }
    lines = [
        "def decode(body, where):",
        "    if not isinstance(body, dict):",
        "        raise ProtocolError(f'{where}: expected a map, got {type(body).__name__}')",
        "    get = body.get",
        "    present = 0",
    ]
    args = []
    for i, (f, declared) in enumerate(zip(plan.values(), dataclasses.fields(cls), strict=True)):
        v = f"v{i}"
        env[f"F{i}"] = f
        lines += [f"    {v} = get({f.name!r}, _missing)", f"    if {v} is _missing:"]
        if f.name in required:
            lines.append(f"        raise ProtocolError(where + {': missing field ' + repr(f.name)!r})")
        elif declared.default is not dataclasses.MISSING:
            env[f"D{i}"] = declared.default
            lines.append(f"        {v} = D{i}")
        else:
            env[f"D{i}"] = declared.default_factory
            lines.append(f"        {v} = D{i}()")
        lines += ["    else:", "        present += 1"]
        fast, taken = _fast_path(f, v, i, env)
        checked = f"{v} = _field_value(F{i}, {v}, where)"
        lines += (
            [f"        if {fast}:", f"            {taken}", "        else:", f"            {checked}"]
            if fast
            else [f"        {checked}"]
        )
        args.append(v)  # in the fields' order: `__init__`'s, no field being keyword-only
    lines += [
        "    if present != len(body):",
        "        raise ProtocolError(f'{where}: unknown fields {_unknown(body, F_names)}')",
        f"    return _cls({', '.join(args)})",
    ]
    env["F_names"] = frozenset(plan)
    exec("\n".join(lines), env)  # our own source, from the class's annotations
    decoder: Callable[[Any, str], Any] = env["decode"]
    return decoder


_MISSING = object()


def _fast_path(f: _Field, v: str, i: int, env: dict[str, Any]) -> tuple[str, str]:
    """The inline test of field `f`'s common case (on local `v`), and what it does when it passes
    ('' for a field that always goes to `_field_value`)."""
    if f.named is not None:
        env[f"N{i}"] = f.named
        return f"(type({v}) is str or {v} is None) and {v} in N{i}", f"{v} = N{i}[{v}]"
    if f.items is not None:
        # An empty list is within any bound, and a plain one within its bound is checked in one call:
        # a launcher's batch has four lists, two or three of them empty, 8,200 batches a second.
        env[f"I{i}"] = f.items
        checked = f"_checked_list({v}, I{i}, where + {'.' + f.name!r})"
        bound, plain = f.items.bound, f.items.plain
        if bound is not None and plain is not None:
            env[f"P{i}"] = plain
            checked = f"list({v}) if len({v}) <= {bound.most} and P{i}({v}) else {checked}"
        return f"type({v}) is list", f"{v} = ({checked}) if {v} else []"
    if f.nested is not None:
        env[f"C{i}"] = f.nested
        return f"type({v}) is dict", f"{v} = _from_fields(C{i}, {v}, where + {'.' + f.name!r})"
    if f.scalar is None:
        return "", ""
    env[f"S{i}"] = f.scalar
    test = f"type({v}) is S{i}"
    if f.most >= 0:
        test += f" and len({v}) <= {f.most}" + ("" if f.counted else f" and {v}.isascii()")
    elif f.scalar is float:
        test += f" and _isfinite({v})"
    return f"{v} is None or {test}" if f.nullable else test, "pass"


def _unknown_fields(body: dict[Any, Any], names: frozenset[str]) -> str:
    return shown(sorted((k for k in body if k not in names), key=str)[:8])


_SCALARS: tuple[type, ...] = (int, str, float, bool, bytes)


class _Items(typing.NamedTuple):
    """A list field's items, resolved once (`_checked_list`)."""

    bound: Bound | None
    hint: Any
    """The items' type."""
    item_class: type | None
    """Their dataclass, where they are one."""
    plain: Callable[[list[Any]], bool] | None
    """The one-pass check of the whole list, where there is one (`_plain_check`)."""


class _Field(typing.NamedTuple):
    """How `from_fields` checks one field of a class, resolved once (`_plan`)."""

    name: str
    hint: Any
    scalar: type | None
    """The exact scalar type, or None."""
    most: int
    """The most a str or bytes of it may hold (-1 for other scalars)."""
    counted: bool
    """Whether `len()` measures that (not for a str bounded in UTF-8 bytes)."""
    named: dict[Any, Any] | None
    """A `StrEnum` field's members by value (None among them where the field may be None)."""
    items: _Items | None
    """A list field's items."""
    nested: type | None
    """A field that is a dataclass (unbounded, not optional): its class."""
    nullable: bool
    """An `int | None`, `float | None` or `bool | None` field (`scalar` says which): a rebuild ack's
    marks are six of them, and each took the generic type walk."""


@functools.cache
def _plan(cls: type) -> tuple[dict[str, _Field], tuple[str, ...]]:
    """Each field's `_Field` by name, and the names of the fields without a default."""
    hints = typing.get_type_hints(cls, include_extras=True)
    plan = {}
    required = []
    for f in dataclasses.fields(cls):
        hint = hints[f.name]
        base, bound = bound_of(hint)
        named = _named(base)
        nullable = False
        if bound is None and typing.get_origin(base) in (typing.Union, types.UnionType):
            options = [o for o in typing.get_args(base) if o is not type(None)]
            if len(options) == 1 and len(typing.get_args(base)) == 2 and options[0] in (int, float, bool):
                base, nullable = options[0], True
        scalar = base if base in _SCALARS else None
        most = bound.most if bound is not None and scalar in (str, bytes) else -1
        counted = scalar is bytes or (bound is not None and bound.unit != "bytes")
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
        nested = base if bound is None and isinstance(base, type) and dataclasses.is_dataclass(base) else None
        plan[f.name] = _Field(f.name, hint, scalar, most, counted, named, _items(hint), nested, nullable)
    return plan, tuple(required)


def _items(hint: Any) -> _Items | None:
    """A list field's `_Items`, resolved once (None for any other field)."""
    base, bound, kind = _resolved(hint)
    if kind is not list:
        return None
    (item,) = typing.get_args(base)
    item_class = item if isinstance(item, type) and dataclasses.is_dataclass(item) else None
    return _Items(bound, item, item_class, _plain_check(item))


def _checked_list(value: list[Any], items: _Items, where: str) -> list[Any]:
    """A list field's value checked as `_check_type` checks it, less the type resolution it does on
    every call: a batch of heartbeats is a list of dataclasses, decoded for every host 4 times a
    second."""
    bound, item, item_class, plain = items
    if bound is not None:
        excess = bound.excess(value)
        if excess:
            raise ProtocolError(f"{where}: {excess}")
    if plain is not None and plain(value):
        return list(value)
    if item_class is not None:
        return [from_fields(item_class, v, f"{where}[{i}]") for i, v in enumerate(value)]
    return [_check_type(v, item, f"{where}[{i}]") for i, v in enumerate(value)]


def _named(hint: Any) -> dict[Any, Any] | None:
    """A `StrEnum` type's members by value (with None for `StrEnum | None`), else None."""
    options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    enums = [o for o in options if isinstance(o, type) and issubclass(o, enum.StrEnum)]
    if len(enums) != 1 or any(o is not enums[0] and o is not type(None) for o in options):
        return None
    named: dict[Any, Any] = {member.value: member for member in enums[0]}
    return named | {None: None} if type(None) in options else named


def _check_type(value: Any, hint: Any, where: str) -> Any:
    """`value` checked against type `hint` and its bound, recursively; raises ProtocolError. A value's
    size is checked before anything is built from it (a list's length before its items)."""
    base, bound, kind = _resolved(hint)
    if bound is not None and type(value) is kind:  # a str, bytes, list or dict
        excess = bound.excess(typing.cast(Sized, value))
        if excess:
            raise ProtocolError(f"{where}: {excess}")
    return _check_base(value, base, where)


@functools.cache
def _resolved(hint: Any) -> tuple[Any, Bound | None, type]:
    """The type under `hint`'s annotations, its bound (see `bounds.bound_of`) and the Python type a
    value of it has (`list` for `list[str]`)."""
    base, bound = bound_of(hint)
    return base, bound, typing.get_origin(base) or base


def _plain_items(values: list[Any], hint: Any) -> bool:
    """Whether every item of `values` is, at a glance, a valid `hint` (see `_plain_check`)."""
    plain = _plain_check(hint)
    return plain is not None and plain(values)


@functools.cache
def _plain_check(hint: Any) -> Callable[[list[Any]], bool] | None:
    """A check, in one pass, that every item of a list is at a glance a valid `hint`: an int, a bool, a
    str within its bound in characters, or a list of those within its bound (a rebuild's placement: a
    list of stores per rank). A list of thousands (a store's sealed ranks, a rebuild's members) is
    checked so; any other list, or one with an item that is not, is checked item by item (which says
    which item is wrong). None where `hint` has no such check."""
    base, bound, kind = _resolved(hint)
    if base is int:
        return lambda values: all(type(v) is int for v in values)
    if base is bool:  # a launcher's batch says each named member's waiting bit (`HeartbeatBatch`)
        return lambda values: all(type(v) is bool for v in values)
    if bound is None or bound.unit == "bytes":
        return None
    most = bound.most
    if base is str:
        return lambda values: all(type(v) is str and len(v) <= most for v in values)
    inner = _plain_check(typing.get_args(base)[0]) if kind is list else None
    if inner is None:
        return None
    # Each inner check is a conjunction over its items, so the lists' items are checked in one call
    # over them all (a rebuild's placement: 16,384 lists of stores, not 16,384 calls).
    return lambda values: (
        all(type(v) is list and len(v) <= most for v in values) and inner(list(itertools.chain.from_iterable(values)))
    )


def _check_base(value: Any, hint: Any, where: str) -> Any:
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
        if _plain_items(value, item):
            return list(value)
        return [_check_type(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected a map, got {type(value).__name__}")
        key_t, val_t = typing.get_args(hint)
        return {
            _check_type(k, key_t, f"{where}.<key>"): _check_type(v, val_t, f"{where}[{shown(k)}]")
            for k, v in value.items()
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
    if isinstance(hint, type) and issubclass(hint, enum.StrEnum):
        if not isinstance(value, str):
            raise ProtocolError(f"{where}: expected a {hint.__name__}, got {type(value).__name__}")
        member = hint._value2member_map_.get(value) if len(value) <= ENUM_CHARS_MAX else None
        if member is None:
            raise ProtocolError(f"{where}: {shown(value)} is not a {hint.__name__}")
        return member
    raise TypeError(f"{where}: the codec does not know type {hint!r}")  # a bug in messages.py
