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
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import replace
from types import TracebackType
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from deadpool.control_link import ControlLink, Progress
from deadpool.fault_injection import act_on_pending_fault, arm_from_env, step_delay_s
from deadpool.member_config import MemberConfig
from deadpool.process_group import GenerationGroup, Rendezvous, is_collective_error, pick_backend
from deadpool.replica_exchange import exchange_partitions
from deadpool.snapshot_layout import FlatBuffer, SnapshotLayout, plan_layout
from deadpool.snapshot_worker import SnapshotWorker
from deadpool.step_stats import StepStats
from deadpool.store_client import StoreClientError, StoreConnection, UploadKey
from deadpool.training_state import (
    WHOLE,
    Partition,
    SnapshotMeta,
    SnapshotSources,
    collect_sources,
    load_module,
    load_optimizer,
    local_optimizer,
    restore_rng,
)
from deadpool_protocol import (
    NO_RANK,
    NO_STEP,
    JobFinished,
    MemberDone,
    MemberError,
    MemberHello,
    Rebuild,
    RebuildAck,
    StoreAddress,
)

__all__ = [
    "BucketRebuildError",
    "Job",
    "MemberFencedError",
    "OptimizerFactory",
    "SnapshotUnavailableError",
    "Wrapper",
]

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
Wrapper = Callable[[nn.Module, Any], nn.Module]

FORMATION_SNAPSHOT_WAIT_S = 120.0
FINISH_WAIT_S = 300.0
ERROR_REPORT_WAIT_S = 2.0
GROUP_RETIRE_MARGIN_S = 5.0
"""A dropped process group is freed this long after its collective timeout (see `GenerationGroup`)."""


class MemberFencedError(RuntimeError):
    """This member was declared failed and replaced; it must not touch the job's collectives again."""


class SnapshotUnavailableError(RuntimeError):
    """No store could provide the snapshot a rebuild asked for."""


class BucketRebuildError(ValueError):
    """A DDP wrapper that rebuilds its gradient buckets would break bit-identical recovery."""


def check_wrapped(model: nn.Module) -> None:
    """Refuse DDP settings that make results after a swap differ from an uninterrupted run.

    DDP rebuilds its gradient buckets after the first iteration, in gradient-ready order. After a swap
    every rank re-wraps (its process group changed), and a fresh wrapper starts from the initial
    layout: the first step after the swap then reduces gradients grouped differently from the
    uninterrupted run, and floating-point sums come out different in the last bits.
    `find_unused_parameters=True` (without `static_graph`) keeps the initial layout for the whole run,
    on every rank and in every generation, so every run reduces the same way.
    """
    if isinstance(model, DistributedDataParallel) and (not model.find_unused_parameters or model.static_graph):
        raise BucketRebuildError(
            "DistributedDataParallel rebuilds its gradient buckets after the first iteration, so a rank "
            "re-wrapped after a swap would reduce gradients in a different order and the weights would "
            "no longer be bit-identical to an uninterrupted run. Wrap with "
            "DDP(module, process_group=pg, find_unused_parameters=True) (and without static_graph): it "
            "keeps one bucket layout for the whole run, at the cost of one autograd-graph traversal per step."
        )


class _RendezvousFailedError(Exception):
    """The generation's process group could not be formed (the cause is chained)."""


