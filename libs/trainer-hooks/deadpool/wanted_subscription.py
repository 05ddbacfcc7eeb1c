"""A subscription held only while it is wanted.

A member hears whole rebuilds and whole placements only while it holds nothing their deltas go from
(`control_link`): at 16,384 ranks each whole one is hundreds of kB, sent to every subscriber. It
subscribes when a delta does not apply and leaves once it holds the whole message again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from nats.aio.subscription import Subscription

__all__ = ["WantedSubscription"]


class WantedSubscription:
    """Subscribes or leaves as `want` says, in a task of its own: leaving a subscription stops its
    handler, which must not be the one asking. Used on one event loop only."""

    def __init__(self, subscribe: Callable[[], Awaitable[Subscription]], what: str, log: Any) -> None:
        self._subscribe = subscribe
        self.what = what
        self.log = log
        self._subscription: Subscription | None = None
        self._wanted = False
        self._changing: asyncio.Task[None] | None = None

    @property
    def held(self) -> bool:
        return self._subscription is not None

    async def start(self) -> None:
        """Subscribe now, and want it (a member that holds nothing yet)."""
        self._wanted = True
        self._subscription = await self._subscribe()

    def want(self, wanted: bool) -> None:
        self._wanted = wanted
        if wanted != self.held and (self._changing is None or self._changing.done()):
            self._changing = asyncio.get_running_loop().create_task(self._change())

    async def _change(self) -> None:
        while self._wanted != self.held:
            try:
                if self._wanted:
                    self._subscription = await self._subscribe()
                else:
                    subscription, self._subscription = self._subscription, None
                    assert subscription is not None
                    await subscription.unsubscribe()
            except Exception as exc:  # the connection closing: nothing to hear then
                self.log.warning("subscription not changed", what=self.what, wanted=self._wanted, error=repr(exc))
                return
