"""The detector's decision core: signals in, at most one `Failure` per member out. No I/O.

Signals: a launcher's report that a process ended, a member's report of its own fatal error, and
heartbeats (silence longer than `heartbeat_timeout_s` is a failure). Each function takes `now` (wall
clock, seconds) so tests drive it with a fake clock. Every verdict carries its reason and evidence.

A member is declared failed once, ever: member ids are unique per process and a declared member is
fenced, so a second verdict could only be a duplicate.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from deadpool_protocol import (
    NO_RANK,
    ChildExit,
    Failure,
    FailureReason,
    Heartbeat,
    JobFinished,
    MemberDone,
    MemberError,
    Rebuild,
)

__all__ = ["DetectorConfig", "DetectorCore", "JobView", "Watched"]


@dataclass(frozen=True)
class DetectorConfig:
    heartbeat_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.heartbeat_timeout_s <= 0:
            raise ValueError("heartbeat_timeout_s must be positive")


@dataclass
class Watched:
    member: str
    rank: int
    last_seen: float
    last_step: int = -1
    pid: int = 0
    done: bool = False


@dataclass
class JobView:
    job: str
    generation: int = 0
    finished: bool = False
    members: dict[str, Watched] = field(default_factory=dict)
    declared: set[str] = field(default_factory=set)


class DetectorCore:
    def __init__(self, config: DetectorConfig) -> None:
        self.config = config
        self.jobs: dict[str, JobView] = {}

    def _view(self, job: str) -> JobView:
        view = self.jobs.get(job)
        if view is None:
            view = self.jobs[job] = JobView(job)
        return view

    def on_heartbeat(self, hb: Heartbeat, now: float) -> None:
        view = self._view(hb.job)
        if hb.member in view.declared:
            return  # a declared member is being fenced; its last words change nothing
        view.generation = max(view.generation, hb.generation)
        watched = view.members.get(hb.member)
        if watched is None:
            watched = view.members[hb.member] = Watched(hb.member, hb.rank, now)
        watched.last_seen = now
        watched.last_step = hb.step
        watched.pid = hb.pid
        if hb.generation >= view.generation:
            watched.rank = hb.rank

    def on_rebuild(self, rebuild: Rebuild, now: float) -> None:
        """Learn the rank map. Members named there are watched from now on, even before they beat."""
        view = self._view(rebuild.job)
        if rebuild.generation < view.generation:
            return
        view.generation = rebuild.generation
        for member in [*rebuild.ranks, *rebuild.spares]:
            if member not in view.members and member not in view.declared:
                view.members[member] = Watched(member, NO_RANK, now)
        for member, watched in view.members.items():
            watched.rank = rebuild.rank_of(member)

    def on_done(self, done: MemberDone) -> None:
        watched = self._view(done.job).members.get(done.member)
        if watched is not None:
            watched.done = True

    def on_finished(self, finished: JobFinished) -> None:
        self._view(finished.job).finished = True

    def on_exit(self, exit_: ChildExit, now: float) -> list[Failure]:
        view = self._view(exit_.job)
        watched = view.members.pop(exit_.member, None)
        normal = exit_.returncode == 0 and (view.finished or (watched is not None and watched.done))
        if normal or exit_.member in view.declared:
            return []
        evidence = {"returncode": str(exit_.returncode), "pid": str(exit_.pid), "launcher": exit_.launcher}
        if exit_.returncode < 0:
            evidence["signal"] = str(-exit_.returncode)
        rank = watched.rank if watched is not None else NO_RANK
        return [self._declare(view, exit_.member, rank, FailureReason.EXIT, evidence, exit_.t_exit, now)]

    def on_error(self, error: MemberError, now: float) -> list[Failure]:
        view = self._view(error.job)
        if error.member in view.declared:
            return []
        view.members.pop(error.member, None)
        evidence = {"error": error.error[:2000]}
        return [self._declare(view, error.member, error.rank, FailureReason.ERROR, evidence, error.t, now)]

    def check(self, now: float) -> list[Failure]:
        """Heartbeat timeouts: every member silent for longer than the timeout is declared failed."""
        failures: list[Failure] = []
        for view in self.jobs.values():
            if view.finished:
                continue
            silent = [
                w for w in view.members.values() if not w.done and now - w.last_seen > self.config.heartbeat_timeout_s
            ]
            for w in silent:
                del view.members[w.member]
                evidence = {
                    "silence_s": f"{now - w.last_seen:.3f}",
                    "last_step": str(w.last_step),
                    "pid": str(w.pid),
                }
                failures.append(
                    self._declare(view, w.member, w.rank, FailureReason.HEARTBEAT, evidence, w.last_seen, now)
                )
        return failures

    def _declare(
        self,
        view: JobView,
        member: str,
        rank: int,
        reason: str,
        evidence: dict[str, str],
        t_fault: float,
        now: float,
    ) -> Failure:
        view.declared.add(member)
        return Failure(
            job=view.job,
            generation=view.generation,
            member=member,
            rank=rank,
            reason=reason,
            evidence=evidence,
            t_fault=t_fault,
            t_detected=now,
        )
