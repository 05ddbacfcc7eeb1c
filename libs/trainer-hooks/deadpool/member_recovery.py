"""The member's side of failures: leaving a broken step, and carrying out rebuilds until one holds.

Two threads take part. The control thread (`on_command`) breaks, the moment a generation is
superseded, every wait of it and its process group, so a training thread blocked in a collective
gets out without waiting for any peer; it also notices a training thread that cannot get out
(`StuckCollectiveWatch`) and ends the member, saying why. The training thread (`recover`,
`carry_out`) leaves the broken group and carries out the swapper's rebuilds (`MemberRebuild`) until
one holds, the job ends, or this member cannot go on.

A rebuild never writes the member's fields: it hands its result to `RebuildParts.adopt`, and what
`carry_out` ends in is returned as an `Outcome` for the member's lifecycle to take.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace

from deadpool.control_link import Command
from deadpool.errors import (
    MemberCannotContinueError,
    RendezvousFailedError,
    RestoreUnavailableError,
    SupersededError,
)
from deadpool.failure_origin import is_collective_error
from deadpool.member_rebuild import FirstStepTrace, MemberRebuild, RebuildParts
from deadpool.member_state import MemberState
from deadpool.stuck_watch import StuckCollectiveWatch
from deadpool_protocol import (
    NO_RANK,
    GenerationVoid,
    JobFinished,
    MemberError,
    MemberErrorCause,
    MemberPhase,
    Rebuild,
    RebuildMarks,
)

__all__ = ["ERROR_REPORT_WAIT_S", "FORM_LEAVE_S", "HoldsRank", "JobEnded", "Outcome", "Recovery", "StaysSpare"]

ERROR_REPORT_WAIT_S = 5.0
FORM_LEAVE_S = 1.5
"""After a group's creation was broken, how long the training thread may take to leave it."""


@dataclass(frozen=True)
class HoldsRank:
    """A rebuild holds: the member trains as the rank it adopted."""

    first_step_trace: FirstStepTrace | None


@dataclass(frozen=True)
class StaysSpare:
    """The rebuild of `generation` gave this member no rank."""

    generation: int


@dataclass(frozen=True)
class JobEnded:
    """The job ended (`finished` None: the control link closed) before a rebuild held."""

    finished: JobFinished | None


Outcome = HoldsRank | StaysSpare | JobEnded


