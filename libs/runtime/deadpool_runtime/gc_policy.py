"""A service's old objects are kept out of the cyclic collector's full passes, but for one in a while.

A swapper driving 8,192 simulated members holds 58,000 to 85,000 tracked objects in the collector's
oldest generation (members, placements, the acks of a rebuild). Every full collection walks them all:
in one run of `bench/control_plane_scale.py --members 8192` the swapper made 14, 50 to 126 ms each
(736 ms in all), and the detector 2, up to 100 ms: each a pause of whatever decision (a rebuild, a
commit, a verdict) came in behind it. CPython starts a full pass once the objects promoted since the
last one reach a quarter of those it holds, so a state that grows keeps paying for its whole size.

Objects that have lived `FREEZE_EVERY_S` are moved to the permanent generation (`gc.freeze`): full
passes walk only what came since. At 16,384 members (one run each): the swapper's full passes 2,411 ms
in all, up to 151 ms each, became 520 ms, up to 44 ms; the detector's 379 ms, up to 166 ms, became 91
ms, up to 51 ms. Frozen objects are still
freed by their reference counts; only cyclic garbage among them waits, until every `THAW_EVERY_S` they
are unfrozen and collected once (a finished job's worker and its tasks, say): one full pass then, in
place of one every few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time

__all__ = ["FREEZE_EVERY_S", "THAW_EVERY_S", "freeze_old_objects"]

FREEZE_EVERY_S = 5.0
"""How often the objects alive so far leave the collector's passes."""
THAW_EVERY_S = 600.0
"""How often they come back for one full collection (their cyclic garbage freed)."""


async def freeze_old_objects(
    stop: asyncio.Event, freeze_every_s: float = FREEZE_EVERY_S, thaw_every_s: float = THAW_EVERY_S
) -> None:
    """Until `stop`: every `freeze_every_s`, freeze what is alive; every `thaw_every_s`, first unfreeze
    and collect it all once. Everything is unfrozen when it returns."""
    thawed_at = time.monotonic()
    try:
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), freeze_every_s)
            if stop.is_set():
                return
            if time.monotonic() - thawed_at >= thaw_every_s:
                gc.unfreeze()
                gc.collect()
                thawed_at = time.monotonic()
            gc.freeze()
    finally:
        gc.unfreeze()
