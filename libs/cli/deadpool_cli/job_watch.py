"""Follows one job on the bus: heartbeats, rank maps, failures, incidents, completion.

The demo uses it to find the process holding a rank, to time its kill mid-step, and to collect the
swapper's incident reports; the chaos benchmark, to time each fault's downtime to the first step
every rank completed after it (from the members' own step-completion times, not the beats').
"""

from __future__ import annotations

import asyncio
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg

from deadpool_protocol import (
    Failure,
    GenerationVoid,
    Heartbeat,
    HeartbeatBatch,
    Incident,
    JobFinished,
    Rebuild,
    Subjects,
)
from deadpool_runtime import subscribe_validated

__all__ = ["JobWatch"]


@dataclass
class MemberView:
    pid: int = 0
    rank: int = -1
    generation: int = 0
    step: int = -1
    in_step: bool = False
    step_started_t: float = 0.0
    waiting: bool = False
    where: str = ""
    beat_t: float = 0.0
    section: str = ""
    rebuilding: bool = False
    awaiting: bool = False
    step_completed_t: float = 0.0
    step_times: list[float] = field(default_factory=list)
    phases: list[str] = field(default_factory=list)
    """The phases its heartbeats told, in order, each once a run (`MemberPhase`; a rebuild's states
    as 'rebuilding:form')."""
    _last_step_t: float = 0.0


@dataclass(frozen=True)
class StepDone:
    """A step a member completed: when, in which generation, as which rank."""

    t: float
    member: str
    rank: int
    generation: int
    step: int