class Recovery:
    def __init__(
        self,
        parts: RebuildParts,
        position: Callable[[], MemberState],
        enter: Callable[[MemberPhase], None],
        step_time_s: Callable[[], float],
        computes_itself: bool,
    ) -> None:
        """`position`: where the member stands now; `enter`: the member's phase changes (both from
        the lifecycle). `computes_itself`: the training thread does the compute (a CPU model on
        gloo), so a blocked thread in a broken collective is stuck (see `stuck_watch`)."""
        self.parts = parts
        self.log = parts.log
        self._position = position
        self._enter = enter
        self._closed = False
        self.stuck = StuckCollectiveWatch(
            parts.link, self.report_stuck, parts.log, step_time_s=step_time_s, blocked_means_stuck=computes_itself
        )

    def recoverable(self, exc: Exception) -> bool:
        """Whether `exc`, raised in a step, is the group's failure (or its consequence) rather than the step's."""
        noted = (
            self.parts.objects.note.error is not None
        )  # the group broke in this step: what followed is its consequence
        return noted or is_collective_error(exc) or self.parts.waits.superseded(self._position().generation)

    def recover(self, exc: Exception) -> Outcome:
        """Leave the broken step: break the group (releasing peers), then obey the swapper's next rebuild."""
        parts, link, here = self.parts, self.parts.link, self._position()
        out = time.time()
        self._enter(MemberPhase.RECOVERING)
        link.progress = replace(link.progress, in_step=False, awaiting_rebuild=True)  # out of the step
        parts.leave_group()
        self.log.warning(
            "collective failed; group dropped, waiting for a rebuild",
            generation=here.generation,
            rank=here.rank,
            step=here.completed_step,
            error=str(exc)[:300],
        )
        command = link.wait_command(newer_than=here.generation, timeout_s=parts.config.rebuild_wait_s)
        if isinstance(command, JobFinished):
            return JobEnded(command)
        if not isinstance(command, Rebuild):
            self.report_fatal(exc)
            raise RuntimeError(
                f"a collective failed and no rebuild came within {parts.config.rebuild_wait_s} s"
            ) from exc
        latest, received = link.latest_rebuild()
        assert latest is not None
        return self.carry_out(latest, RebuildMarks(received=received, out=out))

    def carry_out(self, command: Rebuild, marks: RebuildMarks) -> Outcome:
        """Carry out `command`, or the newer one that supersedes it, until one holds or the job ends.
        Raises MemberFencedError if this member was replaced, MemberCannotContinueError (after
        reporting it) if it cannot carry the rebuild out."""
        parts, link = self.parts, self.parts.link
        while True:
            self.stuck.clear()
            self._enter(MemberPhase.REBUILDING)
            rebuild = MemberRebuild(parts, self._position(), command, marks)
            try:
                if not rebuild.run():
                    return StaysSpare(command.generation)
                return HoldsRank(rebuild.first_step_trace)
            except RestoreUnavailableError as exc:
                parts.leave_group()
                rebuild.report_unavailable(str(exc))
            except SupersededError:
                parts.leave_group()
                self.log.info("generation superseded during its rebuild", generation=command.generation)
            except RendezvousFailedError as exc:
                parts.leave_group()
                link.progress = replace(link.progress, rebuilding=False, awaiting_rebuild=True)
                self.log.warning(
                    "rendezvous failed; waiting for the next command",
                    generation=command.generation,
                    error=str(exc)[:300],
                )
            except MemberCannotContinueError as exc:
                parts.leave_group()
                self.report_fatal(exc, exc.cause, during=command)
                raise
            self._enter(MemberPhase.RECOVERING)
            newer = link.wait_command(newer_than=command.generation, timeout_s=parts.config.rebuild_wait_s)
            if isinstance(newer, JobFinished):
                return JobEnded(newer)
            if newer is None:
                raise RuntimeError(f"generation {command.generation} could not form and none replaced it")
            latest, received = link.latest_rebuild()
            command = latest or newer
            marks = RebuildMarks(received=received, out=marks.out)

    def on_command(self, command: Command) -> None:
        """Control thread, the moment a newer rebuild, a void notice or the job's end arrives: every
        wait of a generation that can no longer form is broken now (rendezvous, process-group creation,
        fetches), and so is our old group, so a training thread blocked in a collective gets out
        without waiting for any peer."""
        waits, group = self.parts.waits, self.parts.group
        if isinstance(command, Rebuild):
            broken = waits.supersede(newest=command.generation)
            below = command.generation
        elif isinstance(command, GenerationVoid):
            broken = waits.supersede(void=command.generation)
            below = command.generation + 1
        else:
            broken = waits.supersede(ended=True)
            below = 2**62
        forming = group.forming_generation()
        if group.abort(below_generation=below):
            generation = self._position().generation
            self.log.info("process group aborted", generation=generation, by=command.KIND)
            self.stuck.watch(generation)
            if forming is not None and forming < below:
                self._watch_creation_leaves(forming)
        if broken:
            self.log.info("waits of a superseded generation broken", waits=broken, by=command.KIND)

    def close(self) -> None:
        self._closed = True
        self.stuck.close()

    def _watch_creation_leaves(self, generation: int) -> None:
        """Control thread: the creation of `generation`'s group was just broken, which fails it at once
        unless gloo is retrying a connection to a peer that died (ECONNREFUSED, no socket to break: it
        retries until the collective timeout). Seen once in 50 chaos faults, holding the next generation
        for 20 s. If the training thread is still creating that group after `FORM_LEAVE_S`, this member
        exits, saying why, and the swapper replaces it with a spare."""

        def check() -> None:
            if self.parts.group.forming_generation() == generation and not self._closed:
                self.report_stuck(generation)

        timer = threading.Timer(FORM_LEAVE_S, check)
        timer.daemon = True
        timer.start()

    def report_stuck(self, generation: int) -> None:
        """Control thread: the training thread is still inside a collective of `generation` long
        after its group was broken (gloo cannot interrupt a send whose peer left). Say so and exit,
        so that the swapper replaces this member instead of waiting for the collective timeout."""
        error = RuntimeError(f"stuck in a collective of generation {generation} that its broken group did not release")
        self.report_fatal(error, MemberErrorCause.STUCK_COLLECTIVE)
        self.log.error("exiting: stuck in a collective the abort could not release", generation=generation)
        os._exit(3)

    def report_fatal(
        self, exc: BaseException, cause: MemberErrorCause = MemberErrorCause.STEP, during: Rebuild | None = None
    ) -> None:
        """Tell the detector we cannot go on, and why, before we stop (bounded wait for it to be stored).
        `during`: the rebuild being carried out, whose generation and rank the report is made in (the
        detector takes a report that ends the job only from the rank's member, in its generation)."""
        config, link, here = self.parts.config, self.parts.link, self._position()
        generation, rank = here.generation, here.rank if here.rank is not None else NO_RANK
        if during is not None:
            named = config.member in during.ranks
            generation, rank = during.generation, during.ranks.index(config.member) if named else NO_RANK
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        error = MemberError(config.job, generation, config.member, rank, text[:2000], time.time(), cause)
        try:
            link.publish_event(link.subjects.member_error, error).result(ERROR_REPORT_WAIT_S)
        except Exception as report_exc:
            self.log.warning("error report not sent", error=repr(report_exc))
