"""What a snapshot of a step holds and where it goes.

The plan of a snapshot's tensors is made again only when they change (the optimizer's state appeared
or was replaced, a registered object's tensors changed shape); a replicated model (DDP) is snapshotted
one share per rank. The stores are the rank's placement, taken anew whenever the swapper places the
rank's snapshots elsewhere (a store lost or back). While no store receives them, that is said every
`UNPROTECTED_LOG_S`, and counted in `steps_at_risk`.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from deadpool.control_link import ControlLink
from deadpool.ddp_check import find_ddp
from deadpool.durable_tier import DurableWriter
from deadpool.errors import MemberCannotContinueError
from deadpool.host_copy import HostCopy
from deadpool.member_config import MemberConfig
from deadpool.sharded_module import replica_group
from deadpool.snapshot_cadence import ANNOUNCE_EVERY_S, SnapshotCadence
from deadpool.snapshot_layout import SnapshotLayout, plan_layout
from deadpool.snapshot_worker import SnapshotWorker
from deadpool.state_tree import TreeError
from deadpool.step_stats import StepStats
from deadpool.store_client import UploadKey
from deadpool.training_objects import TrainingObjects
from deadpool.training_state import (
    WHOLE,
    Partition,
    SnapshotMeta,
    SnapshotSources,
    StateTree,
    capture_tree,
    collect_sources,
    tensor_state_ids,
)
from deadpool_protocol import MemberErrorCause, Placement, SnapshotInterval, StoreAddress

__all__ = ["UNPROTECTED_LOG_S", "StepCapture", "snapshot_worker"]

UNPROTECTED_LOG_S = 30.0
"""While every store is lost, a member says so this often (the swapper and `deadpool status` too)."""
INTERVALS_KEPT = 1000
PlanKey = tuple[tuple[int, ...], Partition, tuple[Any, ...]]


def snapshot_worker(config: MemberConfig, log: Any) -> SnapshotWorker:
    """The member's snapshot worker, with the durable tier if the job has one."""
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
    host_copy = HostCopy(Path(config.host_copy_dir), config.job, config.member, log) if config.host_copy_dir else None
    return SnapshotWorker(
        log,
        config.snapshot_chunk_bytes,
        config.snapshot_stream_nice,
        config.snapshot_wait_s,
        durable,
        host_copy,
        config.snapshot_chain,
    )


class _LoadedState:
    """A registered object's state as a rebuild has just loaded it, captured in the object's place."""

    def __init__(self, state: Any) -> None:
        self._state = state

    def state_dict(self) -> Any:
        return self._state


