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
from collections.abc import Iterable, Iterator
from dataclasses import replace
from types import TracebackType
from typing import Any, TypeVar

import torch
from torch import nn

from deadpool.errors import JobFailedError, MemberCannotContinueError, MemberFencedError
from deadpool.member_lifecycle import FINISH_WAIT_S, Member
from deadpool.step_stats import StepStats
from deadpool.training_objects import OptimizerFactory, Wrapper
from deadpool.training_state import restore_rng, rng_state
from deadpool.user_state import UserState
from deadpool_protocol import NO_STEP

__all__ = [
    "FINISH_WAIT_S",
    "Job",
    "JobFailedError",
    "MemberCannotContinueError",
    "MemberFencedError",
    "OptimizerFactory",
    "Wrapper",
]

T = TypeVar("T")


class _StepContext:
    def __init__(self, member: Member) -> None:
        self.member = member

    def __enter__(self) -> None:
        self.member.step_started()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> bool:
        if exc is None:
            self.member.step_ended()
            return False
        if isinstance(exc, Exception) and self.member.recoverable(exc):
            self.member.recover(exc)
            return True  # the step is abandoned; steps() resumes at the restored step
        if isinstance(exc, Exception):
            self.member.report_fatal(exc)
        return False


class Job:
    """What the training script holds: the loop (`steps`, `step`, `iterate`, `section`), what to
    capture (`register`), and the current generation's objects (`model`, `optimizer`, `rank`). The
    member's life behind it is `member_lifecycle.Member`'s."""

    def __init__(self, member: Member) -> None:
        self._member = member
        self.config = member.config
        self.log = member.log
        atexit.register(self.close)

    @property
    def rank(self) -> int | None:
        """This member's rank, or None while it is a spare."""
        return self._member.rank

    @property
    def world_size(self) -> int:
        return self._member.world_size

    @property
    def generation(self) -> int:
        return self._member.generation

    @property
    def module(self) -> nn.Module:
        """The unwrapped model; its parameters are what snapshots hold."""
        return self._member.objects.module

    @property
    def model(self) -> Any:
        """The model to call in the step: the wrapped one once this member holds a rank (typed Any: it
        is whatever the wrapper returned, so that `job.model.no_sync()` and the like type-check)."""
        return self._member.objects.model

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._member.objects.optimizer

    @property
    def state(self) -> UserState:
        """The objects registered with `register`, by name (schedulers, scalers, data loaders, EMA modules;
        a factory's object once this member holds a rank)."""
        return self._member.state

    @property
    def extra_state(self) -> dict[str, Any]:
        """Small msgpack-able values saved with every snapshot and restored with it."""
        return self._member.extra_state

    @extra_state.setter
    def extra_state(self, values: dict[str, Any]) -> None:
        self._member.extra_state = values

    @property
    def stats(self) -> StepStats:
        """Per-step wall time and time spent in the hooks (written to `DEADPOOL_STATS_DIR` at close)."""
        return self._member.stats

    def steps(self, total_steps: int) -> Iterator[int]:
        """Yield the index of each step to run, from wherever this member's state stands.

        A spare blocks here until it is given a rank (or the job finishes). After a recovery the
        next index is the restored step, so the replayed steps are the same steps. Raises
        `JobFailedError` if the swapper ends the job, and `MemberCannotContinueError` if this member
        cannot carry out a rebuild (both say why).
        """
        if total_steps < 0:
            raise ValueError("total_steps must not be negative")
        member = self._member
        if member.rank is None and not member.ended:
            member.join()
        while not member.ended and member.rank is not None:
            member.obey_newer_rebuild()
            if member.next_step >= total_steps:
                member.finish(total_steps)
                continue
            member.step_started()  # the loop body is the step, with or without `with job.step()`
            try:
                yield member.next_step
            except GeneratorExit:  # the loop was left early (`break`, an early stop, a time budget)
                member.leave_early()
                raise
            member.body_ended()

    def register(self, name: str, obj: Any) -> Any:
        """Capture `obj`'s state with every snapshot and restore it at every rebuild; returns `obj`.

        `obj`: anything with `state_dict()`/`load_state_dict()` (a scheduler of your own optimizer,
        a `torch.amp.GradScaler`, a `StatefulDataLoader`, an EMA module), or a factory
        `optimizer -> object` for objects bound to an optimizer the job builds from a factory
        (`job.state[name]` is then the current generation's). Register before the first step: every
        member, spares too, registers the same names.
        """
        if self.rank is not None or self._member.completed_step != NO_STEP:
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
        resuming = self._member.restores > 0  # a spare's first batches come from the state it was given
        while True:
            restores, empty = self._member.restores, True
            if resuming:  # the run that never stopped made no new iterator here: leave its RNG alone
                kept = rng_state()
                batches = iter(loader)
                restore_rng(kept)
            else:
                batches = iter(loader)  # a new epoch: seeds drawn as in the run that never stopped
            for batch in batches:
                empty = False
                yield batch
                if self._member.restores != restores:
                    break
            resuming = self._member.restores != restores  # the loader's state was restored: resume from it
            if empty and not resuming:
                raise ValueError("the loader yields no batches")

    def step(self) -> _StepContext:
        """Context for one training step; a broken collective inside it is handled, not raised.

        Keep the step's work inside the block: when a step is abandoned, the code after the block
        still runs once before `steps()` moves to the restored step.
        """
        if self.rank is None:
            raise RuntimeError("step() outside steps(): this member holds no rank")
        return _StepContext(self._member)

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
        self._member.link.progress = replace(self._member.link.progress, section=name)
        try:
            yield
        finally:
            self._member.link.progress = replace(self._member.link.progress, section="")

    def close(self) -> None:
        """Release wrappers, the process group and the background threads (also runs at exit)."""
        self._member.close()
