"""The member's life, as a state machine of named phases (`MemberPhase`), behind the user's `Job`.

    SPARE ──► WARMING ──► SPARE            a spare builds its wrapper and optimizer once
    SPARE ──► REBUILDING ──► TRAINING      a rebuild gives it a rank (a launcher's rank: the formation)
    TRAINING ──► RECOVERING ──► REBUILDING a step's collective failed: the group is left, the next
                                           rebuild awaited (also after a rebuild that did not hold)
    TRAINING ──► REBUILDING                a newer rebuild found between two steps
    TRAINING ──► FINISHING ──► DONE        after the last step: done is reported until the job ends
    FINISHING ──► REBUILDING               a rank failed at the very end: steps are replayed
    TRAINING ──► LEFT_EARLY ──► FINISHING  the loop was left early: done is reported at close
    REBUILDING ──► SPARE                   a rebuild gave this spare no rank
    SPARE, RECOVERING ──► DONE             the job ended
    any ──► CLOSED                         `close()`, at the latest when the interpreter exits

Every transition goes through `Member._enter`, which refuses one the table (`NEXT`) does not hold,
and each one travels in the member's heartbeats (`Heartbeat.phase`, with the state of a rebuild
under way) to `deadpool status`. Within TRAINING, two flags follow the step itself: whether one is
open (`_step_open`), and whether the next is the generation's first (`_first_step_pending`).
"""

from __future__ import annotations

import gc
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from deadpool.control_link import ControlLink
from deadpool.cpu_placement import TRAIN_CPUS_ENV, cpus_from_env, pin_this_thread
from deadpool.errors import JobFailedError, MemberCannotContinueError, PhaseError
from deadpool.fault_injection import act_on_pending_fault, arm_from_env, step_delay_s
from deadpool.generation_waits import GenerationWaits
from deadpool.member_config import MemberConfig
from deadpool.member_rebuild import FirstStepTrace, RebuildParts
from deadpool.member_recovery import HoldsRank, JobEnded, Outcome, Recovery, StaysSpare
from deadpool.member_state import MemberState, RebuildResult
from deadpool.process_group import GenerationGroup, Rendezvous, pick_backend
from deadpool.spare_landing import SpareLanding
from deadpool.step_capture import StepCapture, snapshot_worker
from deadpool.step_stats import StepStats
from deadpool.training_objects import OptimizerFactory, TrainingObjects, Wrapper
from deadpool.training_state import rng_state, snapshot_bytes_max
from deadpool.user_state import UserState
from deadpool_protocol import (
    FIRST_STEP_SECTION,
    NO_STEP,
    JobFinished,
    MemberDone,
    MemberErrorCause,
    MemberHello,
    MemberPhase,
    Rebuild,
    RebuildMarks,
    StepResumed,
)
from deadpool_runtime.metrics import Metrics
from deadpool_runtime.tracing import Tracing

__all__ = ["FINISH_WAIT_S", "NEXT", "Member", "check_transition"]

FINISH_WAIT_S = 300.0
DONE_RETRANSMIT_S = 1.0
"""After its last step a rank repeats its done report this often until it hears the job finished."""
WARM_UP_SECTION = "warm-up"
"""The section a spare's heartbeats name while it warms up (it is not ready to take a rank yet)."""
LEFT_LOOP_SECTION = "after-the-loop"
"""The section a rank that left its loop early names until its script ends."""
GROUP_RETIRE_MARGIN_S = 5.0
"""A dropped process group is freed this long after its collective timeout (see `GenerationGroup`)."""

P = MemberPhase
NEXT: dict[MemberPhase, frozenset[MemberPhase]] = {
    P.SPARE: frozenset({P.WARMING, P.REBUILDING, P.DONE}),
    P.WARMING: frozenset({P.SPARE}),
    P.REBUILDING: frozenset({P.TRAINING, P.SPARE, P.RECOVERING, P.LEFT_EARLY}),
    P.TRAINING: frozenset({P.RECOVERING, P.REBUILDING, P.FINISHING, P.LEFT_EARLY}),
    P.RECOVERING: frozenset({P.REBUILDING, P.DONE, P.LEFT_EARLY}),
    P.LEFT_EARLY: frozenset({P.FINISHING}),
    P.FINISHING: frozenset({P.REBUILDING, P.DONE}),
    P.DONE: frozenset(),
    P.CLOSED: frozenset(),
}
"""The phases each phase may go to, besides CLOSED (any phase may close). LEFT_EARLY from REBUILDING or
RECOVERING: an exception out of a rebuild ends the loop, which closes the generator of `Job.steps`."""


