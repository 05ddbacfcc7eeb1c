"""The swapper's leader lease on a real nats-server's JetStream KV: one holder, take-over when the
holder goes silent, and a holder that fails to take the lead tries again instead of holding the
lease for ever without acting (that once left a job with no leader at all)."""

from __future__ import annotations

import asyncio
import contextlib
import time

from nats.aio.client import Client

from deadpool_runtime.logs import get_logger
from deadpool_swapper.leader_lease import LeaderLease, LeaseConfig

CONFIG = LeaseConfig(ttl_s=1.0, renew_s=0.2, poll_s=0.1)


class Service:
    """What the swapper service does with the lease: act while it holds it (or fail to, `failures` times)."""

    def __init__(self, name: str, failures: int = 0) -> None:
        self.name = name
        self.acting = False
        self.failures = failures
        self.takeovers = 0
        self.lease: LeaderLease | None = None

    async def follow(self) -> None:
        assert self.lease is not None
        if self.lease.held() and not self.acting:
            if self.failures:
                self.failures -= 1
                await self.lease.release()  # "cannot take the lead: records unreachable"
                return
            self.acting, self.takeovers = True, self.takeovers + 1
        elif not self.lease.held():
            self.acting = False


async def start(nc: Client, service: Service, stop: asyncio.Event) -> asyncio.Task[None]:
    service.lease = await LeaderLease.open(nc.jetstream(timeout=2.0), service.name, CONFIG, get_logger(test="lease"))
    return asyncio.create_task(service.lease.run(stop, service.follow, lambda: service.acting))


async def until(predicate: object, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "not within the bound"
        await asyncio.sleep(0.05)


async def test_one_holder_and_a_take_over_once_it_goes_silent(nc: Client) -> None:
    a, b = Service("a"), Service("b")
    stop_a, stop_b = asyncio.Event(), asyncio.Event()
    task_a = await start(nc, a, stop_a)
    await until(lambda: a.acting)
    task_b = await start(nc, b, stop_b)
    await asyncio.sleep(2 * CONFIG.ttl_s)
    assert a.acting and not b.acting  # the standby never acts while the leader renews
    task_a.cancel()  # the leader dies: no renewal, no release
    with contextlib.suppress(asyncio.CancelledError):
        await task_a
    silenced = time.monotonic()
    await until(lambda: b.acting)
    print(f"take-over {time.monotonic() - silenced:.2f} s after the leader went silent")
    stop_b.set()
    await task_b
    assert not b.acting


async def test_a_holder_that_fails_to_take_the_lead_tries_again(nc: Client) -> None:
    a = Service("a", failures=2)
    stop = asyncio.Event()
    task = await start(nc, a, stop)
    await until(lambda: a.acting)
    assert a.failures == 0 and a.takeovers == 1
    stop.set()
    await task
