"""The user-facing object: `attach()` returns a `Job`, whose `steps()` and `step()` drive training.

    job = deadpool.attach(model, optimizer=lambda params: make_optimizer(params),
                          wrap=lambda module, pg: DDP(module, process_group=pg, find_unused_parameters=True))
    for step in job.steps(total_steps):
        with job.step():
            loss = loss_fn(job.model(*batch_for(step, job.rank, job.world_size)))
            loss.backward(); job.optimizer.step(); job.optimizer.zero_grad()

Everything a failure needs happens inside these two calls: a spare waits in `steps()` until it is
given a rank; a broken collective inside `step()` is caught, the process group dropped (releasing the
peers), the swapper's rebuild obeyed (roll back or fetch, new group, re-wrap), and `steps()` goes on at
the restored step. The optimizer is built by the job from the factory, once per generation, because a
sharded optimizer needs the generation's process group (and a spare has none until it joins).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import statistics
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import replace
from types import TracebackType
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from deadpool.control_link import Command, ControlLink
from deadpool.cpu_placement import TRAIN_CPUS_ENV, cpus_from_env, pin_this_thread
from deadpool.ddp_check import BucketRebuildError, check_wrapped, find_ddp
from deadpool.durable_tier import DurableWriter
from deadpool.errors import (
    JobFailedError,
    MemberCannotContinueError,
    MemberFencedError,
    RendezvousFailedError,
    RestoreUnavailableError,
    SupersededError,
)
from deadpool.failure_origin import is_collective_error
from deadpool.fault_injection import act_on_pending_fault, arm_from_env, step_delay_s
from deadpool.generation_waits import GenerationWaits
from deadpool.member_config import MemberConfig
from deadpool.member_rebuild import MemberRebuild
from deadpool.noting_group import FailureNote, NotingGroup
from deadpool.process_group import GenerationGroup, Rendezvous, pick_backend
from deadpool.sharded_module import fresh_copy, is_fully_sharded, meta_template
from deadpool.snapshot_layout import SnapshotLayout, plan_layout
from deadpool.snapshot_worker import SnapshotWorker
from deadpool.state_tree import TreeError
from deadpool.step_stats import StepStats
from deadpool.store_client import UploadKey
from deadpool.stuck_watch import StuckCollectiveWatch
from deadpool.training_state import (
    WHOLE,
    Partition,
    SnapshotMeta,
    SnapshotSources,
    StateTree,
    capture_tree,
    collect_sources,
    restore_rng,
    rng_state,
    tensor_state_ids,
)
from deadpool.user_state import UserState
from deadpool_protocol import (
    FIRST_STEP_SECTION,
    NO_RANK,
    NO_STEP,
    GenerationVoid,
    JobFinished,
    MemberDone,
    MemberError,
    MemberErrorCause,
    MemberHello,
    Placement,
    Rebuild,
    StepResumed,
    StoreAddress,
)
from deadpool_runtime.metrics import Metrics
from deadpool_runtime.tracing import Tracing

__all__ = [
    "BucketRebuildError",
    "Job",
    "JobFailedError",
    "MemberCannotContinueError",
    "MemberFencedError",
    "OptimizerFactory",
    "Wrapper",
    "check_wrapped",
]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
Wrapper = Callable[[nn.Module, Any], nn.Module]
T = TypeVar("T")
PlanKey = tuple[tuple[int, ...], Partition, tuple[Any, ...]]

FINISH_WAIT_S = 300.0
UNPROTECTED_LOG_S = 30.0
"""While every store is lost, a member says so this often (the swapper and `deadpool status` too)."""
DONE_RETRANSMIT_S = 1.0
"""After its last step a rank repeats its done report this often until it hears the job finished."""
ERROR_REPORT_WAIT_S = 5.0
STEP_TIMES_KEPT = 16
WARM_UP_SECTION = "warm-up"
"""The section a spare's heartbeats name while it warms up (it is not ready to take a rank yet)."""
LEFT_LOOP_SECTION = "after-the-loop"
"""The section a rank that left its loop early names until its script ends."""
FORM_LEAVE_S = 1.5
"""After a group's creation was broken, how long the training thread may take to leave it."""
GROUP_RETIRE_MARGIN_S = 5.0
"""A dropped process group is freed this long after its collective timeout (see `GenerationGroup`)."""


class _LoadedState:
    """A registered object's state as a rebuild has just loaded it, captured in the object's place."""

    def __init__(self, state: Any) -> None:
        self._state = state

    def state_dict(self) -> Any:
        return self._state


