"""The member's side of one rebuild, as a sequence of states, each with one bounded wait.

    LEAVE     drop the old process group                          no wait
    RESTORE   the restore step: own buffer, else a store          each store: its fetch deadline; breakable
              (a job resumed from the durable tier loads its files in EXCHANGE: the ranks agree there)
    CONNECT   a client of the generation's rendezvous store       attempts of 1 s until `rendezvous_wait_s`; breakable
    FORM      `init_process_group` of the generation              the collective timeout; breakable
    EXCHANGE  the replicated shares, between the ranks            the collective timeout; breakable
    APPLY     re-wrap, build the optimizer, load the state        user code: an error ends the member, saying why
    SEAL      formation only: the step-0 snapshot stored          `formation_snapshot_wait_s`; breakable
    ACK       tell the swapper                                    no wait (stored by the control thread)

"Breakable": the wait belongs to the generation, and the control thread breaks it (shuts its sockets
down) the moment the generation is superseded: a newer rebuild, a void notice, the job's end. The
machine checks for supersession between states too, so a member never spends a state's whole bound
on a generation that can no longer form; it raises `SupersededError` and `member_recovery` starts over with the
newest command.

Three other ways out, each a specific exception for `member_recovery` to act on:
- `RendezvousFailedError`: the group could not be formed (a peer died meanwhile, the host is
  unreachable). Not this member's fault: it awaits the next command, and the swapper or the detector
  provides one (a failure's rebuild, or a regroup).
- `RestoreUnavailableError`: no copy of what the rebuild restores could be had (no store holds it,
  or the durable tier has no step every rank has intact). The member tells the swapper (an ack with
  source 'unavailable') and awaits the next command: the next link of the swapper's fallback chain.
- `MemberCannotContinueError`: something a spare would meet as well (the user's factory or wrapper
  raised, a job resumed with `--resume-from` finds nothing to resume, the ranks' snapshots do not fit
  together). The member reports it with its cause and the swapper ends the job with that reason.
- `MemberFencedError`: the rebuild gives this member's rank to someone else.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from deadpool.control_link import ControlLink, Progress
from deadpool.durable_tier import agree_on_step
from deadpool.errors import (
    MemberCannotContinueError,
    MemberFencedError,
    RendezvousFailedError,
    RestoreUnavailableError,
)
from deadpool.failure_origin import is_collective_error
from deadpool.generation_waits import GenerationWaits
from deadpool.member_config import MemberConfig
from deadpool.member_state import MemberState, RebuildResult
from deadpool.process_group import GenerationGroup, Rendezvous, RendezvousUnreachableError
from deadpool.replica_exchange import ReplicaMismatchError, exchange_device, exchange_partitions
from deadpool.sharded_module import is_fully_sharded, replica_group
from deadpool.snapshot_layout import FlatBuffer
from deadpool.snapshot_worker import SnapshotWorker
from deadpool.step_agreement import agree_on_newest
from deadpool.store_restore import Landing, NoStoreCopyError, SnapshotWanted, fetch_from_stores, stores_in_order
from deadpool.training_objects import TrainingObjects
from deadpool.training_state import (
    Partition,
    SnapshotMeta,
    check_fits,
    load_module,
    load_optimizer,
    load_user_state,
    restore_rng,
)
from deadpool_protocol import (
    NO_RANK,
    NO_STEP,
    MemberErrorCause,
    MemberPhase,
    Rebuild,
    RebuildAck,
    RebuildMarks,
    RebuildState,
    RestoreSource,
)
from deadpool_runtime.tracing import Tracing

__all__ = ["FirstStepTrace", "MemberRebuild", "RebuildParts"]

FORMATION_SNAPSHOT_WAIT_S = 120.0
SEAL_POLL_S = 0.1


FirstStepTrace = tuple[str, float, dict[str, Any]]
"""(parent context, ready time, attributes) of the `first_step` span a recovery still owes."""


@dataclass(frozen=True)
class RebuildParts:
    """The member's parts a rebuild works with, the same for every rebuild of the member's life."""

    config: MemberConfig
    log: Any
    link: ControlLink
    waits: GenerationWaits
    rendezvous: Rendezvous
    group: GenerationGroup
    backend: str
    worker: SnapshotWorker
    objects: TrainingObjects
    tracing: Tracing
    initial_rng: Any
    """The RNG state at attach: where a formation that must be started again starts from."""
    leave_group: Callable[[], None]
    """Drop the wrappers that hold the process group, then break and destroy the group."""
    adopt: Callable[[RebuildResult], None]
    """The one place the member takes a rebuild's result (before SEAL, which snapshots as the rank)."""
    capture: Callable[[int, Mapping[str, Any] | None], Any]
    """Start the snapshot of a step (`StepCapture.capture`, with the member's `extra_state`)."""
    landing: Landing | None = None
    """A warm spare's landing buffer, which a restore from a store fetches into (`SpareLanding.take`)."""
    landing_back: Callable[[], None] | None = None
    """Give the landing back unused (`SpareLanding.give_back`)."""


