"""The generated decoders (`codec._decoder`) accept, refuse and build exactly what the plain walk of
a class's fields does with `codec._field_value`: their inline fast paths are only a shortcut."""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack
from hypothesis import HealthCheck, given, settings

from deadpool_protocol.codec import _KINDS, _field_value, _plan, from_fields
from deadpool_protocol.dataplane import _OPS
from deadpool_protocol.messages import ProtocolError
from tests.unit.fuzz_properties import frame_bodies, message_bodies

CI = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
ENVELOPE = ("v", "kind", "op")


def walked(cls: type, body: Any, where: str) -> Any:
    """What `from_fields` must give: each field in the class's order through `_field_value`, a
    missing field refused where it comes, unknown fields after."""
    if not isinstance(body, dict):
        raise ProtocolError(f"{where}: expected a map, got {type(body).__name__}")
    plan, required = _plan(cls)
    values = {}
    for name, f in plan.items():
        if name in body:
            values[name] = _field_value(f, body[name], where)
        elif name in required:
            raise ProtocolError(f"{where}: missing field {name!r}")
    if set(body) - set(plan):
        raise ProtocolError(f"{where}: unknown fields")
    return cls(**values)


def outcome(build: Any, cls: type, body: Any) -> tuple[str, Any]:
    try:
        return "built", build(cls, body, "here")
    except ProtocolError as exc:
        return "refused", str(exc).split(" [", 1)[0]  # the unknown names' list is the decoder's alone


def same_outcome(data: bytes, classes: dict[str, type]) -> None:
    body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    kind = body.get("kind", body.get("op"))
    cls = classes.get(kind) if isinstance(kind, str) else None
    if cls is None:
        return
    fields = {k: v for k, v in body.items() if k not in ENVELOPE}
    generated, plain = outcome(from_fields, cls, fields), outcome(walked, cls, fields)
    assert generated[0] == plain[0], (generated, plain)
    if generated[0] == "built":
        assert generated[1] == plain[1]
        assert all(
            type(getattr(generated[1], f.name)) is type(getattr(plain[1], f.name))  # 1 is not 1.0
            for f in dataclasses.fields(cls)
        )
    else:
        assert generated[1].startswith(plain[1]), (generated[1], plain[1])


@CI
@given(message_bodies())
def test_a_messages_generated_decoder_agrees_with_the_walk_of_its_fields(data: bytes) -> None:
    same_outcome(data, dict(_KINDS))


@CI
@given(frame_bodies())
def test_a_frames_generated_decoder_agrees_with_the_walk_of_its_fields(data: bytes) -> None:
    same_outcome(data, dict(_OPS))