class StepCapture:
    """The snapshots of one rank of one generation at a time (`place` starts each generation's)."""

    def __init__(
        self,
        config: MemberConfig,
        log: Any,
        worker: SnapshotWorker,
        objects: TrainingObjects,
        link: ControlLink,
        stats: StepStats,
    ) -> None:
        self.config = config
        self.log = log
        self.worker = worker
        self.objects = objects
        self.link = link
        self.stats = stats
        self.rank: int | None = None
        self.world_size = config.world_size
        self.generation = 0
        self.placement: list[StoreAddress] = []
        self.placement_version = 0
        """Which placement of the generation `placement` is (the rebuild's is 0; see `Placement`)."""
        self.steps_at_risk = 0
        """Steps trained since no store receives this rank's snapshots (0 while one does)."""
        self._unprotected: tuple[int, float] | None = None
        """(first step, when it was last said) while no store receives this rank's snapshots."""
        self._plan: tuple[PlanKey, SnapshotSources, SnapshotLayout] | None = None
        self._partition_of: tuple[int, Partition] | None = None
        """(generation, this rank's partition in it): the model is wrapped once per generation."""
        self.cadence = SnapshotCadence(config.snapshot_budget, config.snapshot_every or None)
        """Which steps are streamed: every K-th, K agreed with the peers (`snapshot_cadence`)."""
        self._streams_seen = -1
        """The step of the newest stream whose time the cadence has been told."""
        self._announced: tuple[int, int, float] = (0, 0, -ANNOUNCE_EVERY_S)
        """(generation, interval, when) this rank last told its peers its interval."""
        self._skip_said_t = -ANNOUNCE_EVERY_S
        """When a skipped stream was last logged (at most every `ANNOUNCE_EVERY_S`)."""
        self.intervals: list[tuple[int, int]] = []
        """(step, interval) each time the job's interval changed, as this rank saw it (the first
        `INTERVALS_KEPT`, for the member's stats file)."""

    def place(self, rank: int, world_size: int, generation: int, placement: list[StoreAddress]) -> None:
        """A rebuild made this member `rank` of `generation`, its snapshots going to `placement`."""
        self.rank, self.world_size, self.generation = rank, world_size, generation
        self.placement = placement
        self.placement_version = 0
        self._plan = None
        self.cadence.place(rank, world_size, generation)

    def forget_plan(self) -> None:
        """The tensors a plan names belong to a wrapper and optimizer being dropped."""
        self._plan = None

    def capture(
        self,
        step: int,
        extra_state: dict[str, Any],
        loaded: Mapping[str, Any] | None = None,
        stream: bool = True,
        stream_wait_s: float | None = None,
    ) -> Any:
        """Start the snapshot of `step` (streamed if `stream`; `stream_wait_s`: as `SnapshotWorker.capture`,
        None waits for the previous stream, as the formation's must). `loaded`: the registered objects'
        states a rebuild has just loaded, captured as they are rather than read back (a resumed
        formation's SEAL: a data loader given a state has no iterator until the loop iterates it, and
        reading its state would fork its workers inside the rebuild; see `UserState.read_once`)."""
        assert self.rank is not None
        self._adopt_placement()
        objects = self.objects
        user = objects.state if loaded is None else {name: _LoadedState(state) for name, state in loaded.items()}
        try:
            tree = capture_tree(objects.module, objects.optimizer, user)
        except TreeError as exc:  # every member would meet it: end the job, saying what cannot be held
            raise MemberCannotContinueError(MemberErrorCause.USER_CODE, f"state cannot be snapshotted: {exc}") from exc
        sources, layout = self._sources(tree)
        meta = SnapshotMeta.capture(step, layout, tree, sources, extra_state).encode()
        key = UploadKey(self.config.job, self.generation, self.rank, self.config.member, step)
        self._say_if_unprotected(step)
        durable = self.worker.durable
        persist = self.world_size if stream and durable is not None and durable.due(step) else 0
        if persist and self.worker.host_copy is None:  # a skipped stream would capture nothing to persist
            stream_wait_s = None
        return self.worker.capture(key, layout, sources, meta, self.placement, persist, stream, stream_wait_s)

    def step_completed(self, step: int, extra_state: dict[str, Any]) -> bool:
        """After optimizer step `step`: adjust the interval to the last stream stored, capture the step if
        it is due, or if this member keeps a crash copy (every step, streamed or not), and announce the
        interval. Whether it was captured."""
        cadence, worker = self.cadence, self.worker
        if self.config.snapshot_every == 0:  # snapshots off
            return False
        stream_step, stream_s = worker.last_stream  # first: a stream just stored may change this step's K
        if stream_step != self._streams_seen:
            self._streams_seen = stream_step
            cadence.streamed(stream_s, self.stats.recent_step_s(), stream_step)
        now = time.monotonic()
        every = cadence.every(now)
        if (not self.intervals or self.intervals[-1][1] != every) and len(self.intervals) < INTERVALS_KEPT:
            self.intervals.append((step, every))
        due = step % every == 0
        captured = False
        if due or worker.host_copy is not None:
            wait_s = cadence.wait_s(self.stats.recent_step_s()) if cadence.adaptive else None
            skips = worker.stream_skips
            captured = self.capture(step, extra_state, stream=due, stream_wait_s=wait_s) is not None
            if worker.stream_skips > skips:  # the last stream still ran after the budget's wait
                cadence.skipped()
                if now - self._skip_said_t >= ANNOUNCE_EVERY_S:  # a store lost for seconds skips every step
                    self._skip_said_t = now
                    self.log.info(
                        "snapshot stream skipped: the last one still runs",
                        step=step,
                        every=every,
                        skipped_so_far=cadence.skips,
                    )
        self._announce(now)
        return captured

    def figures(self) -> dict[str, Any]:
        """The interval's story, for the member's stats file (`DEADPOOL_STATS_DIR`)."""
        return {
            "snapshot_every": self.cadence.every(time.monotonic()),
            "snapshot_every_own": self.cadence.own,
            "snapshot_intervals": self.intervals,
            "snapshot_budget": self.cadence.budget,
        }

    def heard(self, interval: SnapshotInterval) -> None:
        """A peer's interval (control thread)."""
        self.cadence.heard(interval, time.monotonic())

    def _announce(self, now: float) -> None:
        """Tell the peers this rank's interval when it changed, and every `ANNOUNCE_EVERY_S` anyway, while
        it is above 1. An interval of 1 adds nothing to the job's (the longest of them), so a rank at 1
        says so once, and only when it comes down from more: every rank telling every other one is N²
        messages, and a job whose stores keep up sends none."""
        cadence = self.cadence
        if not cadence.adaptive or self.rank is None:
            return
        generation, every, said_t = self._announced
        if cadence.own == 1:
            if generation != self.generation or every == 1:
                return  # nothing above 1 said in this generation, or the 1 already said
        elif (generation, every) == (self.generation, cadence.own) and now - said_t < ANNOUNCE_EVERY_S:
            return
        self._announced = (self.generation, cadence.own, now)
        interval = SnapshotInterval(
            self.config.job, self.generation, self.config.member, self.rank, cadence.own, time.time()
        )
        self.link.publish(self.link.subjects.snapshot_interval, interval)

    def on_placement(self, placement: Placement) -> None:
        """Control thread: uploads to stores this rank's snapshots no longer go to are abandoned now
        (one blocked on a lost host would otherwise hold the stream until its socket timeout)."""
        rank = self.rank
        if rank is None or placement.generation != self.generation or rank >= len(placement.placement):
            return
        self.worker.drop_stores(keep=set(placement.placement[rank]), generation=placement.generation)

    def _partition(self) -> Partition:
        """Snapshot only a share of the parameters when they are replicated: across the group (DDP),
        or across the replicas of this rank's shards (HSDP). Found once per generation."""
        if self._partition_of is not None and self._partition_of[0] == self.generation:
            return self._partition_of[1]
        partition = WHOLE
        if not self.config.snapshot_partition or self.rank is None or self.world_size < 2:
            pass
        elif find_ddp(self.objects.model) is not None:
            partition = Partition(self.rank, self.world_size)
        elif (replicas := replica_group(self.objects.module)) is not None:
            partition = Partition(replicas.index, replicas.size, within_shard=True)
        self._partition_of = (self.generation, partition)
        return partition

    def _sources(self, tree: StateTree) -> tuple[SnapshotSources, SnapshotLayout]:
        """The snapshot's plan: made again whenever the optimizer's state tensors are other tensors
        (state appeared, or was replaced) or the state tree's tensors changed shape; otherwise only
        the tree's tensors of this capture are put in."""
        partition = self._partition()
        optimizer = self.objects.optimizer
        key: PlanKey = (tensor_state_ids(optimizer), partition, tree.signature)
        if self._plan is None or self._plan[0] != key:
            sources = collect_sources(self.objects.module, optimizer, partition, tree)
            layout = plan_layout(list(zip(sources.names, sources.tensors, strict=True)))
            self._plan = (key, sources, layout)
            self.stats.snapshot_bytes, self.stats.snapshot_bytes_whole = layout.total_bytes, sources.whole_bytes
        _, sources, layout = self._plan
        sources.take_tree(tree.tensors)
        return sources, layout

    def _adopt_placement(self) -> None:
        """Stream from now on where the swapper's newest placement of this generation says (a store was
        lost, or one came back): no rebuild, the next snapshot simply goes elsewhere."""
        newest = self.link.latest_placement()
        if newest is None or newest.generation != self.generation or newest.version <= self.placement_version:
            return
        assert self.rank is not None
        addresses = {s.store: s for s in newest.stores}
        self.placement = [addresses[name] for name in newest.placement[self.rank]]
        self.placement_version = newest.version
        self.log.info(
            "snapshots placed anew",
            version=newest.version,
            stores=[s.store for s in self.placement],
            why=newest.reason,
        )

    def _say_if_unprotected(self, step: int) -> None:
        """While no store receives this rank's snapshots (every store was lost), say so every
        `UNPROTECTED_LOG_S`, with how many steps have been trained since: a lost rank would restore
        from the durable tier, if the job has one."""
        if self.placement:
            if self._unprotected is not None:
                self.log.warning("snapshots reach a store again", step=step, unprotected_since=self._unprotected[0])
            self._unprotected = None
            self.steps_at_risk = 0
            return
        now = time.monotonic()
        if self._unprotected is None:
            self._unprotected = (step, now - UNPROTECTED_LOG_S)
        since, said = self._unprotected
        self.steps_at_risk = step - since + 1
        if now - said >= UNPROTECTED_LOG_S:
            self._unprotected = (since, now)
            self.log.warning(
                "training unprotected: no snapshot store receives this rank's snapshots",
                step=step,
                since_step=since,
                steps_at_risk=step - since + 1,
                durable_tier=self.worker.durable is not None,
            )