class MemberRebuild:
    """Carries out one generation's rebuild for a member that stood at `before`; the member adopts the
    result (`RebuildParts.adopt`) once the rank is ready to train."""

    def __init__(self, parts: RebuildParts, before: MemberState, command: Rebuild, marks: RebuildMarks) -> None:
        self.parts = parts
        self.before = before
        self.command = command
        self.marks = marks
        self.generation = command.generation
        self.rank = command.rank_of(parts.config.member)
        self.survivor = before.rank is not None
        self.log = parts.log.bind(generation=command.generation, rank=self.rank)
        self.state = RebuildState.LEAVE
        self.snapshot: FlatBuffer | None = None
        self.meta: SnapshotMeta | None = None
        self.replicas: list[FlatBuffer] = []
        self.source = RestoreSource.FRESH
        self.owned = False
        """The snapshot's buffer is this member's alone (fetched, read from disk, or copied into its
        landing): the optimizer's state may live in it, uncopied."""
        self.loaded_user: dict[str, Any] | None = None
        """The registered objects' states APPLY loaded from the snapshot (SEAL captures them as loaded)."""
        self.group: Any = None
        self.result: RebuildResult | None = None
        self.first_step_trace: FirstStepTrace | None = None
        """Set by ACK when the swapper traces the incident: the member records the first step under it."""
        self._store: Any = None
        self._store_sockets: dict[int, str] = {}
        config = parts.config
        self.resuming = command.durable or (command.restore_step == NO_STEP and bool(config.resume_from))
        """Restoring from the durable tier (a job resumed with `--resume-from`, or no RAM copy left): the
        ranks agree on the step once grouped."""
        self.durable_dir = (config.durable_dir or config.resume_from) if command.durable else config.resume_from

    def run(self) -> bool:
        """Carry the rebuild out; True if this member holds a rank in the end, False if it stays a spare."""
        parts = self.parts
        if self.rank == NO_RANK:
            if self.survivor:
                parts.leave_group()
                raise MemberFencedError(f"member {parts.config.member} was replaced in generation {self.generation}")
            return False  # still a spare
        self.marks = replace(self.marks, begin=time.time())
        parts.link.progress = Progress(
            generation=self.generation,
            rank=self.rank,
            step=self.before.completed_step,
            rebuilding=True,
            phase=MemberPhase.REBUILDING,
        )
        last_completed = self.before.completed_step if self.survivor else NO_STEP
        for state, action in (
            (RebuildState.LEAVE, self.leave),
            (RebuildState.RESTORE, self.restore),
            (RebuildState.CONNECT, self.connect),
            (RebuildState.FORM, self.form),
            (RebuildState.EXCHANGE, self.exchange),
            (RebuildState.APPLY, self.apply),
            (RebuildState.SEAL, self.seal),
            (RebuildState.ACK, lambda: self.ack(last_completed)),
        ):
            parts.waits.check(self.generation)
            self.state = state
            parts.link.progress = replace(parts.link.progress, rebuild_state=state)  # shown by `deadpool status`
            action()
        return True

    # ------------------------------------------------------------------ the states, in order

    def leave(self) -> None:
        if self.survivor:
            if self.marks.out is None:
                self.marks = replace(self.marks, out=time.time())
            self.parts.leave_group()
        self.parts.worker.cancel_uploads_before(self.generation)

    def restore(self) -> None:
        command = self.command
        if command.restore_step != NO_STEP:
            self._take(*self._snapshot_for(command.restore_step))
        elif self.resuming or command.local:
            # Read once the group exists (`exchange`): every rank must take the same step. A newcomer
            # first takes the crash copy the rank's dead holder left on this host, if any.
            if command.local and not self.survivor:
                self._take_host_copy()
        elif self.survivor:  # formation again (a member died in the first one): back to the start
            for param in self.parts.objects.module.parameters():
                param.grad = None  # of a first step that never completed; no optimizer step ran
            restore_rng(self.parts.initial_rng)
        self.marks = replace(self.marks, restored=time.time())

    def connect(self) -> None:
        parts, command = self.parts, self.command
        deadline = time.monotonic() + parts.config.rendezvous_wait_s
        host = "this member" if command.rendezvous_member == parts.config.member else command.rendezvous_member
        self.log.info(
            "rendezvous", host=host, address=f"{command.rendezvous_host}:{command.rendezvous_port}", ranks=command.ranks
        )
        try:
            self._store, self._store_sockets = parts.rendezvous.store_for(
                command, parts.config.member, parts.waits, deadline
            )
        except RendezvousUnreachableError as exc:
            raise RendezvousFailedError(str(exc)) from exc

    def form(self) -> None:
        parts, command = self.parts, self.command
        service_ports = {parts.rendezvous.port, command.rendezvous_port, *(a.port for a in command.stores)}
        service_ports |= parts.link.server_ports()
        try:
            self.group = parts.group.create(
                self._store,
                self.rank,
                command.world_size,
                parts.backend,
                parts.config.pg_timeout_s,
                self.generation,
                service_ports,
                self._store_sockets,
            )
        except RuntimeError as exc:  # torch's DistError family: a member never came, or we were broken
            parts.waits.check(self.generation)
            raise RendezvousFailedError(f"process group of generation {self.generation} not formed: {exc}") from exc

    def _take(self, snapshot: FlatBuffer, meta: SnapshotMeta, source: RestoreSource, owned: bool = False) -> None:
        """Use this snapshot of the rank's state, once it is checked to be this rank's partition."""
        command = self.command
        if _over_group(meta) and meta.partition != Partition(self.rank, command.world_size):
            raise MemberCannotContinueError(
                MemberErrorCause.REPLICAS_DISAGREE,
                f"snapshot of rank {self.rank} step {meta.step} is partition {meta.partition}, "
                f"not rank {self.rank} of {command.world_size}",
            )
        self.snapshot, self.meta, self.source = snapshot, meta, source
        self.owned = source in (RestoreSource.STORE, RestoreSource.DURABLE) or owned
        module = self.parts.objects.module
        if not meta.partitioned and not is_fully_sharded(module):  # else: once resharded (apply)
            load_module(module, [snapshot])

    def exchange(self) -> None:
        if self.resuming:
            self._resume_from_durable()
        elif self.command.local:
            self._restore_newest_own()
        if self.snapshot is not None and self.meta is not None and not self.meta.partition.within_shard:
            # HSDP's partitions go over the replica groups of the mesh the wrapper builds (apply).
            self.replicas = self._exchange(self.snapshot, self.meta, self.rank, self.command.world_size, self.group)
            if self.meta.partitioned:
                load_module(self.parts.objects.module, [self.snapshot, *self.replicas])
        self.marks = replace(self.marks, rendezvous=time.time())

    def _take_host_copy(self) -> None:
        """A newcomer: move the crash copies of this rank a dead member left on this host into this
        member's buffers (verified against their checksums), to agree on a step with the survivors."""
        worker = self.parts.worker
        if worker.host_copy is None:
            return
        inherited = worker.host_copy.inherit(self.rank, lambda head: head.generation < self.generation)
        worker.take_inherited(inherited)
        self.log.info("crash copies of this rank taken", steps=[c.head.step for c in inherited])

    def _restore_newest_own(self) -> None:
        """Agree with every rank on the newest step all of them hold in their own buffers (a newcomer: in
        the crash copy it took), and load ours. Training was held while every store was lost, or a
        process crashed and its rank went to a spare on its host."""
        landing = self._newcomers_landing()
        try:
            self._agree_on_own_step(landing)
        except BaseException:
            if landing is not None and self.snapshot is None and self.parts.landing_back is not None:
                self.parts.landing_back()  # unused: the store restore of the chain's next link fetches into it
            raise

    def _agree_on_own_step(self, landing: torch.Tensor | None) -> None:
        worker = self.parts.worker
        mine = worker.local_steps()
        device = exchange_device(self.group)
        try:
            step = agree_on_newest(
                mine, self.group, device, usable=lambda held: worker.local(held, into=landing) is not None
            )
            slot = worker.local(step) if step != NO_STEP else None
            # A step number alone does not tell timelines apart: a copy of an abandoned one (captured
            # before a rollback) is refused by every rank alike.
            same_timeline = agree_on_newest([slot.generation if slot is not None else NO_STEP], self.group, device)
        except RuntimeError as exc:  # the new group broke under the agreement
            self.parts.waits.check(self.generation)
            raise RendezvousFailedError(f"agreeing on a step in generation {self.generation}: {exc}") from exc
        if slot is None or slot.buffer is None:  # every rank finds the same: they all say so
            raise RestoreUnavailableError(f"the ranks hold no step in common in their own buffers (here: {mine})")
        if same_timeline == NO_STEP:
            raise RestoreUnavailableError(f"the ranks' copies of step {step} were captured in different generations")
        if self.survivor:
            self._take(slot.buffer, SnapshotMeta.decode(slot.meta), RestoreSource.LOCAL)
        else:  # a newcomer: in its warm landing, if it has one (the slot stays the worker's to capture into)
            landed = worker.landed(slot, landing)
            meta = SnapshotMeta.decode(slot.meta)
            self._take(landed or slot.buffer, meta, RestoreSource.HOST_COPY, owned=landed is not None)
        self.log.info("restored the newest step every rank holds", step=step, held_here=mine, source=self.source)

    def _newcomers_landing(self) -> torch.Tensor | None:
        """A newcomer's warm landing, for the crash copy it restores: read there as it is checked, the
        optimizer's state then stays there instead of in memory allocated at the load (a 1 GB rank's
        load took 0.34 s, 4 memcpys' worth, most of it page faults). None for a survivor, or without
        a landing that fits."""
        take, nbytes = self.parts.landing, self.parts.worker.slot_bytes()
        if self.survivor or take is None or nbytes == 0:
            return None
        return take(nbytes)

    def _resume_from_durable(self) -> None:
        """Agree with every rank on the newest persisted step they all have intact, and load ours."""
        world = self.command.world_size
        if not self.durable_dir:  # every rank is configured alike: they all say so
            raise RestoreUnavailableError("no RAM copy is left and this job has no durable tier (--durable-dir)")
        directory = Path(self.durable_dir)
        try:
            step, buffer, meta, refused = agree_on_step(
                directory, self.rank, world, self.group, exchange_device(self.group)
            )
        except RuntimeError as exc:  # the new group broke under the agreement
            self.parts.waits.check(self.generation)
            raise RendezvousFailedError(f"durable resume of generation {self.generation}: {exc}") from exc
        for reason in refused:
            self.log.warning("persisted step refused", reason=reason)
        if buffer is None or meta is None:
            why = f"no step in {directory} that all {world} ranks have complete and intact" + (
                f" (refused here: {refused[0]})" if refused else ""
            )
            if self.command.durable:
                raise RestoreUnavailableError(why)
            raise MemberCannotContinueError(MemberErrorCause.SNAPSHOT_UNAVAILABLE, why)
        module = self.parts.objects.module
        try:
            if not is_fully_sharded(module):  # shards are checked as they load (apply)
                check_fits(module, meta.layout)
        except ValueError as exc:
            raise MemberCannotContinueError(
                MemberErrorCause.REPLICAS_DISAGREE, f"{directory} step {step} does not fit this model: {exc}"
            ) from exc
        if _over_group(meta) and meta.partition != Partition(self.rank, world):
            raise MemberCannotContinueError(
                MemberErrorCause.REPLICAS_DISAGREE,
                f"{directory} step {step} rank {self.rank} is partition {meta.partition}, not of {world} ranks",
            )
        self.snapshot, self.meta, self.source, self.owned = buffer, meta, RestoreSource.DURABLE, True
        if not meta.partitioned and not is_fully_sharded(module):
            load_module(module, [buffer])
        self.log.info("resumed from the durable tier", directory=str(directory), step=step)

    def apply(self) -> None:
        parts, objects, command = self.parts, self.parts.objects, self.command
        try:
            with parts.group.wrapping():  # the subgroups it makes are this generation's to abort
                model, optimizer = objects.build(self.group, self._load_into_fresh)
        except (MemberCannotContinueError, RendezvousFailedError):
            raise
        except Exception as exc:
            parts.waits.check(self.generation)  # broken because the generation was superseded
            if is_collective_error(exc):  # DDP broadcasts at construction: the new group broke under it
                raise RendezvousFailedError(f"the new group broke while wrapping: {exc}") from exc
            # The user's code: every member would meet it.
            text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            raise MemberCannotContinueError(
                MemberErrorCause.USER_CODE, f"the wrapper or optimizer factory raised during a rebuild: {text}"
            ) from exc
        objects.hook(optimizer)
        step, extra_state = 0, None
        if self.snapshot is not None and self.meta is not None:
            # A fetched snapshot is ours alone: the optimizer state may live in it, uncopied.
            try:
                tree = self.meta.decode_tree(self.snapshot)
                load_optimizer(
                    objects.module,
                    optimizer,
                    [self.snapshot, *self.replicas],
                    tree,
                    take_buffers=self.owned,
                )
            except ValueError as exc:
                raise MemberCannotContinueError(MemberErrorCause.REPLICAS_DISAGREE, str(exc)) from exc
            try:
                load_user_state(objects.state, tree)
                self.loaded_user = tree["user"]
            except Exception as exc:  # the user's load_state_dict, or a snapshot of other objects
                text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                raise MemberCannotContinueError(
                    MemberErrorCause.USER_CODE, f"registered state could not be restored: {text}"
                ) from exc
            restore_rng(self.meta.rng)
            extra_state = dict(self.meta.extra)
            step = self.meta.step
        stores = {s.store: s for s in command.stores}
        self.result = RebuildResult(
            rank=self.rank,
            world_size=command.world_size,
            generation=self.generation,
            step=step,
            placement=tuple(stores[name] for name in command.placement[self.rank]),
            model=model,
            optimizer=optimizer,
            extra_state=extra_state,
        )
        parts.adopt(self.result)

    def seal(self) -> None:
        """Store the step training starts from when the stores may not hold it: formation's (step 0, or
        the resumed one) before training, so a recovery always has a committed step to go to.

        After a local restore (the ranks' own buffers, a crash copy) the step goes to the stores as any
        step's snapshot does, while training goes on: the swapper takes the agreed step as committed
        and counts its copies as they are sealed, and the committed step before it stays the older link,
        so a lost host before they are sealed costs the steps back to it, not the job. Waiting for them
        was most of a crash-copy swap's downtime (1.1 s of 3.0 s at 1 GiB a rank)."""
        if self.command.restore_step != NO_STEP:
            return
        assert self.result is not None
        step = self.result.step  # step 0, the resumed step, or the step the ranks agreed on
        request = self.parts.capture(step, self.loaded_user)
        if self.command.local:
            self.log.info("the agreed step goes to the stores while training goes on", step=step)
            return
        deadline = time.monotonic() + FORMATION_SNAPSHOT_WAIT_S
        while request is not None and not request.done.wait(SEAL_POLL_S):
            self.parts.waits.check(self.generation)
            if time.monotonic() > deadline:
                break
        if request is None or not request.done.is_set() or not request.sealed_on:
            self.log.warning(
                "first snapshot not stored before training; a failure before the next one cannot be recovered",
                step=step,
            )

    def report_unavailable(self, reason: str) -> None:
        """Tell the swapper this member found no copy of the restore step (it waits for the next command)."""
        link = self.parts.link
        link.progress = replace(link.progress, rebuilding=False, awaiting_rebuild=True)
        last_completed = self.before.completed_step if self.survivor else NO_STEP
        self._send_ack(RestoreSource.UNAVAILABLE, self.command.restore_step, last_completed)
        self.log.warning("restore unavailable; the swapper tries the next link", reason=reason[:500])

    def ack(self, last_completed: int) -> None:
        command, result = self.command, self.result
        assert result is not None
        self.parts.link.progress = Progress(
            generation=self.generation,
            rank=self.rank,
            step=result.step,
            phase=MemberPhase.REBUILDING,
            rebuild_state=RebuildState.ACK,
        )
        agreed = self.source is RestoreSource.DURABLE or command.local  # the ranks chose the step themselves
        restored = self.meta.step if agreed and self.meta else command.restore_step
        self._send_ack(self.source, restored, last_completed)
        self.log.info(
            "rebuild done",
            restore_step=restored,
            source=self.source,
            lost_steps=max(0, last_completed - restored) if self.survivor else 0,
            took_s=round(_at(self.marks.ready) - _at(self.marks.begin), 4),
            marks={k: round(v - command.t_decided, 4) for k, v in asdict(self.marks).items() if v is not None},
        )
        self._trace()

    def _trace(self) -> None:
        """This member's spans of the incident the rebuild answers, under the swapper's `recovery`."""
        config, tracing, command, marks = self.parts.config, self.parts.tracing, self.command, self.marks
        if not command.traceparent or not tracing.on:
            return
        attrs: dict[str, Any] = {
            "job": command.job,
            "generation": self.generation,
            "rank": self.rank,
            "member": config.member,
            "host": config.host,
            "incident": command.incident,
        }
        parent = command.traceparent
        if marks.out is not None:
            tracing.record("abort", parent, marks.out if marks.received is None else marks.received, marks.out, attrs)
        begin, restored_t, ready = _at(marks.begin), _at(marks.restored), _at(marks.ready)
        rendezvous = restored_t if marks.rendezvous is None else marks.rendezvous
        restored = {"source": str(self.source), "bytes": self.snapshot.layout.total_bytes if self.snapshot else 0}
        tracing.record("restore", parent, begin, restored_t, attrs | restored)
        tracing.record("rendezvous", parent, restored_t, rendezvous, attrs)
        tracing.record("apply", parent, rendezvous, ready, attrs)
        self.first_step_trace = (parent, ready, attrs)

    # ------------------------------------------------------------------ helpers

    def _load_into_fresh(self, module: torch.nn.Module) -> None:
        """A fresh copy of a sharded model (`sharded_module`): give it local shards, and fill them with
        this rank's shards from the snapshot."""
        if self.snapshot is None:
            raise MemberCannotContinueError(
                MemberErrorCause.SNAPSHOT_UNAVAILABLE,
                "a model sharded with fully_shard must be re-formed from scratch: restart the job",
            )
        device = self.parts.objects.param_device
        module.to_empty(device=torch.device("cuda", torch.cuda.current_device()) if device.type == "cuda" else device)
        if self.meta is not None and self.meta.partition.within_shard:
            self.replicas = self._exchange_within_shard(module, self.snapshot, self.meta)
        try:
            load_module(module, [self.snapshot, *self.replicas])
        except ValueError as exc:
            raise MemberCannotContinueError(MemberErrorCause.REPLICAS_DISAGREE, f"shards do not fit: {exc}") from exc

    def _exchange_within_shard(
        self, module: torch.nn.Module, snapshot: FlatBuffer, meta: SnapshotMeta
    ) -> list[FlatBuffer]:
        """HSDP: the other partitions of this rank's shards, from the ranks of its replica group in the
        mesh the wrapper just built (the same world and rank give the same groups)."""
        replicas = replica_group(module)
        partition = None if replicas is None else Partition(replicas.index, replicas.size, within_shard=True)
        if replicas is None or partition != meta.partition:
            raise MemberCannotContinueError(
                MemberErrorCause.REPLICAS_DISAGREE,
                f"snapshot of rank {self.rank} step {meta.step} is partition {meta.partition} of a replica group; "
                f"the model as wrapped now is {partition or 'not replicated by HSDP'}",
            )
        return self._exchange(snapshot, meta, replicas.index, replicas.size, replicas.group)

    def _exchange(self, snapshot: FlatBuffer, meta: SnapshotMeta, rank: int, size: int, group: Any) -> list[FlatBuffer]:
        """The other ranks' partitions of `group` (rank `rank` of `size` in it)."""
        try:
            return exchange_partitions(snapshot, meta, rank, size, group)
        except ReplicaMismatchError as exc:
            raise MemberCannotContinueError(MemberErrorCause.REPLICAS_DISAGREE, str(exc)) from exc
        except RuntimeError as exc:  # the new group broke under the exchange
            self.parts.waits.check(self.generation)
            raise RendezvousFailedError(f"replica exchange of generation {self.generation}: {exc}") from exc

    def _send_ack(self, source: RestoreSource, restore_step: int, last_completed: int) -> None:
        config = self.parts.config
        ready = time.time()
        self.marks = replace(self.marks, ready=ready)
        self.parts.link.ack(
            RebuildAck(
                job=config.job,
                generation=self.generation,
                member=config.member,
                rank=self.rank,
                restore_step=restore_step,
                last_completed_step=last_completed,
                restore_source=source,
                marks=self.marks,
                t_ready=ready,
            )
        )

    def _snapshot_for(self, step: int) -> tuple[FlatBuffer, SnapshotMeta, RestoreSource]:
        """The snapshot of (rank, step): from our own buffer if we have it, else from a store."""
        parts, command, rank = self.parts, self.command, self.rank
        module = parts.objects.module
        if self.before.rank == rank:
            slot = parts.worker.local(step)
            if slot is not None and slot.buffer is not None:
                return slot.buffer, SnapshotMeta.decode(slot.meta), RestoreSource.LOCAL
        wanted = SnapshotWanted(command.job, rank, step, command.restore_generation, command.traceparent)
        try:
            buffer, meta, _ = fetch_from_stores(
                wanted,
                stores_in_order(command.stores, command.placement[rank]),  # the rank's own stores first
                module,
                self.log,
                token=parts.link.store_token,
                seal_key=parts.link.seal_key,
                pin=torch.cuda.is_available() and any(p.is_cuda for p in module.parameters()),
                sharded=is_fully_sharded(module),
                breakable=lambda abort: parts.waits.breakable(self.generation, abort),
                landing=parts.landing,
            )
        except NoStoreCopyError as exc:
            raise RestoreUnavailableError(str(exc)) from exc
        return buffer, meta, RestoreSource.STORE


def _at(mark: float | None) -> float:
    """A mark the rebuild has passed by now (`run` sets `begin`, `restore` `restored`, `_send_ack` `ready`)."""
    assert mark is not None
    return mark


def _over_group(meta: SnapshotMeta) -> bool:
    """Whether the snapshot is a partition over the whole group (DDP), which names the rank it is."""
    return meta.partitioned and not meta.partition.within_shard
