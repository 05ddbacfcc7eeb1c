"""A store that comes back under its own name on a new address is announced to the members, whenever
in its loss window it returns, and commits resume.

Seen in `bench/durability.py`, one trial in ten: a store SIGKILLed and started again 2 s later on a
new port. The members went on uploading to its old address (60 refused connections a second, for
62 s); the swapper logged no loss and sent no placement, and commits froze while training went on.

Real processes: NATS, a detector, a swapper, two stores (replication 2, so every rank is placed on
both), the example job. Store 0 is SIGKILLed and started again (a new process, a new port) three
times: before the swapper can have missed it, about when its timeout ends, and well after the
swapper placed the ranks on the other store alone.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from deadpool_cli.stack import Stack, StackConfig
from deadpool_protocol import Commit, Placement, StoreStatus, Subjects, decode
from deadpool_protocol.subjects import STORE_STATUS

from .jobs import every_rank_at, launch, rank_steps, stop_all, until, watcher

JOB = "store-returns"
RETURN_AFTER_S = (0.2, 1.5, 4.0)
"""When the store comes back after its SIGKILL (the swapper's store timeout is 1.5 s)."""
HEAL_WAIT_S = 60.0
"""Generous on 2 busy cores: how fast it heals is `bench/durability.py`'s business."""


async def test_a_store_restarted_on_a_new_address_is_announced_at_every_point_of_its_loss(tmp_path: Path) -> None:
    config = StackConfig(workdir=tmp_path, stores=2, replication=2, heartbeat_timeout_s=2.0, hang_floor_s=3.0)
    async with Stack(config) as stack:
        nc, watch = await watcher(stack, JOB)
        statuses: dict[str, StoreStatus] = {}
        placements: list[Placement] = []
        commits: list[tuple[float, int]] = []

        async def on_status(msg: object) -> None:
            status = decode(msg.data, StoreStatus)  # type: ignore[attr-defined]
            statuses[status.store] = status

        async def on_placement(msg: object) -> None:
            placements.append(decode(msg.data, Placement))  # type: ignore[attr-defined]

        async def on_commit(msg: object) -> None:
            commits.append((time.monotonic(), decode(msg.data, Commit).step))  # type: ignore[attr-defined]

        subjects = Subjects.for_job(JOB)
        await nc.subscribe(STORE_STATUS, cb=on_status)
        await nc.subscribe(subjects.placement, cb=on_placement)
        await nc.subscribe(subjects.commit, cb=on_commit)
        log = tmp_path / "launch.log"
        launcher = await launch(stack.nats_args, JOB, log, steps=100_000, nproc=2, spares=1)
        try:
            await until(watch, lambda: every_rank_at(watch, 5) and bool(commits), log, "training with commits")
            assert watch.rebuild is not None
            generation = watch.rebuild.generation
            for after_s in RETURN_AFTER_S:
                old = statuses["store-0"]
                stack.kill("store-0")
                await asyncio.sleep(after_s)
                seen = len(placements)
                stack._start("store-0")
                deadline = time.monotonic() + HEAL_WAIT_S
                while statuses["store-0"].incarnation == old.incarnation:
                    assert time.monotonic() < deadline, "store-0 did not come back"
                    await asyncio.sleep(0.05)
                new = statuses["store-0"]
                assert (new.host, new.port) != (old.host, old.port), "the restarted store took its old port"
                restarted_t, trained = time.monotonic(), max(rank_steps(watch))

                def announced(new: StoreStatus = new, seen: int = seen) -> bool:
                    return any(
                        any(s.store == "store-0" and s.port == new.port for s in p.stores)
                        and all("store-0" in names for names in p.placement)
                        for p in placements[seen:]
                    )

                def resumed(restarted_t: float = restarted_t, trained: int = trained) -> bool:
                    return any(t > restarted_t and step > trained for t, step in commits)

                await until(watch, announced, log, f"store-0 back after {after_s} s: announced at its new port")
                await until(watch, resumed, log, f"store-0 back after {after_s} s: commits resume")
                assert watch.rebuild.generation == generation, "a store's return needs no rebuild"
        finally:
            stop_all(launcher)
            await launcher.wait()
            await nc.close()
