"""NATS plumbing with DeadPool's policy: reconnect forever, validate every message, never crash on one.

A handler that raises is logged and the subscription goes on: one bad message or one bug in a handler
must not take a service down. Refused messages are logged at a bounded rate (`RefusalLog`). A message
larger than one frame's payload goes out in keyed parts and is put together before it is decoded
(`deadpool_protocol.message_parts`): no frame is larger than `MESSAGE_PART_BYTES_MAX`.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import nats
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from deadpool_protocol import Message, ProtocolError, decode_on, encode
from deadpool_protocol.codec import MESSAGE_BYTES_MAX
from deadpool_protocol.message_parts import ASSEMBLED_MESSAGE_BYTES_MAX, PART_HEADER, PartAssembler, split_message
from deadpool_protocol.names import content_digest
from deadpool_runtime import tls
from deadpool_runtime.log_limit import RefusalLog

__all__ = ["RECONNECT_WAIT_S", "connect", "publish", "server_urls", "subscribe_validated", "tls_options"]

RECONNECT_WAIT_S = 0.25
M = TypeVar("M", bound=Message)
REPEAT_CHECK_BYTES_MIN = 64 * 1024
"""A message this large is known again by its digest when it is sent again (`subscribe_validated`):
a rebuild of 2,000 ranks and more."""


def server_urls(url: str) -> list[str]:
    """The servers of a NATS URL list: `nats://a:4222,nats://b:4222,...` (a cluster) or one URL."""
    servers = [u.strip() for u in url.split(",") if u.strip()]
    if not servers:
        raise ValueError("no NATS server URL given")
    return servers


async def connect(url: str, name: str, log: Any, nkey_file: str = "", inbox_prefix: str = "_INBOX") -> Client:
    """Connect to NATS (any server of a comma-separated list); keeps reconnecting for ever, to any of
    them, if the server goes away (logged). With `nkey_file` (a seed file), the connection authenticates
    as that nkey's user and has the permissions the server gives it. Replies to its requests come to
    subjects under `inbox_prefix` (a member's: its job's, `Subjects.inbox`)."""

    async def on_disconnect() -> None:
        log.warning("nats disconnected")

    async def on_reconnect() -> None:
        log.info("nats reconnected")

    async def on_error(exc: Exception) -> None:
        log.warning("nats error", error=str(exc))

    return await nats.connect(
        servers=server_urls(url),
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=RECONNECT_WAIT_S,
        allow_reconnect=True,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
        error_cb=on_error,
        nkeys_seed=nkey_file or None,
        inbox_prefix=inbox_prefix,
        **tls_options(),
    )


def tls_options() -> dict[str, Any]:
    """`nats.connect`'s TLS options under this process's TLS setting (`deadpool_runtime.tls`): the
    handshake comes first, before the server says a word, so a server without TLS cannot talk a client
    down to plain text; {} when TLS is off."""
    context = tls.client_context(tls.from_env())
    return {} if context is None else {"tls": context, "tls_handshake_first": True}


async def publish(nc: Client, subject: str, message: Message) -> None:
    """Publish `message`, in keyed parts when it is larger than a part's payload."""
    for header, payload in split_message(encode(message)):
        await nc.publish(subject, payload, headers={PART_HEADER: header} if header else None)


async def subscribe_validated(
    nc: Client,
    subject: str,
    expected: type[M],
    handler: Callable[[M, Msg], Awaitable[None]],
    log: Any,
    queue: str = "",
) -> Subscription:
    """Subscribe; each message is decoded and validated before `handler` sees it.

    A message that fails validation is dropped with a log line giving the reason (rate-limited: a
    flood of them writes a few lines and a count). A message's parts are gathered first (one
    `PartAssembler` per subscription), and the whole is decoded once the last one arrives.

    A large message sent again (the swapper re-sends a rebuild every second until every rank acks it)
    is the same bytes: the message decoded the last time is handed on again, not decoded again (10 ms
    at 8,192 ranks, for every reader of every retransmission). It is known by its digest: the one its
    parts name, or its content's (`REPEAT_CHECK_BYTES_MIN` and up: 0.13 ms to digest that rebuild,
    against 10 ms to decode it).
    """
    refusals = RefusalLog(log)
    assembler = PartAssembler()
    last: list[tuple[tuple[str, str], M]] = []
    """The last large message decoded, by its subject and digest."""

    def decoded(subject: str, digest: str, data: bytes, bytes_max: int) -> M:
        if last and last[0][0] == (subject, digest):
            return last[0][1]
        message = decode_on(subject, data, expected, bytes_max)
        last[:] = [((subject, digest), message)]
        return message

    async def on_msg(msg: Msg) -> None:
        part = msg.headers.get(PART_HEADER) if msg.headers else None
        try:
            if part is not None:
                whole = assembler.add(part, msg.data, time.monotonic())
                if whole is None:
                    return
                digest = part.rsplit("/", 1)[-1]  # the digest its whole was checked against
                message = decoded(msg.subject, digest, whole, ASSEMBLED_MESSAGE_BYTES_MAX)
            elif len(msg.data) >= REPEAT_CHECK_BYTES_MIN:
                message = decoded(msg.subject, content_digest(msg.data), msg.data, MESSAGE_BYTES_MAX)
            else:
                message = decode_on(msg.subject, msg.data, expected)
        except ProtocolError as exc:
            refusals.warning("rejected message", subject=msg.subject, reason=str(exc))
            return
        try:
            await handler(message, msg)
        except Exception:
            log.exception("handler failed", subject=msg.subject, kind=expected.KIND)

    return await nc.subscribe(subject, queue=queue, cb=on_msg)