class JobWatch:
    def __init__(self, nc: Client, job: str, log: Any) -> None:
        self.nc = nc
        self.job = job
        self.log = log
        self.members: dict[str, MemberView] = {}
        self.rebuild: Rebuild | None = None
        self.rebuilds: list[tuple[float, Rebuild]] = []
        """Every new generation seen, with when it arrived."""
        self.voids: list[GenerationVoid] = []
        self.steps_done: list[StepDone] = []
        self.finished_message: JobFinished | None = None
        self.failures: list[Failure] = []
        self.incidents: list[Incident] = []
        self.finished = asyncio.Event()
        self.changed = asyncio.Condition()
        self.snapshot_every_max = 1
        """The longest snapshot interval a rank's heartbeat named (`SnapshotInterval`)."""

    async def start(self) -> None:
        s = Subjects.for_job(self.job)
        await subscribe_validated(self.nc, s.heartbeat, Heartbeat, self._on_heartbeat, self.log)
        await subscribe_validated(self.nc, s.heartbeat_batch, HeartbeatBatch, self._on_batch, self.log)
        await subscribe_validated(self.nc, s.rebuild, Rebuild, self._on_rebuild, self.log)
        await subscribe_validated(self.nc, s.void, GenerationVoid, self._on_void, self.log)
        await subscribe_validated(self.nc, s.failure, Failure, self._on_failure, self.log)
        await subscribe_validated(self.nc, s.incident, Incident, self._on_incident, self.log)
        await subscribe_validated(self.nc, s.finished, JobFinished, self._on_finished, self.log)
        await self.nc.flush()

    async def _notify(self) -> None:
        async with self.changed:
            self.changed.notify_all()

    async def _on_batch(self, batch: HeartbeatBatch, msg: Msg) -> None:
        for hb in batch.beats:
            await self._on_heartbeat(hb, msg)
        now = time.time()
        for member in batch.alive:  # beat again, saying what its last whole beat said
            view = self.members.get(member)
            if view is not None:
                view.beat_t = now

    async def _on_heartbeat(self, hb: Heartbeat, _msg: Msg) -> None:
        view = self.members.setdefault(hb.member, MemberView())
        if hb.rank >= 0:
            self.snapshot_every_max = max(self.snapshot_every_max, hb.snapshot_every)
        if hb.step > view.step >= 0 and view._last_step_t:
            view.step_times.append((hb.t - view._last_step_t) / (hb.step - view.step))
        if hb.step != view.step:
            view._last_step_t = hb.t
        if hb.step_completed_t > view.step_completed_t and hb.rank >= 0 and hb.step > 0:
            self.steps_done.append(StepDone(hb.step_completed_t, hb.member, hb.rank, hb.generation, hb.step))
            view.step_completed_t = hb.step_completed_t
        view.section, view.rebuilding, view.awaiting = hb.section, hb.rebuilding, hb.awaiting_rebuild
        phase = f"{hb.phase}:{hb.rebuild_state}" if hb.rebuild_state else str(hb.phase)
        if not view.phases or view.phases[-1] != phase:
            view.phases.append(phase)
        view.pid, view.rank, view.generation, view.step = hb.pid, hb.rank, hb.generation, hb.step
        view.in_step, view.step_started_t, view.waiting, view.where, view.beat_t = (
            hb.in_step,
            hb.step_started_t,
            hb.waiting,
            hb.where,
            hb.t,
        )
        await self._notify()

    async def _on_rebuild(self, rebuild: Rebuild, _msg: Msg) -> None:
        if self.rebuild is None or rebuild.generation > self.rebuild.generation:
            self.rebuild = rebuild
            self.rebuilds.append((time.time(), rebuild))
            await self._notify()

    async def _on_void(self, void: GenerationVoid, _msg: Msg) -> None:
        self.voids.append(void)

    async def _on_failure(self, failure: Failure, _msg: Msg) -> None:
        self.failures.append(failure)

    async def _on_incident(self, incident: Incident, _msg: Msg) -> None:
        """An incident report; one said again (a new leader publishes what the last may have sent before
        it stopped) takes the place of the first."""
        for index, seen in enumerate(self.incidents):
            if seen.incident_id == incident.incident_id:
                self.incidents[index] = incident
                break
        else:
            self.incidents.append(incident)
        await self._notify()

    async def _on_finished(self, finished: JobFinished, _msg: Msg) -> None:
        self.finished_message = self.finished_message or finished
        self.finished.set()
        await self._notify()

    def resumed_at(self, after_t: float, min_generation: int = 0, since_index: int = 0) -> float | None:
        """When every rank of the newest generation (at least `min_generation`) had completed a step
        after `after_t`: the fault's end as users feel it. None if that has not happened yet.
        `since_index`: where in `steps_done` to start looking (its length some time before the fault)."""
        rebuild = self.rebuild
        if rebuild is None or rebuild.generation < min_generation:
            return None
        firsts: dict[int, float] = {}
        for done in self.steps_done[since_index:]:
            if done.t <= after_t or done.generation != rebuild.generation:
                continue
            if rebuild.ranks[done.rank : done.rank + 1] == [done.member]:
                firsts[done.rank] = min(done.t, firsts.get(done.rank, done.t))
        if len(firsts) < rebuild.world_size:
            return None
        return max(firsts.values())

    def ready_spares(self, now: float, fresh_s: float = 1.0) -> list[str]:
        """Spares that beat in the last `fresh_s` and have warmed up (ready to take a rank)."""
        ranked = set(self.rebuild.ranks) if self.rebuild is not None else set()
        return [
            m
            for m, v in self.members.items()
            if m not in ranked and v.rank < 0 and not v.section and now - v.beat_t < fresh_s
        ]

    def last_step_t(self) -> float:
        """When any rank last completed a step (0 if none yet)."""
        return self.steps_done[-1].t if self.steps_done else 0.0

    def holder_of(self, rank: int) -> str | None:
        if self.rebuild is None or rank >= len(self.rebuild.ranks):
            return None
        return self.rebuild.ranks[rank]

    def median_step_s(self, member: str) -> float:
        times = self.members.get(member, MemberView()).step_times
        return statistics.median(times) if times else 0.0

    def describe_members(self, now: float) -> list[str]:
        """One line per member from its last heartbeat: what a run that never finished was doing."""
        lines = []
        for member, v in sorted(self.members.items(), key=lambda kv: (kv[1].rank < 0, kv[1].rank, kv[0])):
            state = "in a step" if v.in_step else "between steps"
            lines.append(
                f"{member} (pid {v.pid}): rank {v.rank}, generation {v.generation}, step {v.step}, {state}, "
                f"{'waiting on peers' if v.waiting else 'busy'} at {v.where or '?'}; "
                f"last heartbeat {now - v.beat_t:.1f} s ago"
            )
        return lines

    async def wait_for(self, predicate: Any) -> None:
        async with self.changed:
            await self.changed.wait_for(predicate)