def check_transition(current: MemberPhase, phase: MemberPhase) -> None:
    """Raise PhaseError unless a member in `current` may go to `phase` (staying is no transition)."""
    if phase is not current and phase is not MemberPhase.CLOSED and phase not in NEXT[current]:
        raise PhaseError(f"a member may not go from {current} to {phase}")


class Member:
    """Everything a member does besides what the user calls (`Job`): see the module's doc."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: OptimizerFactory | torch.optim.Optimizer,
        wrap: Wrapper | None,
        config: MemberConfig,
        log: Any,
        state: dict[str, Any] | None,
    ) -> None:
        pin_this_thread(cpus_from_env(TRAIN_CPUS_ENV))  # the training thread (the threads it starts follow)
        self.state = UserState()
        self.objects = TrainingObjects(module, optimizer, wrap, self.state, self._fence_optimizer_step, log)
        self.phase = MemberPhase.SPARE
        self.rank: int | None = None
        """This member's rank, or None while it holds none."""
        self.world_size = config.world_size
        self.generation = 0
        self.extra_state: dict[str, Any] = {}
        self.config = config
        self.log = log
        for name, obj in (state or {}).items():
            self.state.register(name, obj)
        if config.rank_hint >= 0 and not config.resume_from:
            self.state.read_once()  # now, before this member starts a thread (see `UserState.read_once`)
        self._step_open = False
        """A step began (at the top of the loop) and has not ended yet."""
        self._first_step_pending = False
        """The next step is this member's first of its generation (set by each rebuild)."""
        self._tracing = Tracing("deadpool-member")
        """Off unless an exporter or `DEADPOOL_TRACE_FILE` is configured (`deadpool_runtime.tracing`)."""
        self._metrics = Metrics("deadpool-member")
        """Off unless an exporter is configured (`deadpool_runtime.metrics`)."""
        self._first_step_trace: FirstStepTrace | None = None
        self.restores = 0
        """Rebuilds that restored state (`Job.iterate` starts its loader over after each)."""
        backend = pick_backend(config.backend)
        self.next_step = 0
        self.completed_step = NO_STEP
        initial_rng = rng_state()
        """The RNG state at attach: where a formation that must be started again starts from."""
        waits = GenerationWaits()
        """The training thread's waits of a generation, which the control thread breaks when it is superseded."""
        rendezvous = Rendezvous(config.rendezvous_host, config.pg_timeout_s)
        self._group = GenerationGroup(retire_s=config.pg_timeout_s + GROUP_RETIRE_MARGIN_S)
        self.stats = StepStats()
        """Per-step wall time and time spent in the hooks (written to `DEADPOOL_STATS_DIR` at close)."""
        if self._metrics.on:
            self.stats.listener = self._step_metrics()
        self._worker = snapshot_worker(config, log)
        self._landing = (
            SpareLanding(snapshot_bytes_max(module), any(p.is_cuda for p in module.parameters()), log)
            if config.rank_hint < 0
            else None
        )
        """A spare's buffer for the snapshot it will restore, faulted in after its warm-up."""
        if arm_from_env():
            log.warning(
                "fault injection armed: SIGUSR1 hangs the training thread, SIGUSR2 raises, "
                "SIGURG resets the group's connections, SIGWINCH slows"
            )
        self.link = ControlLink(
            config,
            log,
            on_command=lambda command: self._recovery.on_command(command),
            on_placement=lambda placement: self._snapshots.on_placement(placement),
            on_interval=lambda interval: self._snapshots.heard(interval),
            on_snapshot_size=self._landing.want if self._landing is not None else None,
        )
        self._snapshots = StepCapture(config, log, self._worker, self.objects, self.link, self.stats)
        if config.rank_hint < 0:  # a spare is not ready to take a rank before it has warmed up
            self.link.progress = replace(self.link.progress, section=WARM_UP_SECTION)
        parts = RebuildParts(
            config=config,
            log=log,
            link=self.link,
            waits=waits,
            rendezvous=rendezvous,
            group=self._group,
            backend=backend,
            worker=self._worker,
            objects=self.objects,
            tracing=self._tracing,
            initial_rng=initial_rng,
            leave_group=self._leave_group,
            adopt=self._adopt,
            capture=lambda step, loaded: self._snapshots.capture(step, self.extra_state, loaded),
            landing=self._landing.take if self._landing is not None else None,
            landing_back=self._landing.give_back if self._landing is not None else None,
        )
        computes_itself = backend == "gloo" and all(p.device.type == "cpu" for p in module.parameters())
        self._recovery = Recovery(parts, self.position, self._enter, self.stats.recent_step_s, computes_itself)
        self.link.start(
            MemberHello(
                job=config.job,
                generation=0,
                member=config.member,
                host=config.host,
                pid=os.getpid(),
                launcher=config.launcher,
                rank_hint=config.rank_hint,
                world_size=config.world_size,
                rendezvous_host=config.rendezvous_host,
                rendezvous_port=rendezvous.port,
                t=time.time(),
                run=config.run,
            )
        )
        self._worker.store_token = self.link.store_token
        self._worker.seal_key = self.link.seal_key

    # ------------------------------------------------------------------ phases

    def position(self) -> MemberState:
        return MemberState(self.rank, self.generation, self.completed_step)

    @property
    def ended(self) -> bool:
        """The job finished, or this member left it (or closed)."""
        return self.phase in (MemberPhase.DONE, MemberPhase.CLOSED)

    def _enter(self, phase: MemberPhase) -> None:
        """The one place the phase changes: checked against `NEXT`, and told in the heartbeats."""
        if phase is self.phase:
            return
        check_transition(self.phase, phase)
        self.phase = phase
        rebuild_state = self.link.progress.rebuild_state if phase is MemberPhase.REBUILDING else None
        self.link.progress = replace(self.link.progress, phase=phase, rebuild_state=rebuild_state)

    def _take(self, outcome: Outcome) -> bool:
        """Where a rebuild, or a wait for one, ended; True if this member holds a rank."""
        if isinstance(outcome, HoldsRank):
            if outcome.first_step_trace is not None:
                self._first_step_trace = outcome.first_step_trace
            self._enter(MemberPhase.TRAINING)
            return True
        if isinstance(outcome, StaysSpare):
            self.generation = outcome.generation
            self.link.progress = replace(self.link.progress, generation=outcome.generation)
            self._enter(MemberPhase.SPARE)
            return False
        assert isinstance(outcome, JobEnded)
        self._end(outcome.finished)
        return False

    def _end(self, finished: JobFinished | None) -> None:
        self._enter(MemberPhase.DONE)
        if self._landing is not None:  # a spare at the job's end: its faulting thread ends now
            self._landing.close()
        if finished is not None and finished.failed:
            raise JobFailedError(f"the job was ended by the swapper: {finished.reason}")

    # ------------------------------------------------------------------ joining and finishing

    def join(self) -> None:
        """Wait, as a spare (or a rank before the formation), until a rebuild gives a rank or the job ends."""
        if self.config.rank_hint < 0 and self.link.finished() is None:
            self._warm_up()
        while True:  # a spare waits for the job: it ends with a rank, or with the job
            command = self.link.wait_command(newer_than=self.generation, timeout_s=None)
            if isinstance(command, JobFinished) or command is None:
                self._end(command)
                return
            _, received = self.link.latest_rebuild()
            if self._take(self._recovery.carry_out(command, RebuildMarks(received=received))):
                return

    def _warm_up(self) -> None:
        """A spare builds its wrapper and optimizer once in a one-process group, so that the imports
        and lazy initialisation they trigger (seconds under load) are paid before it is needed."""
        if self.objects.warmed:
            return
        started = time.monotonic()
        self._enter(MemberPhase.WARMING)
        self.link.progress = replace(self.link.progress, section=WARM_UP_SECTION)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            self.objects.warm_up(dist.group.WORLD)
        except Exception as exc:  # the same code will run at the rebuild: say so now, with the reason
            self._recovery.report_fatal(exc, MemberErrorCause.USER_CODE)
            raise MemberCannotContinueError(
                MemberErrorCause.USER_CODE, f"the wrapper or optimizer factory raised while a spare warmed up: {exc}"
            ) from exc
        finally:
            dist.destroy_process_group()
            self.link.progress = replace(self.link.progress, section="")
        self._enter(MemberPhase.SPARE)
        self.log.info("spare warm", warm_up_s=round(time.monotonic() - started, 3))
        if self._landing is not None:
            self._landing.start()

    def obey_newer_rebuild(self) -> None:
        """Between steps: carry out a rebuild newer than this member's generation, if one came."""
        latest, received = self.link.latest_rebuild()
        if latest is not None and latest.generation > self.generation:
            self._take(self._recovery.carry_out(latest, RebuildMarks(received=received)))

    def leave_early(self) -> None:
        """The loop ended before its last step (`break`, an early stop, a time budget). Every rank must
        leave at the same step (a condition they agree on: an all-reduced loss, a step budget). The rank
        says it is done when the script ends (`close`), unless it ends with an uncaught exception: the
        code after the loop runs first, inside a section, so it is not taken for a hang."""
        if self.ended or self.rank is None:
            return
        self._enter(MemberPhase.LEFT_EARLY)
        self._step_open = False
        self.link.progress = replace(self.link.progress, in_step=False, section=LEFT_LOOP_SECTION)
        self.log.info("loop left early; this rank is done when the script ends", step=self.completed_step)

    def finish(self, total_steps: int, replay: bool = True) -> None:
        """After the last step: report done (again every `DONE_RETRANSMIT_S`) until the job finishes
        or a rebuild replays steps (a rank failed right at the end). A loop left early cannot replay
        (`replay` False): this member then leaves, and the rebuild's spare takes its rank."""
        assert self.rank is not None
        self._enter(MemberPhase.FINISHING)
        done = MemberDone(self.config.job, self.generation, self.config.member, self.rank, total_steps)
        deadline = time.monotonic() + FINISH_WAIT_S
        while time.monotonic() < deadline:
            self.link.publish_event(self.link.subjects.member_done, done)
            command = self.link.wait_command(newer_than=self.generation, timeout_s=DONE_RETRANSMIT_S)
            if isinstance(command, Rebuild) and not replay:
                self.log.warning("a rebuild after the loop was left early; leaving", generation=command.generation)
                self._enter(MemberPhase.DONE)
                return
            if isinstance(command, Rebuild):
                _, received = self.link.latest_rebuild()
                self._take(self._recovery.carry_out(command, RebuildMarks(received=received)))
                return
            if isinstance(command, JobFinished):
                self._end(command)
                return
        self.log.warning("no word from the swapper after the last step; finishing", wait_s=FINISH_WAIT_S)
        self._enter(MemberPhase.DONE)

    def close(self) -> None:
        """Release wrappers, the process group and the background threads."""
        if self.phase is MemberPhase.CLOSED:
            return
        if self.phase is MemberPhase.LEFT_EARLY and not hasattr(sys, "last_value"):  # no uncaught exception
            self.finish(self.next_step, replay=False)
        self._enter(MemberPhase.CLOSED)
        self._recovery.close()
        self._leave_group()
        gc.collect()  # free DDP/ZeRO objects before the interpreter tears torch down
        self._worker.close()
        if self._landing is not None:
            self._landing.close()
        if self.config.stats_dir:
            self.stats.write(
                self.config.stats_dir,
                self.config.member,
                {"rank": self.rank} | self._worker.figures() | self._snapshots.figures(),
            )
        self.link.close()
        self._tracing.shutdown()
        self._metrics.shutdown()

    # ------------------------------------------------------------------ steps

    def step_started(self) -> None:
        if self._step_open:  # `with job.step()` inside the loop: the step began at the loop's top
            return
        self._step_open = True
        self.objects.note.clear()
        entered = time.perf_counter()
        self.stats.started(self.next_step, self.generation)
        progress = replace(self.link.progress, in_step=True, step_started_t=time.time())
        if self._first_step_pending and not progress.section:  # it may compile: the first-step threshold
            progress = replace(progress, section=FIRST_STEP_SECTION)
        self.link.progress = progress
        self.stats.stalled(time.perf_counter() - entered)
        if delay := step_delay_s():  # an injected straggler (tests and benchmarks only)
            time.sleep(delay)

    def body_ended(self) -> None:
        """The loop's body ran to its end: the step ends there unless `with job.step()` ended it."""
        if self._step_open:
            self.step_ended()

    def step_ended(self) -> None:
        """The step's code ran to its end: completed, or recovered if a collective of it failed without
        raising (`noting_group`)."""
        if self.objects.note.error is not None:
            self.recover(self.objects.note.error)
        else:
            self._step_completed()

    def recoverable(self, exc: Exception) -> bool:
        return self._recovery.recoverable(exc)

    def recover(self, exc: Exception) -> None:
        """Leave the broken step, then obey the swapper's next rebuild (or the job's end)."""
        self._step_open = False
        self.stats.abandoned()
        self._take(self._recovery.recover(exc))

    def report_fatal(self, exc: BaseException) -> None:
        """An exception in the step that is not the group's: this member cannot go on (a spare takes over)."""
        self._recovery.report_fatal(exc)

    def _step_completed(self) -> None:
        self._step_open = False
        entered = time.perf_counter()
        step = self.next_step + 1
        self.next_step = self.completed_step = step
        try:
            captured = self._snapshots.step_completed(step, self.extra_state)
        except MemberCannotContinueError as exc:
            self._recovery.report_fatal(exc, exc.cause)
            raise
        if self._first_step_pending and self.rank is not None:  # a recovery ends here, as a user feels it
            resumed = StepResumed(self.config.job, self.generation, self.config.member, self.rank, step, time.time())
            if self._first_step_trace is not None:
                parent, ready_t, attrs = self._first_step_trace
                self._tracing.record("first_step", parent, ready_t, resumed.t_completed, attrs | {"step": step})
                self._first_step_trace = None
            self.link.step_resumed(resumed)
        self._first_step_pending = False
        section = self.link.progress.section
        self.link.progress = replace(
            self.link.progress,
            step=step,
            in_step=False,
            snapshots_skipped=self._worker.skipped,
            step_completed_t=time.time(),
            local_step=self._worker.newest_local_step(),
            snapshot_every=self._snapshots.cadence.every(time.monotonic()),
            section="" if section == FIRST_STEP_SECTION else section,
        )
        self.stats.stalled(time.perf_counter() - entered)
        self.stats.completed(captured)

    def _fence_optimizer_step(self) -> None:
        act_on_pending_fault(self._group.abort)  # an injected fault (tests and benchmarks only)
        entered = time.perf_counter()
        self._worker.fence_optimizer_step()
        self.stats.stalled(time.perf_counter() - entered)

    # ------------------------------------------------------------------ what a rebuild changes

    def _adopt(self, result: RebuildResult) -> None:
        """The one place a rebuild's result becomes the member's: its rank, generation, step, stores
        and training objects (called by the rebuild before SEAL, which snapshots as the new rank)."""
        self.objects.adopt(result.model, result.optimizer)
        self.rank, self.world_size, self.generation = result.rank, result.world_size, result.generation
        self._snapshots.place(result.rank, result.world_size, result.generation, list(result.placement))
        self.next_step = self.completed_step = result.step
        self._first_step_pending = True
        if result.extra_state is not None:  # state was restored: `iterate` starts its loader over
            self.restores += 1
            self.extra_state = result.extra_state
        self._worker.forget_after(result.step)
        if self._landing is not None:  # a rank now: a landing its restore did not take is freed
            self._landing.close()

    def _leave_group(self) -> None:
        """Drop the wrappers that hold the process group, then break and destroy the group.

        No garbage collection here: a full collection holds the GIL for a hundred milliseconds and
        more, starving the control thread in the middle of a recovery. The group's connections are
        shut down explicitly instead (see `GenerationGroup`), so nothing depends on the wrappers being
        freed now.
        """
        self.objects.drop()
        self._snapshots.forget_plan()
        self._group.destroy()

    # ------------------------------------------------------------------ figures

    def _step_metrics(self) -> Callable[[dict[str, Any]], None]:
        meter = self._metrics.meter
        duration = meter.create_histogram("deadpool.step.duration", unit="s", description="one training step")
        stall = meter.create_histogram(
            "deadpool.hook.stall", unit="s", description="the training thread's time inside DeadPool, per step"
        )
        captured = meter.create_counter("deadpool.snapshot.bytes", unit="By", description="snapshot bytes captured")

        def attributes() -> dict[str, str | int]:
            return {"job": self.config.job, "rank": -1 if self.rank is None else self.rank}

        self._metrics.gauge(
            "deadpool.member.steps_at_risk",
            "{step}",
            "steps trained since no snapshot store receives this rank's snapshots (0 while one does)",
            lambda: [(float(self._snapshots.steps_at_risk), attributes())],
        )
        self._metrics.gauge(
            "deadpool.snapshot.interval",
            "{step}",
            "the job's snapshot interval as this rank knows it: every K-th step is streamed to the stores",
            lambda: [(float(self._snapshots.cadence.every(time.monotonic())), attributes())],
        )

        def record(step: dict[str, Any]) -> None:
            attrs = attributes()
            duration.record(step["step_s"], attrs)
            stall.record(step["stall_s"], attrs)
            if step["captured"]:
                captured.add(self.stats.snapshot_bytes, attrs)

        return record