class _StepContext:
    def __init__(self, job: Job) -> None:
        self.job = job

    def __enter__(self) -> None:
        self.job._step_started()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if exc is None:
            self.job._step_completed()
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
        optimizer: OptimizerFactory,
        wrap: Wrapper | None,
        config: MemberConfig,
        log: Any,
    ) -> None:
        if not callable(optimizer):
            raise TypeError("optimizer must be a factory: a function taking the parameters and returning an optimizer")
        self.module = module
        """The unwrapped model; its parameters are what snapshots hold."""
        self.model: nn.Module = module
        """The model to call in the step: the wrapped one once this member holds a rank."""
        self.optimizer: torch.optim.Optimizer | None = None
        self.rank: int | None = None
        """This member's rank, or None while it is a spare."""
        self.world_size = config.world_size
        self.generation = 0
        self.extra_state: dict[str, Any] = {}
        """Small msgpack-able values saved with every snapshot and restored with it."""
        self.config = config
        self.log = log
        self._factory = optimizer
        self._wrap = wrap
        self._backend = pick_backend(config.backend)
        self._next_step = 0
        self._completed_step = NO_STEP
        self._placement: list[StoreAddress] = []
        self._plan: tuple[int, int, SnapshotSources, SnapshotLayout] | None = None
        self._finished = False
        self._closed = False
        self._warm = False
        self._rendezvous = Rendezvous(config.rendezvous_host, config.pg_timeout_s)
        self._group = GenerationGroup(retire_s=config.pg_timeout_s + GROUP_RETIRE_MARGIN_S)
        self.stats = StepStats()
        """Per-step wall time and time spent in the hooks (written to `DEADPOOL_STATS_DIR` at close)."""
        self._worker = SnapshotWorker(log, config.snapshot_chunk_bytes, config.snapshot_stream_nice)
        if arm_from_env():
            log.warning(
                "fault injection armed: SIGUSR1 hangs the training thread, SIGUSR2 raises, "
                "SIGURG resets the group's connections, SIGWINCH slows"
            )
        self._link = ControlLink(config, log, on_rebuild=self._on_rebuild_announced)
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
            )
        )
        atexit.register(self.close)

    # ------------------------------------------------------------------ the public loop

    def steps(self, total_steps: int) -> Iterator[int]:
        """Yield the index of each step to run, from wherever this member's state stands.

        A spare blocks here until it is given a rank (or the job finishes). After a recovery the
        next index is the restored step, so the replayed steps are the same steps.
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
            yield self._next_step

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

    def close(self) -> None:
        """Release wrappers, the process group and the background threads (also runs at exit)."""
        if self._closed:
            return
        self._closed = True
        self._leave_group()
        gc.collect()  # free DDP/ZeRO objects before the interpreter tears torch down
        self._worker.close()
        if self.config.stats_dir:
            worker = self._worker
            extra = {
                "rank": self.rank,
                "snapshots_skipped": worker.skipped,
                "snapshots_streamed": worker.captures,
                "snapshot_copy_cpu_s": worker.copy_cpu_s,
                "snapshot_stream_cpu_s": worker.stream_cpu_s,
            }
            self.stats.write(self.config.stats_dir, self.config.member, extra)
        self._link.close()

    # ------------------------------------------------------------------ joining and finishing

    def _join(self) -> None:
        if self.config.rank_hint < 0:
            self._warm_up()
        while True:
            command = self._link.wait_command(newer_than=self.generation, timeout_s=None)
            if isinstance(command, JobFinished) or command is None:
                self._finished = True
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
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        try:
            wrapped = self._wrap(self.module, dist.group.WORLD) if self._wrap else self.module
            optimizer = self._factory(list(self.module.parameters()))
            del wrapped, optimizer
            gc.collect()
        finally:
            dist.destroy_process_group()
        self._warm = True
        self.log.info("spare warm", warm_up_s=round(time.monotonic() - started, 3))

    def _finish(self, total_steps: int) -> None:
        assert self.rank is not None
        done = MemberDone(self.config.job, self.generation, self.config.member, self.rank, total_steps)
        self._link.publish(self._link.subjects.member_done, done)
        command = self._link.wait_command(newer_than=self.generation, timeout_s=FINISH_WAIT_S)
        if isinstance(command, Rebuild):
            _, received = self._link.latest_rebuild()
            self._apply_rebuild(command, {"received": received})
            return
        if command is None:
            self.log.warning("no word from the swapper after the last step; finishing", wait_s=FINISH_WAIT_S)
        self._finished = True

    # ------------------------------------------------------------------ steps and snapshots

    def _step_started(self) -> None:
        entered = time.perf_counter()
        self.stats.started(self._next_step, self.generation)
        self._link.progress = replace(self._link.progress, in_step=True, step_started_t=time.time())
        self.stats.stalled(time.perf_counter() - entered)
        if delay := step_delay_s():  # an injected straggler (tests and benchmarks only)
            time.sleep(delay)

    def _step_completed(self) -> None:
        entered = time.perf_counter()
        step = self._next_step + 1
        self._next_step = self._completed_step = step
        every = self.config.snapshot_every
        captured = every > 0 and step % every == 0 and self._capture(step) is not None
        self._link.progress = replace(
            self._link.progress, step=step, in_step=False, snapshots_skipped=self._worker.skipped
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
        replicated = isinstance(self.model, DistributedDataParallel) and self.config.snapshot_partition
        if not replicated or self.rank is None or self.world_size < 2:
            return WHOLE
        return Partition(self.rank, self.world_size)

    def _sources(self) -> tuple[SnapshotSources, SnapshotLayout]:
        local = local_optimizer(self.optimizer) if self.optimizer is not None else None
        key = (id(local), len(local.state) if local is not None else 0)
        if self._plan is None or self._plan[:2] != key:
            sources = collect_sources(self.module, self.optimizer, self._partition())
            layout = plan_layout(list(zip(sources.names, sources.tensors, strict=True)))
            self._plan = (*key, sources, layout)
            self.stats.snapshot_bytes, self.stats.snapshot_bytes_whole = layout.total_bytes, sources.whole_bytes
        return self._plan[2], self._plan[3]

    def _capture(self, step: int) -> Any:
        assert self.rank is not None
        sources, layout = self._sources()
        meta = SnapshotMeta.capture(step, layout, self.optimizer, sources, self.extra_state).encode()
        key = UploadKey(self.config.job, self.generation, self.rank, self.config.member, step)
        return self._worker.capture(key, layout, sources, meta, self._placement)

    # ------------------------------------------------------------------ failures and rebuilds

    def _recoverable(self, exc: Exception) -> bool:
        latest, _ = self._link.latest_rebuild()
        return is_collective_error(exc) or (latest is not None and latest.generation > self.generation)

    def _recover(self, exc: Exception) -> None:
        """Leave the broken step: break the group (releasing peers), then obey the swapper's rebuild."""
        marks = {"out": time.time()}
        self.stats.abandoned()
        self._leave_group()
        self._link.progress = replace(self._link.progress, in_step=False, awaiting_rebuild=True)
        self.log.warning(
            "collective failed; group dropped, waiting for a rebuild",
            generation=self.generation,
            rank=self.rank,
            step=self._next_step,
            error=str(exc)[:300],
        )
        command = self._link.wait_command(newer_than=self.generation, timeout_s=self.config.rebuild_wait_s)
        if not isinstance(command, Rebuild):
            self._report_fatal(exc)
            raise RuntimeError(
                f"a collective failed and no rebuild came within {self.config.rebuild_wait_s} s"
            ) from exc
        latest, received = self._link.latest_rebuild()
        assert latest is not None
        marks["received"] = received
        self._apply_rebuild(latest, marks)

    def _on_rebuild_announced(self, command: Rebuild) -> None:
        """Control thread, the moment a newer generation is announced: break our old group now, so a
        training thread blocked in a collective gets out without waiting for any peer."""
        if self._group.abort(below_generation=command.generation):
            self.log.info("old process group aborted", generation=self.generation, new_generation=command.generation)

    def _obey_newer_rebuild(self) -> None:
        latest, received = self._link.latest_rebuild()
        if latest is not None and latest.generation > self.generation:
            self._apply_rebuild(latest, {"received": received})

    def _apply_rebuild(self, command: Rebuild, marks: dict[str, float]) -> bool:
        """Carry out `command`, or the newer one that replaces it if its rendezvous cannot complete
        (a member of it died meanwhile). Returns True if this member holds a rank in the end."""
        while True:
            try:
                return self._rebuild_once(command, marks)
            except _RendezvousFailedError as exc:
                self.log.warning(
                    "rendezvous failed; waiting for a newer generation",
                    generation=command.generation,
                    error=str(exc.__cause__)[:300],
                )
                newer = self._link.wait_command(newer_than=command.generation, timeout_s=self.config.rebuild_wait_s)
                if not isinstance(newer, Rebuild):
                    raise RuntimeError(f"generation {command.generation} could not form and none replaced it") from exc
                latest, received = self._link.latest_rebuild()
                command = latest or newer
                marks = {k: v for k, v in marks.items() if k == "out"} | {"received": received}

    def _rebuild_once(self, command: Rebuild, marks: dict[str, float]) -> bool:
        member = self.config.member
        rank = command.rank_of(member)
        if rank == NO_RANK:
            if self.rank is not None:
                self._leave_group()
                raise MemberFencedError(
                    f"member {member} was replaced in generation {command.generation}; it must stop"
                )
            self.generation = command.generation  # still a spare
            self._link.progress = replace(self._link.progress, generation=command.generation)
            return False
        survivor = self.rank is not None
        marks["begin"] = time.time()
        self._link.progress = replace(self._link.progress, in_step=False, awaiting_rebuild=True)
        if survivor:
            marks.setdefault("out", time.time())
            self._leave_group()
        last_completed = self._completed_step if survivor else NO_STEP
        self._worker.cancel_uploads_before(command.generation)
        log = self.log.bind(generation=command.generation, rank=rank)

        snapshot: FlatBuffer | None = None
        meta: SnapshotMeta | None = None
        source = "fresh"
        if command.restore_step != NO_STEP:
            snapshot, meta, source = self._snapshot_for(command, rank)
            if meta.partitioned and meta.partition != Partition(rank, command.world_size):
                raise SnapshotUnavailableError(
                    f"snapshot of rank {rank} step {meta.step} is partition {meta.partition}, "
                    f"not rank {rank} of {command.world_size}"
                )
            if not meta.partitioned:
                load_module(self.module, [snapshot])
        marks["restored"] = time.time()

        service_ports = {self._rendezvous.port, command.rendezvous_port, *(a.port for a in command.stores)}
        service_ports |= self._link.server_ports()
        try:
            store = self._rendezvous.store_for(command, member)
            group = self._group.create(
                store,
                rank,
                command.world_size,
                self._backend,
                self.config.pg_timeout_s,
                command.generation,
                service_ports,
            )
            replicas: list[FlatBuffer] = []
            if snapshot is not None and meta is not None:
                replicas = exchange_partitions(snapshot, meta, rank, command.world_size, group)
        except RuntimeError as exc:  # torch's DistError family: a member never came, or the host is gone
            raise _RendezvousFailedError() from exc
        if snapshot is not None and meta is not None and meta.partitioned:
            load_module(self.module, [snapshot, *replicas])
        marks["rendezvous"] = time.time()

        self.model = self._wrap(self.module, group) if self._wrap else self.module
        check_wrapped(self.model)
        self.optimizer = self._factory(list(self.module.parameters()))
        self.optimizer.register_step_pre_hook(lambda *_: self._fence_optimizer_step())
        self._plan = None
        step = 0
        if snapshot is not None and meta is not None:
            # A fetched snapshot is ours alone: the optimizer state may live in it, uncopied.
            load_optimizer(self.module, self.optimizer, [snapshot, *replicas], meta, take_buffers=source == "store")
            restore_rng(meta.rng)
            self.extra_state = dict(meta.extra)
            step = meta.step
        self.rank, self.world_size, self.generation = rank, command.world_size, command.generation
        stores = {s.store: s for s in command.stores}
        self._placement = [stores[name] for name in command.placement[rank]]
        self._next_step = self._completed_step = step
        self._worker.forget_after(step)
        if command.restore_step == NO_STEP:
            self._seal_formation_snapshot()
        marks["ready"] = time.time()
        self._link.progress = Progress(generation=self.generation, rank=rank, step=step)
        ack = RebuildAck(
            job=self.config.job,
            generation=self.generation,
            member=member,
            rank=rank,
            restore_step=command.restore_step,
            last_completed_step=last_completed,
            restore_source=source,
            marks=marks,
            t_ready=marks["ready"],
        )
        self._link.publish(self._link.subjects.rebuild_ack, ack)
        log.info(
            "rebuild done",
            restore_step=command.restore_step,
            source=source,
            lost_steps=max(0, last_completed - command.restore_step) if survivor else 0,
            took_s=round(marks["ready"] - marks["begin"], 4),
            marks={k: round(v - command.t_decided, 4) for k, v in marks.items()},
        )
        return True

    def _seal_formation_snapshot(self) -> None:
        """Store step 0 before training starts, so a recovery always has a committed step to go to."""
        request = self._capture(0)
        if request is None or not request.done.wait(FORMATION_SNAPSHOT_WAIT_S) or not request.sealed_on:
            self.log.warning("step 0 snapshot not stored before training; an early failure cannot be recovered")

    def _snapshot_for(self, command: Rebuild, rank: int) -> tuple[FlatBuffer, SnapshotMeta, str]:
        """The snapshot of (rank, restore_step): from our own buffer if we have it, else from a store."""
        step = command.restore_step
        if self.rank == rank:
            slot = self._worker.local(step)
            if slot is not None and slot.buffer is not None:
                return slot.buffer, SnapshotMeta.decode(slot.meta), "local"
        preferred = command.placement[rank]
        ordered = sorted(command.stores, key=lambda s: s.store not in preferred)
        errors = []
        pin = torch.cuda.is_available() and any(p.is_cuda for p in self.module.parameters())
        for address in ordered:
            got: dict[str, Any] = {}

            def destination(meta_bytes: bytes, total_bytes: int, got: dict[str, Any] = got) -> memoryview:
                meta = SnapshotMeta.decode(meta_bytes)
                if meta.step != step or meta.layout.total_bytes != total_bytes:
                    raise StoreClientError(f"store sent step {meta.step} of {total_bytes} bytes, not step {step}")
                got["meta"], got["buffer"] = meta, FlatBuffer(meta.layout, pin=pin)
                return got["buffer"].bytes_view()  # type: ignore[no-any-return]

            connection = StoreConnection(address)
            try:
                connection.fetch(command.job, rank, step, destination)
                return got["buffer"], got["meta"], "store"
            except (StoreClientError, ValueError) as exc:
                errors.append(str(exc))
            finally:
                connection.close()
        raise SnapshotUnavailableError(f"no store could provide rank {rank} step {step}: {'; '.join(errors)}")

    def _leave_group(self) -> None:
        """Drop the wrappers that hold the process group, then break and destroy the group.

        No garbage collection here: a full collection holds the GIL for a hundred milliseconds and
        more, starving the control thread in the middle of a recovery. The group's connections are
        shut down explicitly instead (see `GenerationGroup`), so nothing depends on the wrappers being
        freed now.
        """
        self.model = self.module
        self.optimizer = None
        self._plan = None
        self._group.destroy()

    def _report_fatal(self, exc: BaseException) -> None:
        """Tell the detector we are dying, before we do (bounded wait for the message to leave)."""
        text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        error = MemberError(
            self.config.job,
            self.generation,
            self.config.member,
            self.rank if self.rank is not None else NO_RANK,
            text[:2000],
            time.time(),
        )
        try:
            self._link.publish(self._link.subjects.member_error, error).result(ERROR_REPORT_WAIT_S)
        except Exception as report_exc:
            self.log.warning("error report not sent", error=repr(report_exc))