class _StepContext:
    def __init__(self, job: Job) -> None:
        self.job = job

    def __enter__(self) -> None:
        self.job._step_started()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if exc is None:
            self.job._step_ended()
            return False
        if isinstance(exc, Exception) and self.job._recoverable(exc):
            self.job._recover(exc)
            return True  # the step is abandoned; steps() resumes at the restored step
        if isinstance(exc, Exception):
            self.job._report_fatal(exc)
        return False


class Job:
    def __init__(
        self,
        module: nn.Module,
        optimizer: OptimizerFactory | torch.optim.Optimizer,
        wrap: Wrapper | None,
        config: MemberConfig,
        log: Any,
        state: dict[str, Any] | None = None,
    ) -> None:
        pin_this_thread(cpus_from_env(TRAIN_CPUS_ENV))  # the training thread (the threads it starts follow)
        self._own_optimizer = _own_optimizer(module, optimizer)
        """The user's optimizer, kept for the whole run, when one was given rather than a factory."""
        self.module = module
        """The unwrapped model; its parameters are what snapshots hold."""
        self.model: Any = module
        """The model to call in the step: the wrapped one once this member holds a rank (typed Any: it
        is whatever the wrapper returned, so that `job.model.no_sync()` and the like type-check)."""
        self.optimizer: torch.optim.Optimizer | None = None
        self.rank: int | None = None
        """This member's rank, or None while it is a spare."""
        self.world_size = config.world_size
        self.generation = 0
        self.extra_state: dict[str, Any] = {}
        """Small msgpack-able values saved with every snapshot and restored with it."""
        self.config = config
        self.log = log
        self.state = UserState()
        """The objects registered with `register`, by name (schedulers, scalers, data loaders, EMA modules;
        a factory's object once this member holds a rank)."""
        for name, obj in (state or {}).items():
            self.state.register(name, obj)
        if config.rank_hint >= 0 and not config.resume_from:
            self.state.read_once()  # now, before this job starts a thread (see `UserState.read_once`)
        self._param_device = next(iter(module.parameters()), torch.empty(0)).device
        """Where the model's parameters live (a fresh copy of a sharded model is materialised there)."""
        self._template: nn.Module | None = None
        """The model on the meta device, as the user built it: each generation's fresh copy to shard (FSDP2)."""
        self._template_made = False
        self._note = FailureNote()
        """Collective failures of the current step that did not raise (see `noting_group`)."""
        self._left_early = False
        self._step_open = False
        """A step began (at the top of the loop) and has not ended yet."""
        self._first_step_pending = False
        """The next step is this member's first of its generation (set by each rebuild)."""
        self._tracing = Tracing("deadpool-member")
        """Off unless an exporter or `DEADPOOL_TRACE_FILE` is configured (`deadpool_runtime.tracing`)."""
        self._metrics = Metrics("deadpool-member")
        """Off unless an exporter is configured (`deadpool_runtime.metrics`)."""
        self._first_step_trace: tuple[str, float, dict[str, Any]] | None = None
        """(parent context, ready time, attributes) of the `first_step` span a recovery still owes."""
        self._restores = 0
        """Rebuilds that restored state (`iterate` starts its loader over after each)."""
        self._hooked_optimizer: torch.optim.Optimizer | None = None
        """The optimizer whose step pre-hook fences snapshot copies (hooked once per optimizer)."""
        self._factory: OptimizerFactory | None = None if isinstance(optimizer, torch.optim.Optimizer) else optimizer
        self._wrap = wrap
        self._backend = pick_backend(config.backend)
        self._next_step = 0
        self._completed_step = NO_STEP
        self._placement: list[StoreAddress] = []
        self._placement_version = 0
        """Which placement of the generation `_placement` is (the rebuild's is 0; see `Placement`)."""
        self._unprotected: tuple[int, float] | None = None
        """(first step, when it was last said) while no store receives this rank's snapshots."""
        self._steps_at_risk = 0
        """Steps trained since no store receives this rank's snapshots (0 while one does)."""
        self._plan: tuple[PlanKey, SnapshotSources, SnapshotLayout] | None = None
        self._finished = False
        self._closed = False
        self._warm = False
        self._initial_rng = rng_state()
        """The RNG state at attach: where a formation that must be started again starts from."""
        self._waits = GenerationWaits()
        """The training thread's waits of a generation, which the control thread breaks when it is superseded."""
        self._rendezvous = Rendezvous(config.rendezvous_host, config.pg_timeout_s)
        self._group = GenerationGroup(retire_s=config.pg_timeout_s + GROUP_RETIRE_MARGIN_S)
        self.stats = StepStats()
        """Per-step wall time and time spent in the hooks (written to `DEADPOOL_STATS_DIR` at close)."""
        if self._metrics.on:
            self.stats.listener = self._step_metrics()
        durable = (
            DurableWriter(
                config.durable_dir,
                config.job,
                config.durable_every_steps,
                config.durable_keep,
                log,
                config.durable_every_s,
                config.durable_grid_steps,
            )
            if config.durable_dir
            else None
        )
        self._worker = SnapshotWorker(
            log, config.snapshot_chunk_bytes, config.snapshot_stream_nice, config.snapshot_wait_s, durable
        )
        if arm_from_env():
            log.warning(
                "fault injection armed: SIGUSR1 hangs the training thread, SIGUSR2 raises, "
                "SIGURG resets the group's connections, SIGWINCH slows"
            )
        self._link = ControlLink(config, log, on_command=self._on_command, on_placement=self._on_placement)
        if config.rank_hint < 0:  # a spare is not ready to take a rank before it has warmed up
            self._link.progress = replace(self._link.progress, section=WARM_UP_SECTION)
        computes_itself = self._backend == "gloo" and all(p.device.type == "cpu" for p in module.parameters())
        self._stuck = StuckCollectiveWatch(
            self._link, self._report_stuck, log, step_time_s=self._recent_step_s, blocked_means_stuck=computes_itself
        )
        self._link.start(
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
                rendezvous_port=self._rendezvous.port,
                t=time.time(),
                run=config.run,
            )
        )
        self._worker.store_token = self._link.store_token
        atexit.register(self.close)

    # ------------------------------------------------------------------ the public loop

    def steps(self, total_steps: int) -> Iterator[int]:
        """Yield the index of each step to run, from wherever this member's state stands.

        A spare blocks here until it is given a rank (or the job finishes). After a recovery the
        next index is the restored step, so the replayed steps are the same steps. Raises
        `JobFailedError` if the swapper ends the job, and `MemberCannotContinueError` if this member
        cannot carry out a rebuild (both say why).
        """
        if total_steps < 0:
            raise ValueError("total_steps must not be negative")
        if self.rank is None and not self._finished:
            self._join()
        while not self._finished and self.rank is not None:
            self._obey_newer_rebuild()
            if self._next_step >= total_steps:
                self._finish(total_steps)
                continue
            self._step_started()  # the loop body is the step, with or without `with job.step()`
            try:
                yield self._next_step
            except GeneratorExit:  # the loop was left early (`break`, an early stop, a time budget)
                self._leave_early()
                raise
            if self._step_open:  # the body ran without `with job.step()`
                self._step_ended()

    def register(self, name: str, obj: Any) -> Any:
        """Capture `obj`'s state with every snapshot and restore it at every rebuild; returns `obj`.

        `obj`: anything with `state_dict()`/`load_state_dict()` (a scheduler of your own optimizer,
        a `torch.amp.GradScaler`, a `StatefulDataLoader`, an EMA module), or a factory
        `optimizer -> object` for objects bound to an optimizer the job builds from a factory
        (`job.state[name]` is then the current generation's). Register before the first step: every
        member, spares too, registers the same names.
        """
        if self.rank is not None or self._completed_step != NO_STEP:
            raise RuntimeError(f"register {name!r} before the job's first step: every snapshot must hold it")
        self.state.register(name, obj)
        if self.config.rank_hint >= 0 and not self.config.resume_from:
            self.state.read_once(name)  # now, not inside the first rebuild (see `UserState.read_once`)
        return obj

    def iterate(self, loader: Iterable[T]) -> Iterator[T]:
        """Batches of `loader` (registered with the job, e.g. a `StatefulDataLoader`), epoch after
        epoch, for as long as the loop asks. After every rebuild that restored state it starts over
        from `iter(loader)`, which resumes where the restored loader state says: the batch after the
        restored step's, on survivors and spares alike.

            batches = job.iterate(loader)
            for step in job.steps(total_steps):
                x, y = next(batches)
        """
        if not any(obj is loader for obj in self.state.values()):
            raise ValueError("iterate() a loader registered with the job: its state must be captured to be resumed")
        resuming = self._restores > 0  # a spare's first batches come from the state it was given
        while True:
            restores, empty = self._restores, True
            if resuming:  # the run that never stopped made no new iterator here: leave its RNG alone
                kept = rng_state()
                batches = iter(loader)
                restore_rng(kept)
            else:
                batches = iter(loader)  # a new epoch: seeds drawn as in the run that never stopped
            for batch in batches:
                empty = False
                yield batch
                if self._restores != restores:
                    break
            resuming = self._restores != restores  # the loader's state was restored: resume from it
            if empty and not resuming:
                raise ValueError("the loader yields no batches")

    def step(self) -> _StepContext:
        """Context for one training step; a broken collective inside it is handled, not raised.

        Keep the step's work inside the block: when a step is abandoned, the code after the block
        still runs once before `steps()` moves to the restored step.
        """
        if self.rank is None:
            raise RuntimeError("step() outside steps(): this member holds no rank")
        return _StepContext(self)

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Mark work between steps that takes long and is not stuck (an evaluation, a checkpoint):
        the detector expects no step progress inside it. Heartbeats go on, so a process that dies
        or freezes inside a section is still caught; only the hang rule is suspended.

            if step % 1000 == 0:
                with job.section("evaluation"):
                    evaluate(job.model)
        """
        if not name:
            raise ValueError("a section needs a name (it appears in the detector's evidence)")
        self._link.progress = replace(self._link.progress, section=name)
        try:
            yield
        finally:
            self._link.progress = replace(self._link.progress, section="")

    def _step_metrics(self) -> Callable[[dict[str, Any]], None]:
        meter = self._metrics.meter
        duration = meter.create_histogram("deadpool.step.duration", unit="s", description="one training step")
        stall = meter.create_histogram(
            "deadpool.hook.stall", unit="s", description="the training thread's time inside DeadPool, per step"
        )
        captured = meter.create_counter("deadpool.snapshot.bytes", unit="By", description="snapshot bytes captured")
        self._metrics.gauge(
            "deadpool.member.steps_at_risk",
            "{step}",
            "steps trained since no snapshot store receives this rank's snapshots (0 while one does)",
            lambda: [
                (float(self._steps_at_risk), {"job": self.config.job, "rank": -1 if self.rank is None else self.rank})
            ],
        )

        def record(step: dict[str, Any]) -> None:
            attrs: dict[str, str | int] = {"job": self.config.job, "rank": -1 if self.rank is None else self.rank}
            duration.record(step["step_s"], attrs)
            stall.record(step["stall_s"], attrs)
            if step["captured"]:
                captured.add(self.stats.snapshot_bytes, attrs)

        return record

    def close(self) -> None:
        """Release wrappers, the process group and the background threads (also runs at exit)."""
        if self._closed:
            return
        if self._left_early and not self._finished and not hasattr(sys, "last_value"):  # no uncaught exception
            self._finish(self._next_step, replay=False)
        self._closed = True
        self._stuck.close()
        self._leave_group()
        gc.collect()  # free DDP/ZeRO objects before the interpreter tears torch down
        self._worker.close()
        if self.config.stats_dir:
            worker = self._worker
            extra = {
                "rank": self.rank,
                "snapshots_skipped": worker.skipped,
                "snapshot_waits": worker.waits,
                "durable_persisted": worker.durable.persisted if worker.durable else 0,
                "durable_skipped": worker.durable.skipped if worker.durable else 0,
                "durable_bytes": worker.durable.bytes_written if worker.durable else 0,
                "durable_s": worker.durable.seconds if worker.durable else 0.0,
                "durable_failed": worker.durable.failed if worker.durable else 0,
                "durable_disk_full": worker.durable.disk_full if worker.durable else 0,
                "snapshots_streamed": worker.captures,
                "snapshot_copy_cpu_s": worker.copy_cpu_s,
                "snapshot_stream_cpu_s": worker.stream_cpu_s,
                "snapshot_copy_gpu_s": worker.copy_gpu_s,
                "snapshot_copy_gpu_bytes": worker.copy_gpu_bytes,
            }
            self.stats.write(self.config.stats_dir, self.config.member, extra)
        self._link.close()
        self._tracing.shutdown()
        self._metrics.shutdown()

    # ------------------------------------------------------------------ joining and finishing

    def _join(self) -> None:
        if self.config.rank_hint < 0 and self._link.finished() is None:
            self._warm_up()
        while True:  # a spare waits for the job: it ends with a rank, or with the job
            command = self._link.wait_command(newer_than=self.generation, timeout_s=None)
            if isinstance(command, JobFinished) or command is None:
                self._end(command)
                return
            _, received = self._link.latest_rebuild()
            if self._apply_rebuild(command, {"received": received}):
                return

    def _warm_up(self) -> None:
        """A spare builds its wrapper and optimizer once in a one-process group, so that the imports
        and lazy initialisation they trigger (seconds under load) are paid before it is needed."""
        if self._warm:
            return
        started = time.monotonic()
        self._link.progress = replace(self._link.progress, section=WARM_UP_SECTION)
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            module, _ = self._module_to_wrap()
            wrapped = self._wrap(module, self._group_for_wrap(dist.group.WORLD)) if self._wrap else module
            if self._factory is not None:  # the user's own optimizer is left alone
                optimizer = self._factory(list(self.module.parameters()))
                self.state.bind(optimizer)
                del optimizer
            del wrapped
            gc.collect()
        except Exception as exc:  # the same code will run at the rebuild: say so now, with the reason
            self._report_fatal(exc, MemberErrorCause.USER_CODE)
            raise MemberCannotContinueError(
                MemberErrorCause.USER_CODE, f"the wrapper or optimizer factory raised while a spare warmed up: {exc}"
            ) from exc
        finally:
            dist.destroy_process_group()
            self._link.progress = replace(self._link.progress, section="")
        self._warm = True
        self.log.info("spare warm", warm_up_s=round(time.monotonic() - started, 3))

    def _module_to_wrap(self) -> tuple[nn.Module, bool]:
        """The module the next wrap gets, and whether it is a fresh copy: the model itself, unless
        `fully_shard` sharded it over an older group (see `sharded_module`)."""
        if not self._template_made:  # the first wrap: keep a template of the model as the user built it
            self._template_made = True
            try:
                self._template = meta_template(self.module)
            except Exception as exc:  # an FSDP job then cannot rebuild; it says so when it must
                self.log.info("no meta template of the model", error=repr(exc)[:300])
            return self.module, False
        if not is_fully_sharded(self.module):
            return self.module, False
        if self._template is None:
            raise MemberCannotContinueError(
                MemberErrorCause.USER_CODE, "the model is sharded with fully_shard, and it could not be deep-copied"
            )
        return fresh_copy(self._template), True

    def _leave_early(self) -> None:
        """The loop ended before its last step (`break`, an early stop, a time budget). Every rank must
        leave at the same step (a condition they agree on: an all-reduced loss, a step budget). The rank
        says it is done when the script ends (`close`), unless it ends with an uncaught exception: the
        code after the loop runs first, inside a section, so it is not taken for a hang."""
        if self._finished or self.rank is None or self._closed:
            return
        self._left_early = True
        self._step_open = False
        self._link.progress = replace(self._link.progress, in_step=False, section=LEFT_LOOP_SECTION)
        self.log.info("loop left early; this rank is done when the script ends", step=self._completed_step)

    def _finish(self, total_steps: int, replay: bool = True) -> None:
        """After the last step: report done (again every `DONE_RETRANSMIT_S`) until the job finishes
        or a rebuild replays steps (a rank failed right at the end). A loop left early cannot replay
        (`replay` False): this member then leaves, and the rebuild's spare takes its rank."""
        assert self.rank is not None
        done = MemberDone(self.config.job, self.generation, self.config.member, self.rank, total_steps)
        deadline = time.monotonic() + FINISH_WAIT_S
        while time.monotonic() < deadline:
            self._link.publish_event(self._link.subjects.member_done, done)
            command = self._link.wait_command(newer_than=self.generation, timeout_s=DONE_RETRANSMIT_S)
            if isinstance(command, Rebuild) and not replay:
                self.log.warning("a rebuild after the loop was left early; leaving", generation=command.generation)
                self._finished = True
                return
            if isinstance(command, Rebuild):
                _, received = self._link.latest_rebuild()
                self._apply_rebuild(command, {"received": received})
                return
            if isinstance(command, JobFinished):
                self._end(command)
                return
        self.log.warning("no word from the swapper after the last step; finishing", wait_s=FINISH_WAIT_S)
        self._finished = True

    def _end(self, finished: JobFinished | None) -> None:
        self._finished = True
        if finished is not None and finished.failed:
            raise JobFailedError(f"the job was ended by the swapper: {finished.reason}")

    # ------------------------------------------------------------------ steps and snapshots

    def _step_ended(self) -> None:
        """The step's code ran to its end: completed, or recovered if a collective of it failed without
        raising (`noting_group`)."""
        if self._note.error is not None:
            self._recover(self._note.error)
        else:
            self._step_completed()

    def _step_started(self) -> None:
        if self._step_open:  # `with job.step()` inside the loop: the step began at the loop's top
            return
        self._step_open = True
        self._note.clear()
        entered = time.perf_counter()
        self.stats.started(self._next_step, self.generation)
        progress = replace(self._link.progress, in_step=True, step_started_t=time.time())
        if self._first_step_pending and not progress.section:  # it may compile: the first-step threshold
            progress = replace(progress, section=FIRST_STEP_SECTION)
        self._link.progress = progress
        self.stats.stalled(time.perf_counter() - entered)
        if delay := step_delay_s():  # an injected straggler (tests and benchmarks only)
            time.sleep(delay)

    def _step_completed(self) -> None:
        self._step_open = False
        entered = time.perf_counter()
        step = self._next_step + 1
        self._next_step = self._completed_step = step
        every = self.config.snapshot_every
        try:
            captured = every > 0 and step % every == 0 and self._capture(step) is not None
        except MemberCannotContinueError as exc:
            self._report_fatal(exc, exc.cause)
            raise
        if self._first_step_pending and self.rank is not None:  # a recovery ends here, as a user feels it
            resumed = StepResumed(self.config.job, self.generation, self.config.member, self.rank, step, time.time())
            if self._first_step_trace is not None:
                parent, ready_t, attrs = self._first_step_trace
                self._tracing.record("first_step", parent, ready_t, resumed.t_completed, attrs | {"step": step})
                self._first_step_trace = None
            self._link.publish_event(self._link.subjects.step_resumed, resumed)
        self._first_step_pending = False
        section = self._link.progress.section
        self._link.progress = replace(
            self._link.progress,
            step=step,
            in_step=False,
            snapshots_skipped=self._worker.skipped,
            step_completed_t=time.time(),
            section="" if section == FIRST_STEP_SECTION else section,
        )
        self.stats.stalled(time.perf_counter() - entered)
        self.stats.completed(captured)

    def _fence_optimizer_step(self) -> None:
        act_on_pending_fault(self._group.abort)  # an injected fault (tests and benchmarks only)
        entered = time.perf_counter()
        self._worker.fence_optimizer_step()
        self.stats.stalled(time.perf_counter() - entered)

    def _partition(self) -> Partition:
        """Snapshot only a share of the parameters when they are replicated (data parallelism)."""
        replicated = find_ddp(self.model) is not None and self.config.snapshot_partition
        if not replicated or self.rank is None or self.world_size < 2:
            return WHOLE
        return Partition(self.rank, self.world_size)

    def _sources(self, tree: StateTree) -> tuple[SnapshotSources, SnapshotLayout]:
        """The snapshot's plan: made again whenever the optimizer's state tensors are other tensors
        (state appeared, or was replaced) or the state tree's tensors changed shape; otherwise only
        the tree's tensors of this capture are put in."""
        partition = self._partition()
        key: PlanKey = (tensor_state_ids(self.optimizer), partition, tree.signature)
        if self._plan is None or self._plan[0] != key:
            sources = collect_sources(self.module, self.optimizer, partition, tree)
            layout = plan_layout(list(zip(sources.names, sources.tensors, strict=True)))
            self._plan = (key, sources, layout)
            self.stats.snapshot_bytes, self.stats.snapshot_bytes_whole = layout.total_bytes, sources.whole_bytes
        _, sources, layout = self._plan
        sources.take_tree(tree.tensors)
        return sources, layout

    def _capture(self, step: int, loaded: Mapping[str, Any] | None = None) -> Any:
        """Start the snapshot of `step`. `loaded`: the registered objects' states a rebuild has just
        loaded, captured as they are rather than read back (a resumed formation's SEAL: a data loader
        given a state has no iterator until the loop iterates it, and reading its state would fork
        its workers inside the rebuild; see `UserState.read_once`)."""
        assert self.rank is not None
        self._adopt_placement()
        user = self.state if loaded is None else {name: _LoadedState(state) for name, state in loaded.items()}
        try:
            tree = capture_tree(self.module, self.optimizer, user)
        except TreeError as exc:  # every member would meet it: end the job, saying what cannot be held
            raise MemberCannotContinueError(MemberErrorCause.USER_CODE, f"state cannot be snapshotted: {exc}") from exc
        sources, layout = self._sources(tree)
        meta = SnapshotMeta.capture(step, layout, tree, sources, self.extra_state).encode()
        key = UploadKey(self.config.job, self.generation, self.rank, self.config.member, step)
        self._say_if_unprotected(step)
        durable = self._worker.durable
        persist = self.world_size if durable is not None and durable.due(step) else 0
        return self._worker.capture(key, layout, sources, meta, self._placement, persist)

    def _adopt_placement(self) -> None:
        """Stream from now on where the swapper's newest placement of this generation says (a store was
        lost, or one came back): no rebuild, the next snapshot simply goes elsewhere."""
        newest = self._link.latest_placement()
        if newest is None or newest.generation != self.generation or newest.version <= self._placement_version:
            return
        assert self.rank is not None
        addresses = {s.store: s for s in newest.stores}
        self._placement = [addresses[name] for name in newest.placement[self.rank]]
        self._placement_version = newest.version
        self.log.info(
            "snapshots placed anew",
            version=newest.version,
            stores=[s.store for s in self._placement],
            why=newest.reason,
        )

    def _say_if_unprotected(self, step: int) -> None:
        """While no store receives this rank's snapshots (every store was lost), say so every
        `UNPROTECTED_LOG_S`, with how many steps have been trained since: a lost rank would restore
        from the durable tier, if the job has one."""
        if self._placement:
            if self._unprotected is not None:
                self.log.warning("snapshots reach a store again", step=step, unprotected_since=self._unprotected[0])
            self._unprotected = None
            self._steps_at_risk = 0
            return
        now = time.monotonic()
        if self._unprotected is None:
            self._unprotected = (step, now - UNPROTECTED_LOG_S)
        since, said = self._unprotected
        self._steps_at_risk = step - since + 1
        if now - said >= UNPROTECTED_LOG_S:
            self._unprotected = (since, now)
            self.log.warning(
                "training unprotected: no snapshot store receives this rank's snapshots",
                step=step,
                since_step=since,
                steps_at_risk=step - since + 1,
                durable_tier=self._worker.durable is not None,
            )

    def _on_placement(self, placement: Placement) -> None:
        """Control thread: uploads to stores this rank's snapshots no longer go to are abandoned now
        (one blocked on a lost host would otherwise hold the stream until its socket timeout)."""
        rank = self.rank
        if rank is None or placement.generation != self.generation or rank >= len(placement.placement):
            return
        self._worker.drop_stores(keep=set(placement.placement[rank]))

    # ------------------------------------------------------------------ failures and rebuilds

    def _recoverable(self, exc: Exception) -> bool:
        noted = self._note.error is not None  # the group broke in this step: what followed is its consequence
        return noted or is_collective_error(exc) or self._waits.superseded(self.generation)

    def _group_for_wrap(self, group: Any) -> Any:
        """What the wrapper gets: for `deadpool.ddp`, the group that notes its failures (`noting_group`)."""
        return NotingGroup(group, self._note) if getattr(self._wrap, "notes_failures", False) else group

    def _recover(self, exc: Exception) -> None:
        """Leave the broken step: break the group (releasing peers), then obey the swapper's next rebuild."""
        marks = {"out": time.time()}
        self._step_open = False
        self.stats.abandoned()
        self._link.progress = replace(self._link.progress, in_step=False, awaiting_rebuild=True)  # out of the step
        self._leave_group()
        self.log.warning(
            "collective failed; group dropped, waiting for a rebuild",
            generation=self.generation,
            rank=self.rank,
            step=self._next_step,
            error=str(exc)[:300],
        )
        command = self._link.wait_command(newer_than=self.generation, timeout_s=self.config.rebuild_wait_s)
        if isinstance(command, JobFinished):
            self._end(command)
            return
        if not isinstance(command, Rebuild):
            self._report_fatal(exc)
            raise RuntimeError(
                f"a collective failed and no rebuild came within {self.config.rebuild_wait_s} s"
            ) from exc
        latest, received = self._link.latest_rebuild()
        assert latest is not None
        marks["received"] = received
        self._apply_rebuild(latest, marks)

    def _on_command(self, command: Command) -> None:
        """Control thread, the moment a newer rebuild, a void notice or the job's end arrives: every
        wait of a generation that can no longer form is broken now (rendezvous, process-group creation,
        fetches), and so is our old group, so a training thread blocked in a collective gets out
        without waiting for any peer."""
        if isinstance(command, Rebuild):
            broken = self._waits.supersede(newest=command.generation)
            below = command.generation
        elif isinstance(command, GenerationVoid):
            broken = self._waits.supersede(void=command.generation)
            below = command.generation + 1
        else:
            broken = self._waits.supersede(ended=True)
            below = 2**62
        forming = self._group.forming_generation()
        if self._group.abort(below_generation=below):
            self.log.info("process group aborted", generation=self.generation, by=command.KIND)
            self._stuck.watch(self.generation)
            if forming is not None and forming < below:
                self._watch_creation_leaves(forming)
        if broken:
            self.log.info("waits of a superseded generation broken", waits=broken, by=command.KIND)

    def _obey_newer_rebuild(self) -> None:
        latest, received = self._link.latest_rebuild()
        if latest is not None and latest.generation > self.generation:
            self._apply_rebuild(latest, {"received": received})

    def _apply_rebuild(self, command: Rebuild, marks: dict[str, float]) -> bool:
        """Carry out `command`, or the newer one that supersedes it. Returns True if this member holds
        a rank in the end. Raises MemberFencedError if it was replaced, MemberCannotContinueError
        (after reporting it) if it cannot carry the rebuild out, JobFailedError if the job ended."""
        while True:
            self._stuck.clear()
            rebuild = MemberRebuild(self, command, marks)
            try:
                return rebuild.run()
            except RestoreUnavailableError as exc:
                self._leave_group()
                rebuild.report_unavailable(str(exc))
            except SupersededError:
                self._leave_group()
                self.log.info("generation superseded during its rebuild", generation=command.generation)
            except RendezvousFailedError as exc:
                self._leave_group()
                self._link.progress = replace(self._link.progress, rebuilding=False, awaiting_rebuild=True)
                self.log.warning(
                    "rendezvous failed; waiting for the next command",
                    generation=command.generation,
                    error=str(exc)[:300],
                )
            except MemberCannotContinueError as exc:
                self._leave_group()
                self._report_fatal(exc, exc.cause)
                raise
            newer = self._link.wait_command(newer_than=command.generation, timeout_s=self.config.rebuild_wait_s)
            if isinstance(newer, JobFinished):
                self._end(newer)
                return False
            if newer is None:
                raise RuntimeError(f"generation {command.generation} could not form and none replaced it")
            latest, received = self._link.latest_rebuild()
            command = latest or newer
            marks = {k: v for k, v in marks.items() if k == "out"} | {"received": received}

    def _leave_group(self) -> None:
        """Drop the wrappers that hold the process group, then break and destroy the group.

        No garbage collection here: a full collection holds the GIL for a hundred milliseconds and
        more, starving the control thread in the middle of a recovery. The group's connections are
        shut down explicitly instead (see `GenerationGroup`), so nothing depends on the wrappers being
        freed now.
        """
        self.model = self.module
        self.optimizer = self._own_optimizer
        self._plan = None
        self._group.destroy()

    def _watch_creation_leaves(self, generation: int) -> None:
        """Control thread: the creation of `generation`'s group was just broken, which fails it at once
        unless gloo is retrying a connection to a peer that died (ECONNREFUSED, no socket to break: it
        retries until the collective timeout). Seen once in 50 chaos faults, holding the next generation
        for 20 s. If the training thread is still creating that group after `FORM_LEAVE_S`, this member
        exits, saying why, and the swapper replaces it with a spare."""

        def check() -> None:
            if self._group.forming_generation() == generation and not self._closed:
                self._report_stuck(generation)

        timer = threading.Timer(FORM_LEAVE_S, check)
        timer.daemon = True
        timer.start()

    def _recent_step_s(self) -> float:
        recent = [s["step_s"] for s in self.stats.steps[-STEP_TIMES_KEPT:]]
        return statistics.median(recent) if recent else 0.0

    def _report_stuck(self, generation: int) -> None:
        """Control thread: the training thread is still inside a collective of `generation` long
        after its group was broken (gloo cannot interrupt a send whose peer left). Say so and exit,
        so that the swapper replaces this member instead of waiting for the collective timeout."""
        error = RuntimeError(f"stuck in a collective of generation {generation} that its broken group did not release")
        self._report_fatal(error)
        self.log.error("exiting: stuck in a collective the abort could not release", generation=generation)
        os._exit(3)

    def _report_fatal(self, exc: BaseException, cause: str = MemberErrorCause.STEP) -> None:
        """Tell the detector we cannot go on, and why, before we stop (bounded wait for it to be stored)."""
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        error = MemberError(
            self.config.job,
            self.generation,
            self.config.member,
            self.rank if self.rank is not None else NO_RANK,
            text[:2000],
            time.time(),
            cause,
        )
        try:
            self._link.publish_event(self._link.subjects.member_error, error).result(ERROR_REPORT_WAIT_S)
        except Exception as report_exc:
            self.log.warning("error report not sent", error=repr(report_exc))


def _own_optimizer(
    module: nn.Module, optimizer: OptimizerFactory | torch.optim.Optimizer
) -> torch.optim.Optimizer | None:
    """The user's own optimizer, checked, if `optimizer` is one rather than a factory."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        if not callable(optimizer):
            raise TypeError("optimizer must be an optimizer over the model's parameters, or a factory of one")
        return None
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        raise TypeError(
            "a ZeroRedundancyOptimizer needs each generation's process group: pass a factory "
            "(optimizer=lambda params: ZeroRedundancyOptimizer(params, ...)) and the job builds it"
        )
    own = {id(p) for p in module.parameters()}
    if any(id(p) not in own for group in optimizer.param_groups for p in group["params"]):
        raise ValueError("the optimizer holds parameters that are not the model's: build it over model.parameters()")
    return optimizer
