"""Exactly one swapper leads: a lease in JetStream KV, taken and renewed with compare-and-set.

The leader writes its id under one key every `renew_s` with `update(last=its revision)`. A standby
reads the key every `poll_s`; once it has seen the same revision for `ttl_s` by its own clock, the
leader has not renewed for that long, and the standby takes over with `update(last=that revision)`:
if the leader renewed meanwhile, or another standby was faster, the server refuses it. Only intervals
measured on one host's monotonic clock are compared, never wall clocks of two hosts.

The leader counts itself leader only while its last successful renewal *began* less than
`valid_fraction * ttl_s` ago, so it stops acting before any standby can start, even when its renewals
are lost (a KV leader election, a partition). Everything the leader writes to a job record also
carries a revision check, so a stale leader's write is refused, never merged.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import msgpack
import nats.errors
from nats.js.api import KeyValueConfig
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from deadpool_runtime import stopped_within
from deadpool_runtime.log_limit import RefusalLog

__all__ = ["LEASE_BUCKET", "LeaderLease", "LeaseConfig"]

T = TypeVar("T")
LEASE_BUCKET = "deadpool-swapper-lease"
LEASE_KEY = "leader"


@dataclass(frozen=True)
class LeaseConfig:
    ttl_s: float = 1.0
    """A lease not renewed for this long may be taken over."""
    renew_s: float = 0.2
    poll_s: float = 0.1
    """How often a standby reads the lease."""
    valid_fraction: float = 0.75
    """The leader stops counting itself leader this fraction of `ttl_s` after its last renewal began."""

    def __post_init__(self) -> None:
        if not 0 < self.renew_s < self.valid_fraction * self.ttl_s:
            raise ValueError("renew_s must be positive and well below valid_fraction * ttl_s")
        if not 0 < self.poll_s < self.ttl_s or not 0 < self.valid_fraction < 1:
            raise ValueError("poll_s must be below ttl_s and valid_fraction between 0 and 1")


class LeaderLease:
    def __init__(self, kv: KeyValue, holder: str, config: LeaseConfig, log: Any) -> None:
        self.kv = kv
        self.holder = holder
        self.config = config
        self.log = log
        self._failures = RefusalLog(log)
        """A KV away for minutes fails every round (10 a second): a few lines per period, then a count."""
        self._revision: int | None = None
        """Our own revision of the lease while we hold it."""
        self._valid_until = 0.0
        self._seen: tuple[int, float] | None = None
        """(revision, when we first saw it) of someone else's lease."""
        self.leader = ""
        """Who holds the lease, as last read ('' unknown)."""

    @classmethod
    async def open(cls, js: Any, holder: str, config: LeaseConfig, log: Any, replicas: int = 1) -> LeaderLease:
        try:
            kv = await js.key_value(LEASE_BUCKET)
        except BucketNotFoundError:
            kv = await js.create_key_value(KeyValueConfig(bucket=LEASE_BUCKET, history=1, replicas=replicas))
        return cls(kv, holder, config, log)

    async def _bounded(self, call: Awaitable[T]) -> T:
        """Every KV call within the lease's TTL: one that hangs must not stop the lease loop."""
        return await asyncio.wait_for(call, self.config.ttl_s)

    def held(self) -> bool:
        """Whether we may act as leader now."""
        return time.monotonic() < self._valid_until

    def _value(self) -> bytes:
        data: bytes = msgpack.packb({"holder": self.holder, "t": time.time()})
        return data

    async def step(self) -> bool:
        """One round: renew if we hold the lease, else watch it and take it over once it expired."""
        started = time.monotonic()
        try:
            if self._revision is not None:
                await self._renew(started)
            else:
                await self._watch(started)
        except (TimeoutError, nats.errors.Error) as exc:  # KV unreachable: we cannot renew
            self._failures.warning("lease round failed", error=repr(exc), held=self.held())
        if self._revision is not None and not self.held():
            self.log.warning("lease lapsed: not renewed in time", holder=self.holder)
            self._revision = None
        return self.held()

    async def _renew(self, started: float) -> None:
        assert self._revision is not None
        try:
            self._revision = await self._bounded(self.kv.update(LEASE_KEY, self._value(), last=self._revision))
        except KeyWrongLastSequenceError:
            self.log.warning("lease taken over by another swapper", holder=self.holder)
            self._revision, self._valid_until = None, 0.0
            return
        self._valid_until = started + self.config.valid_fraction * self.config.ttl_s

    async def _watch(self, started: float) -> None:
        try:
            entry = await self._bounded(self.kv.get(LEASE_KEY))
        except KeyNotFoundError:
            await self._acquire(started, last=None)
            return
        revision = entry.revision or 0
        self.leader = _holder_of(entry.value)
        if self._seen is None or self._seen[0] != revision:
            self._seen = (revision, started)
            return
        if started - self._seen[1] >= self.config.ttl_s:
            self.log.info(
                "lease expired: taking over", previous=self.leader, silent_s=round(started - self._seen[1], 3)
            )
            await self._acquire(started, last=revision)

    async def _acquire(self, started: float, last: int | None) -> None:
        try:
            if last is None:
                revision = await self._bounded(self.kv.create(LEASE_KEY, self._value()))
            else:
                revision = await self._bounded(self.kv.update(LEASE_KEY, self._value(), last=last))
        except KeyWrongLastSequenceError:
            self._seen = None  # someone renewed or took it first
            return
        self._revision, self.leader = revision, self.holder
        self._valid_until = started + self.config.valid_fraction * self.config.ttl_s
        self._seen = None

    async def run(
        self,
        stop: asyncio.Event,
        follow: Callable[[], Coroutine[Any, Any, None]],
        acting: Callable[[], bool],
    ) -> None:
        """Keep the lease (or wait for it) until `stop`. Every round in which holding the lease and
        `acting()` (the service acts as leader) disagree, `follow()` (which reads `held()`) is
        started in a task of its own, one at a time: taking the lead loads every job record, which
        may take longer than the lease lasts, so renewals never wait for it; and a take-over that
        failed (or gave the lease back) is simply tried again next round. Comparing with what the
        service does, not with the last change announced, matters: a lease given back and silently
        taken again once left a swapper holding the lease for ever without acting, and its standby
        waiting for ever."""
        following: asyncio.Task[None] | None = None
        while not stop.is_set():
            held = await self.step()
            if held != acting() and (following is None or following.done()):
                following = asyncio.create_task(follow())
            period = self.config.renew_s if self._revision is not None else self.config.poll_s
            await stopped_within(stop, period)
        await self.release()
        if following is not None and not following.done():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(following), self.config.ttl_s)
        await follow()  # released: held() is False now, so the service steps down

    async def release(self) -> None:
        """Give the lease up (a clean stop), so a standby need not wait for it to expire."""
        if self._revision is None:
            return
        try:
            await self._bounded(self.kv.delete(LEASE_KEY, last=self._revision))
        except (TimeoutError, nats.errors.Error) as exc:
            self.log.warning("lease not released", error=repr(exc))
        self._revision, self._valid_until = None, 0.0


def _holder_of(value: bytes | None) -> str:
    try:
        body = msgpack.unpackb(value or b"", raw=False)
    except Exception:
        return "?"
    holder = body.get("holder") if isinstance(body, dict) else None
    return holder if isinstance(holder, str) else "?"
