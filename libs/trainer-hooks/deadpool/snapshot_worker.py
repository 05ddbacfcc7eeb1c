"""Per-step snapshots off the training thread: a few buffers, a capture, a stream.

After optimizer step s the training thread calls `capture(s, …)`. The thread copies the state into a
buffer not holding the newest snapshot (`torch._foreach_copy_`, which releases the GIL) and then, if
the step is due (`deadpool.snapshot_cadence`), streams it to the rank's stores. The next optimizer
step waits in `wait_captured()` (an optimizer step pre-hook) only if that copy is still running; it
normally finished long before, during forward and backward.

A step commits only once every rank's snapshot of it is stored, so the ranks must stream the same
steps: a skip decided by one rank alone (its stream still busy) once left ranks holding different
steps, and on a saturated host an earlier 4-rank run fell 6 steps behind. Two ways keep them together:
- adaptive (the default): the job streams every K-th step, K a power of two every rank knows. If the
  previous stream is still running when a due step is captured, the capture waits at most the
  budget's share of a step (`stream_wait_s`), then captures without streaming (the interval follows
  what the streamed snapshots take). The stream keeps its buffer meanwhile, so a member with a crash copy captures into
  a third buffer: its newest whole step is never the one being overwritten.
- forced (`--snapshot-every N`): the capture waits for the previous stream (`wait_s`, then the stuck
  uploads are abandoned), so that the committed step trails training by at most one snapshot, and the
  price of a stream slower than a step is paid in step time, where it shows.

On CUDA the copy is issued on a side stream into pinned buffers and the pre-hook makes the compute
stream wait on the copy's event: the GPU orders the two, the CPU never blocks. The path is chosen per
tensor (CUDA tensors on the side stream, host tensors by `_foreach_copy_`), so state kept partly on
the host is captured too. Pinned memory is slow to allocate, so a buffer for a new layout is allocated
by the copy thread, never the training thread: that capture hands the copy thread the buffers' device
clones (the next forward may change them) and an event on the compute stream, and the pre-hook waits
until the copies are issued. Every wait on the GPU is bounded (`COPY_WAIT_S`) and ends when its
generation is superseded: a survivor whose compute stream waits on a dead peer's collective must not
hold its recovery on a copy that cannot finish.

Two threads: the copy (the next optimizer step may wait for it) and the stream. Both run at normal
priority by default. `stream_nice` lowers the stream's priority, for CPU training that keeps every core
busy: the stream then runs in the moments training leaves idle, which took the GPT-medium step-time
ratio from 1.056 to 1.023 on 2 cores. The price, on a saturated host: streams take longer (forced: the
captures wait for them; before captures waited, snapshots fell behind by several steps: at nice 19 a
4-rank tiny-GPT job that failed after step 7 went back to step 1), and a SIGKILLed member takes 1.5 s
to die, because its low-priority thread must be scheduled to exit (docs/performance.md).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from deadpool.cpu_placement import BACKGROUND_CPUS_ENV, cpus_from_env, pin_this_thread
from deadpool.durable_tier import DurableWriter
from deadpool.host_copy import CHECKSUM_BYTES, SLOTS, HostCopy, InheritedSlot, SlotHead, checksums_of, read_checked
from deadpool.snapshot_layout import FlatBuffer, SnapshotLayout
from deadpool.store_client import SnapshotCancelledError, StoreClientError, StoreConnection, UploadKey
from deadpool.training_state import SnapshotSources
from deadpool_protocol import StoreAddress

__all__ = ["CaptureRequest", "SnapshotSlot", "SnapshotWorker"]

ABANDON_WAIT_S = 5.0
"""After abandoning a stuck stream's uploads, how long a capture waits for the stream to notice."""
COPY_WAIT_S = 30.0
"""How long the copy thread waits for a capture's device-to-host copies (and a rebuild for the copy
thread) before the capture is given up: copies queue behind the compute stream, which a collective
with a dead peer can hold until its communicator is aborted."""
EVENT_POLL_S = 0.0005
"""The longest pause between two polls of a CUDA event (the pauses grow to it from 20 us)."""


@dataclass(eq=False)
class SnapshotSlot:
    """One of the member's buffers, and which step it holds (-1: nothing valid). Equal only to itself:
    two empty slots are still two (`slots.index`)."""

    buffer: FlatBuffer | None = None
    step: int = -1
    meta: bytes = b""
    generation: int = 0
    """The generation that captured `step` (a step number alone does not tell two timelines apart)."""
    plan: CopyPlan | None = None
    """The copies into this buffer, for the sources it was made for (made again when the plan changes)."""
    unchecked: tuple[int, list[int]] | None = None
    """A crash copy a dead member left (`take_inherited`), not yet checked: its head's chunk size and
    checksums. It is checked when a restore first asks for its step (`local`)."""
    landed_in: torch.Tensor | None = None
    """Where its check read a crash copy's bytes to (a newcomer's landing, `local(step, into)`)."""


@dataclass
class CopyPlan:
    """One buffer's copies for one plan of sources, split by when (early: at capture; late: before
    the next optimizer step) and by path (CUDA: side stream; host: `_foreach_copy_`)."""

    sources: SnapshotSources
    early_cuda: list[int]
    early_host: list[int]
    late_cuda: list[int]
    late_host: list[int]
    """Positions in `sources.early_tensors` / `sources.late_tensors`."""
    early_views: list[torch.Tensor]
    late_views: list[torch.Tensor]

    @classmethod
    def make(cls, buffer: FlatBuffer, sources: SnapshotSources) -> CopyPlan:
        early_cuda, early_host = device_split(sources.early_tensors)
        late_cuda, late_host = device_split(sources.late_tensors)
        views = buffer.views
        return cls(
            sources,
            early_cuda,
            early_host,
            late_cuda,
            late_host,
            [views[i] for i in sources.early],
            [views[i] for i in sources.late],
        )

    @property
    def uses_cuda(self) -> bool:
        return bool(self.early_cuda or self.late_cuda)


def device_split(tensors: Sequence[torch.Tensor]) -> tuple[list[int], list[int]]:
    """The positions of the CUDA tensors and of the host tensors: each takes its own copy path."""
    cuda = [i for i, t in enumerate(tensors) if t.is_cuda]
    host = [i for i, t in enumerate(tensors) if not t.is_cuda]
    return cuda, host


def wait_for_event(event: Any, bound_s: float, abandoned: Callable[[], bool], poll_s: float = EVENT_POLL_S) -> bool:
    """Poll a CUDA event (`query()`) until it completes (True), `bound_s` passes or `abandoned()`
    (False). Unlike `event.synchronize()`, this wait ends when the work it waits for never will."""
    deadline = time.monotonic() + bound_s
    pause = min(20e-6, poll_s)
    while not event.query():
        if abandoned() or time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, poll_s)
    return True


@dataclass
class CaptureRequest:
    slot: SnapshotSlot
    key: UploadKey
    stores: list[StoreAddress]
    host_sources: list[torch.Tensor] = field(default_factory=list)
    host_views: list[torch.Tensor] = field(default_factory=list)
    """Late host tensors, copied by the copy thread."""
    cuda_event: Any = None
    """Marks the end of the side stream's copies (None: no CUDA copy, or not issued yet)."""
    cuda_started: Any = None
    """Marks their start on the side stream (for the copy's GPU time)."""
    pending: tuple[SnapshotLayout, SnapshotSources, list[torch.Tensor], Any] | None = None
    """CUDA, new layout: the copy thread allocates the pinned buffer, then issues the copies of (the
    sources; device clones of the early tensors; the compute stream's event at capture)."""
    issued: threading.Event = field(default_factory=threading.Event)
    """Set once the CUDA copies are issued (at once, unless the copy thread allocates the buffer)."""
    done: threading.Event = field(default_factory=threading.Event)
    """Set when the upload to every store ended (sealed or failed)."""
    sealed_on: list[str] = field(default_factory=list)
    streamed: bool = True
    """Whether the capture goes to the stores (False: into this host's buffers only)."""
    persist_world_size: int = 0
    """If not 0, the durable tier persists this snapshot too (of a job of that many ranks)."""


class SnapshotWorker:
    def __init__(
        self,
        log: Any,
        chunk_bytes: int,
        stream_nice: int = 0,
        wait_s: float = 60.0,
        durable: DurableWriter | None = None,
        host_copy: HostCopy | None = None,
        chain: bool = True,
    ) -> None:
        self.log = log
        self.chain = chain
        """Upload each snapshot once, to its first store, which passes it on down the placement's chain
        (`dataplane`); False: to each store in turn, as before chains."""
        self.durable = durable
        self.host_copy = host_copy
        """The slots' files in the host's shared memory (`host_copy`); None: in this process only."""
        self.chunk_bytes = chunk_bytes
        self.stream_nice = stream_nice
        self.wait_s = wait_s
        self.slots = [SnapshotSlot() for _ in range(SLOTS if host_copy is not None else 2)]
        self.skipped = 0
        """Captures given up: the stream stayed stuck even after its uploads were abandoned."""
        self.waits = 0
        """Captures that waited for the previous snapshot to finish streaming."""
        self.stream_skips = 0
        """Due streams skipped (adaptive interval): the previous one was still running after the wait."""
        self.last_stream: tuple[int, float] = (-1, 0.0)
        """(step, wall seconds from its capture to its last seal) of the newest snapshot sealed on every
        one of its stores (the pace the interval follows: `snapshot_cadence`)."""
        self._stream_idle = threading.Event()
        self._stream_idle.set()
        self._streaming: SnapshotSlot | None = None
        """The slot the stream thread reads (not captured into until it is done)."""
        self._stream_started = 0.0
        self._lock = threading.Lock()
        """Guards `_connections` (the stream thread adds, the control thread drops lost stores)."""
        self._captured = threading.Event()
        self._captured.set()
        self._cancel_below_generation = 0
        self._connections: dict[str, StoreConnection] = {}
        self._placed: tuple[int, frozenset[str]] | None = None
        """The stores the newest placement of a generation names for this rank: a snapshot of that
        generation taken before it goes to no other (`drop_stores`)."""
        self.store_token = b""
        self.seal_key = b""
        """The job's seal key: every upload's seal is signed with it."""
        """The job's data-plane token (set once the swapper accepted this member, before any capture)."""
        self._requests: queue.Queue[CaptureRequest | None] = queue.Queue(maxsize=1)
        self._uploads: queue.Queue[CaptureRequest | None] = queue.Queue(maxsize=1)
        self._side_stream: Any = None
        self._last_request: CaptureRequest | None = None
        self.captures = 0
        self.streamed_bytes = 0
        """The bytes of the snapshots streamed (once each, whatever the number of stores)."""
        self.sent_bytes = 0
        """The bytes this member sent to stores (each upload's, complete or not): with chains about
        `streamed_bytes`, without them R times it."""
        self.copy_cpu_s = 0.0
        """CPU time the copy thread spent copying (and checksumming the host-local copy), over all captures."""
        self.stream_cpu_s = 0.0
        """CPU time the stream thread spent streaming (socket copies, checksums), over all captures."""
        self.copy_gpu_s = 0.0
        self.copy_gpu_bytes = 0
        """CUDA: the side stream's time copying device-to-host, and the bytes it copied, over all captures."""
        self._threads = [
            threading.Thread(target=self._copy_loop, name="deadpool-snapshot-copy", daemon=True),
            threading.Thread(target=self._stream_loop, name="deadpool-snapshot-stream", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # ------------------------------------------------------------ training thread

    def capture(
        self,
        key: UploadKey,
        layout: SnapshotLayout,
        sources: SnapshotSources,
        meta: bytes,
        stores: Sequence[StoreAddress],
        persist_world_size: int = 0,
        stream: bool = True,
        stream_wait_s: float | None = None,
    ) -> CaptureRequest | None:
        """Start snapshot `key.step`, streamed to `stores` if `stream`.

        If the previous snapshot is still streaming: `stream_wait_s` None (a forced interval) waits for
        it (`wait_s`, then its uploads are abandoned); a number waits that long, then captures without
        streaming (`request.streamed` False). Returns None if nothing was captured: the stream stayed
        stuck even after its uploads were abandoned, or the stream was skipped and this member keeps no
        crash copy (a capture for this process alone would serve nothing)."""
        if not self._captured.wait(COPY_WAIT_S):  # the last copy never finished (a GPU held by a dead peer)
            self.skipped += 1
            return None
        if stream and not self._stream_idle.is_set():
            self.waits += 1
            streams = self._wait_stream(stream_wait_s)
            if streams is None:
                self.skipped += 1
                return None
            stream = streams
        if not stream and self.host_copy is None:
            return None
        slot = self._slot_to_capture_into()
        slot.step = -1  # invalid until the copy is done
        slot.meta, slot.unchecked, slot.landed_in = meta, None, None
        if self.host_copy is not None:
            self.host_copy.invalidate(self.slots.index(slot))
        request = CaptureRequest(
            slot=slot, key=key, stores=list(stores), streamed=stream, persist_world_size=persist_world_size
        )
        fits = slot.buffer is not None and (slot.buffer.layout is layout or slot.buffer.layout == layout)
        if not fits and any(t.is_cuda for t in sources.tensors):
            request.pending = self._defer_to_copy_thread(layout, sources)
        else:
            if not fits:
                self._fit_slots(layout, slot, pin=False)
            assert slot.buffer is not None
            if slot.plan is None or slot.plan.sources is not sources:
                slot.plan = CopyPlan.make(slot.buffer, sources)
            self._issue(request, slot.plan, sources.early_tensors)
        self._last_request = request
        if stream:
            self._streaming, self._stream_started = slot, time.monotonic()
            self._stream_idle.clear()
        self._captured.clear()
        self._requests.put(request)
        return request

    def _wait_stream(self, stream_wait_s: float | None) -> bool | None:
        """The previous snapshot is still streaming: whether this one streams (None: capture nothing)."""
        if stream_wait_s is None:  # a forced interval: every due snapshot is streamed
            if self._stream_idle.wait(self.wait_s):
                return True
            self._abandon_stream()
            return True if self._stream_idle.wait(ABANDON_WAIT_S) else None
        if self._stream_idle.wait(stream_wait_s):
            return True
        self.stream_skips += 1
        if time.monotonic() - self._stream_started > self.wait_s:  # stuck, not slow: free it for the next
            self._abandon_stream()
        return False

    def _abandon_stream(self) -> None:
        """The stream has run past `wait_s`: its uploads are stuck (a store that takes and never answers)."""
        self.log.warning("snapshot stream still busy: abandoning its uploads", wait_s=self.wait_s)
        self.drop_stores(keep=set())

    def _streaming_slot(self) -> SnapshotSlot | None:
        """The slot a stream is reading now (None when the stream is idle): never captured into nor remade."""
        return self._streaming if not self._stream_idle.is_set() else None

    def _slot_to_capture_into(self) -> SnapshotSlot:
        """The oldest of the slots not being streamed (of two with one step, the older generation's).
        With a crash copy there are three (`_fit_slots`), so a capture beside a busy stream never
        overwrites this member's newest whole step."""
        streaming = self._streaming_slot()
        return min((slot for slot in self.slots if slot is not streaming), key=lambda s: (s.step, s.generation))

    def wait_captured(self, timeout_s: float | None = None) -> bool:
        """Block until the last capture's copy finished (the optimizer pre-hook calls this)."""
        return self._captured.wait(timeout_s)

    def local_steps(self) -> list[int]:
        """The steps this member's own buffers hold whole, newest first."""
        if not self.wait_captured(COPY_WAIT_S):
            return []
        return sorted((slot.step for slot in self.slots if slot.step >= 0 and slot.buffer is not None), reverse=True)

    def local(self, step: int, into: torch.Tensor | None = None) -> SnapshotSlot | None:
        """The local snapshot of `step`, if one of the buffers holds it. `into`: where a crash copy not
        yet checked is read to as it is checked (a newcomer's landing: `landed`)."""
        if not self.wait_captured(COPY_WAIT_S):
            self.log.warning("snapshot copy still running: the local snapshot is not used", wait_s=COPY_WAIT_S)
            return None
        # The newest generation's copy: a rebuild re-captures the step it restored (its SEAL), so two
        # slots may hold one step number, the older one of an abandoned timeline.
        held = [slot for slot in self.slots if slot.step == step and slot.buffer is not None]
        newest = max(held, key=lambda slot: slot.generation, default=None)
        return newest if newest is not None and self._intact(newest, into) else None

    def _intact(self, slot: SnapshotSlot, into: torch.Tensor | None) -> bool:
        """Whether `slot`'s bytes are whole: a crash copy taken from a dead member is checked against its
        checksums the first time a restore asks for its step (read into `into` meanwhile, when it
        fits), and dropped if it fails them. Checking only the one a restore takes, not every copy the
        dead member left, made taking a 1 GiB rank's crash copies 3 times cheaper."""
        if slot.unchecked is None or slot.buffer is None:
            return True
        chunk_bytes, checksums = slot.unchecked
        nbytes = slot.buffer.layout.total_bytes
        if into is not None and self.host_copy is not None and into.numel() >= nbytes:
            for other in self.slots:
                if other.landed_in is into:
                    other.landed_in = None  # overwritten now
            path = self.host_copy.bin_path(self.slots.index(slot))
            intact = read_checked(path, FlatBuffer(slot.buffer.layout, data=into).bytes_view(), chunk_bytes, checksums)
            slot.landed_in = into if intact else None
        else:
            intact = checksums_of(slot.buffer.bytes_view(), chunk_bytes) == checksums
        if intact:
            slot.unchecked = None
            return True
        self.log.warning("host-local copy refused: it fails its checksums", step=slot.step, generation=slot.generation)
        slot.step, slot.unchecked = -1, None
        if self.host_copy is not None:
            self.host_copy.invalidate(self.slots.index(slot))
        return False

    def slot_bytes(self) -> int:
        """The largest snapshot a slot holds (0: none)."""
        return max((s.buffer.layout.total_bytes for s in self.slots if s.buffer is not None and s.step >= 0), default=0)

    def landed(self, slot: SnapshotSlot, landing: torch.Tensor | None) -> FlatBuffer | None:
        """`slot`'s snapshot in `landing`: read there by its check (`local(step, landing)`), else copied
        there now; None without a landing that fits. The slot stays this worker's to capture into."""
        if landing is None or slot.buffer is None or landing.numel() < slot.buffer.layout.total_bytes:
            return None
        if slot.landed_in is not landing:
            nbytes = slot.buffer.layout.total_bytes
            landing[:nbytes].copy_(slot.buffer.data[:nbytes])
        return FlatBuffer(slot.buffer.layout, data=landing)

    def forget_after(self, step: int) -> None:
        """Invalidate local snapshots newer than `step` (their timeline was abandoned)."""
        self.wait_captured(COPY_WAIT_S)  # a copy still running then is of an abandoned generation
        for index, slot in enumerate(self.slots):
            if slot.step > step:
                slot.step = -1
                if self.host_copy is not None:
                    self.host_copy.invalidate(index)

    def newest_local_step(self) -> int:
        """The newest step this member's buffers hold whole (-1: none), without waiting: heartbeats."""
        return max(slot.step for slot in self.slots)

    def take_inherited(self, inherited: Sequence[InheritedSlot]) -> None:
        """A newcomer: a dead member's host-local copies, moved into this member's files, are now its
        own slots (restored from like a survivor's own buffers)."""
        self.wait_captured(COPY_WAIT_S)
        for copy in inherited:
            while len(self.slots) <= copy.index:
                self.slots.append(SnapshotSlot())
            slot = self.slots[copy.index]
            slot.buffer, slot.plan = copy.buffer, None
            slot.step, slot.meta, slot.generation = copy.head.step, copy.head.meta, copy.head.generation
            slot.unchecked = (copy.head.chunk_bytes, copy.head.checksums)

    def _fit_slots(self, layout: SnapshotLayout, into: SnapshotSlot, pin: bool) -> None:
        """A capture in a new layout (the formation's, or the one the optimizer's state appears in at the
        first step): make every slot's buffer for it at once, its memory touched, save the one being
        streamed. The steps the others held were of the old layout; they are dropped. `into`: the slot
        this capture copies into (kept when /dev/shm cannot hold the slots and two are left).

        Fresh memory costs up to 3 s/GB on some hosts (this one). Made slot by slot as each is first
        captured into, it made steps 1-3 of a 1 GiB rank take 3.7-5.7 s instead of 1.1, and those steps
        held the interval's first judgement back by ten steps (`StepStats.recent_step_s` is a median
        over them). Made here, it is one step's cost, or the formation's."""
        streaming = self._streaming_slot()
        refit = [s for s in self.slots if s is not streaming and (s.buffer is None or s.buffer.layout != layout)]
        refit.sort(key=lambda s: s is not into)
        for slot in refit:
            slot.step, slot.plan, slot.buffer = -1, None, None  # the old buffers go before the new are made
        host_copy = self.host_copy
        if host_copy is not None:
            try:
                for slot in refit:
                    slot.buffer = host_copy.buffer(self.slots.index(slot), layout, pin)
                return
            except OSError as exc:  # none there, not some: what this member took goes back to the others
                self.log.warning(
                    "no host-local crash copy: the shared memory cannot hold the snapshot buffers; a crash "
                    "of this member restores from the stores",
                    bytes=layout.total_bytes,
                    buffers=len(refit),
                    error=str(exc),
                )
                self.host_copy = None
                for slot in refit:
                    slot.buffer = None
                    host_copy.discard(self.slots.index(slot))
                kept = [slot for slot in self.slots if slot is streaming] + refit  # `into` first of `refit`
                self.slots = kept[:2]  # without a crash copy no capture goes on beside a busy stream
                refit = [slot for slot in refit if slot in self.slots]
        for slot in refit:
            slot.buffer = FlatBuffer(layout, pin=pin)
            if not pin:  # pinned memory is resident already
                slot.buffer.data.zero_()

    def _publish_local(self, request: CaptureRequest) -> None:
        """The copy is whole: write what the slot's shared-memory file holds, so that it survives this
        process (a crash copy the rank's next holder on this host restores from)."""
        host_copy, slot, key = self.host_copy, request.slot, request.key
        if host_copy is None or slot.buffer is None or slot.step != key.step:
            return
        data = slot.buffer.bytes_view()
        head = SlotHead(
            key.job, key.member, key.rank, key.generation, key.step, slot.meta, CHECKSUM_BYTES, checksums_of(data)
        )
        try:
            host_copy.publish(self.slots.index(slot), head)
        except OSError as exc:
            self.log.warning("host-local copy not written", step=key.step, error=str(exc))

    def drop_stores(self, keep: set[str], generation: int | None = None) -> None:
        """Abandon the uploads to every store not in `keep` (from any thread): lost, or placed elsewhere.
        An upload blocked on one fails at once and the stream goes on with the next store. With the
        `generation` whose placement `keep` is, a snapshot of that generation still streaming skips
        the stores not in it (a lost store is not waited for a connect timeout again)."""
        with self._lock:
            if generation is not None:
                self._placed = (generation, frozenset(keep))
            dropped = [name for name in self._connections if name not in keep]
            connections = [self._connections.pop(name) for name in dropped]
        for conn in connections:
            conn.abort()
        if dropped:
            self.log.info("snapshot uploads to stores no longer placed abandoned", stores=dropped)

    def cancel_uploads_before(self, generation: int) -> None:
        """Abandon uploads (and copies still waiting on the GPU) of older generations: their steps
        will be recomputed."""
        self._cancel_below_generation = generation

    def figures(self) -> dict[str, int | float]:
        """What the worker did, for the member's stats file (`DEADPOOL_STATS_DIR`)."""
        durable = self.durable
        return {
            "snapshots_skipped": self.skipped,
            "snapshot_waits": self.waits,
            "snapshot_stream_skips": self.stream_skips,
            "durable_persisted": durable.persisted if durable else 0,
            "durable_skipped": durable.skipped if durable else 0,
            "durable_bytes": durable.bytes_written if durable else 0,
            "durable_s": durable.seconds if durable else 0.0,
            "durable_failed": durable.failed if durable else 0,
            "durable_disk_full": durable.disk_full if durable else 0,
            "snapshots_streamed": self.captures,
            "snapshot_streamed_bytes": self.streamed_bytes,
            "snapshot_sent_bytes": self.sent_bytes,
            "snapshot_copy_cpu_s": self.copy_cpu_s,
            "snapshot_stream_cpu_s": self.stream_cpu_s,
            "snapshot_copy_gpu_s": self.copy_gpu_s,
            "snapshot_copy_gpu_bytes": self.copy_gpu_bytes,
        }

    def close(self) -> None:
        self._requests.put(None)
        for thread in self._threads:
            thread.join(timeout=10)
        if self.durable is not None:
            self.durable.close()
        for conn in self._connections.values():
            conn.close()

    # ------------------------------------------------------------ issuing the copies

    def _issue(self, request: CaptureRequest, plan: CopyPlan, early_sources: Sequence[torch.Tensor]) -> None:
        """Copy the early host tensors now, queue every CUDA copy on the side stream, and leave the late
        host tensors to the copy thread. `early_sources`: the early tensors (or device clones of them)."""
        late_sources = plan.sources.late_tensors
        if plan.early_host:
            with torch.no_grad():
                torch._foreach_copy_(_pick(plan.early_views, plan.early_host), _pick(early_sources, plan.early_host))
        if plan.uses_cuda:  # pragma: no cover - needs a GPU
            request.cuda_started, request.cuda_event = self._issue_cuda_copy(
                _pick(plan.early_views, plan.early_cuda),
                _pick(early_sources, plan.early_cuda),
                _pick(plan.late_views, plan.late_cuda),
                _pick(late_sources, plan.late_cuda),
                request.pending[3] if request.pending is not None else None,
            )
        request.host_views = _pick(plan.late_views, plan.late_host)
        request.host_sources = _pick(late_sources, plan.late_host)
        request.issued.set()

    def _defer_to_copy_thread(
        self, layout: SnapshotLayout, sources: SnapshotSources
    ) -> tuple[SnapshotLayout, SnapshotSources, list[torch.Tensor], Any]:  # pragma: no cover - needs a GPU
        """A CUDA capture into a layout this slot has no pinned buffer for: the copy thread allocates
        it. The early tensors may change in the next forward, so they are cloned on their device now
        (buffers: small); the copy thread's side stream waits on the compute stream's event."""
        with torch.no_grad():
            clones = [t.clone() for t in sources.early_tensors]
        device = next(t.device for t in sources.tensors if t.is_cuda)
        compute_event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        compute_event.record(torch.cuda.current_stream(device))
        return layout, sources, clones, compute_event

    def _issue_cuda_copy(
        self,
        early_views: list[torch.Tensor],
        early_sources: list[torch.Tensor],
        late_views: list[torch.Tensor],
        late_sources: list[torch.Tensor],
        after: Any,
    ) -> tuple[Any, Any]:  # pragma: no cover - needs a GPU
        """Queue the device-to-host copies on a side stream; returns the events that mark their start
        and their end.

        Buffers (which the next forward may change) are copied first and the compute stream waits for
        them at once; parameters and optimizer state follow, fenced later by `fence_optimizer_step`.
        `after`: an event on the compute stream to start after (copies issued by the copy thread), else
        the compute stream as it is now.
        """
        device = (early_sources or late_sources)[0].device
        compute = torch.cuda.current_stream(device)
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        stream = self._side_stream
        if after is not None:
            stream.wait_event(after)
        else:
            stream.wait_stream(compute)
        started = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        started.record(stream)
        with torch.cuda.stream(stream), torch.no_grad():
            if early_views:
                torch._foreach_copy_(early_views, early_sources, non_blocking=True)
                if after is None:  # copies issued later read clones: the compute stream need not wait
                    early_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    early_done.record(stream)
                    compute.wait_event(early_done)
            if late_views:
                torch._foreach_copy_(late_views, late_sources, non_blocking=True)
        event = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        event.record(stream)
        return started, event

    def fence_optimizer_step(self) -> None:
        """The optimizer step pre-hook: the step may not change what the capture still reads.

        CUDA: the compute stream waits on the copy's event (the CPU does not block, unless the copy
        thread is still allocating a new layout's pinned buffer). Host tensors: wait for the copy
        thread's copy, which has normally finished during forward and backward.
        """
        request = self._last_request
        if request is None:
            return
        if not request.issued.wait(COPY_WAIT_S):
            self.log.warning("snapshot copies not issued in time: the step goes on", step=request.key.step)
        if request.cuda_event is not None:  # pragma: no cover - needs a GPU
            device = self._side_stream.device if self._side_stream is not None else None
            torch.cuda.current_stream(device).wait_event(request.cuda_event)
            if not request.host_views:
                return
        self._captured.wait()

    # ------------------------------------------------------------ snapshot thread

    def _copy_loop(self) -> None:
        pin_this_thread(cpus_from_env(BACKGROUND_CPUS_ENV))
        while True:
            request = self._requests.get()
            if request is None:
                self._uploads.put(None)
                return
            started = time.thread_time()
            try:
                copied = self._copy(request)
                if copied:
                    self._publish_local(request)
                    if not request.streamed:  # a durable step whose stream was skipped: its crash copy
                        self._persist(request)
            except Exception:
                self.log.exception("snapshot copy failed", step=request.key.step)
                copied = False
            finally:
                self.copy_cpu_s += time.thread_time() - started
                request.issued.set()
            if not copied:
                self._captured.set()
            if not copied or not request.streamed:
                request.done.set()
                if request.streamed:
                    self._stream_idle.set()
                continue
            self._uploads.put(request)

    def _stream_loop(self) -> None:
        pin_this_thread(cpus_from_env(BACKGROUND_CPUS_ENV))
        if self.stream_nice > 0:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.stream_nice)
            except OSError as exc:  # not fatal: the stream then competes with training at equal priority
                self.log.warning("could not lower the snapshot stream's priority", error=str(exc))
        while True:
            request = self._uploads.get()
            if request is None:
                return
            started = time.thread_time()
            try:
                streamed = self._stream(request)
                self.streamed_bytes += streamed
                self.captures += 1
                if streamed and len(request.sealed_on) == len(request.stores) > 0:  # from its capture on
                    self.last_stream = (request.key.step, time.monotonic() - self._stream_started)
                self._persist(request)
            except Exception:
                self.log.exception("snapshot stream failed", step=request.key.step)
            finally:
                self.stream_cpu_s += time.thread_time() - started
                request.done.set()
                self._stream_idle.set()

    def _persist(self, request: CaptureRequest) -> None:
        """Offer a durable step to the durable tier, from the thread that holds its slot: the stream
        thread once it is streamed, or the copy thread (before its next copy) if its stream was skipped,
        so that every rank persists the step every rank was told is due."""
        if request.persist_world_size and self.durable is not None and request.slot.buffer is not None:
            key = request.key  # the buffer is this thread's until it is done: copy it aside now
            self.durable.offer(
                key.step, key.rank, request.persist_world_size, key.generation, request.slot.buffer, request.slot.meta
            )

    def _abandoned(self, request: CaptureRequest) -> bool:
        return request.key.generation < self._cancel_below_generation

    def _copy(self, request: CaptureRequest) -> bool:
        """Finish the capture's copies; False if they were given up (the slot stays invalid)."""
        slot = request.slot
        if request.pending is not None:  # pragma: no cover - needs a GPU
            layout, sources, clones, _ = request.pending
            if slot.buffer is None or slot.buffer.layout != layout:
                self._fit_slots(layout, slot, pin=True)  # before `_captured`: no capture reads the slots meanwhile
            assert slot.buffer is not None
            slot.plan = CopyPlan.make(slot.buffer, sources)
            self._issue(request, slot.plan, clones)
        if request.cuda_event is not None and not wait_for_event(  # pragma: no cover - needs a GPU
            request.cuda_event, COPY_WAIT_S, lambda: self._abandoned(request)
        ):
            self.log.warning("snapshot copy given up", step=request.key.step, abandoned=self._abandoned(request))
            return False
        if request.cuda_started is not None:  # pragma: no cover - needs a GPU
            self.copy_gpu_s += request.cuda_started.elapsed_time(request.cuda_event) / 1000
            self.copy_gpu_bytes += sum(v.numel() * v.element_size() for v in _cuda_views(slot.plan))
        if request.host_views:
            with torch.no_grad():
                torch._foreach_copy_(request.host_views, request.host_sources)
        if self._abandoned(request):
            return False
        slot.step, slot.generation = request.key.step, request.key.generation
        self._captured.set()
        return True

    def _stream(self, request: CaptureRequest) -> int:
        """Upload the snapshot to its stores, once, to the first, which passes it on down the rest
        (`chain`); then to each store the chain missed, directly. Returns its size in bytes (0 if
        cancelled)."""
        buffer = request.slot.buffer
        assert buffer is not None
        data = buffer.bytes_view()
        key = request.key

        def cancelled() -> bool:
            return key.generation < self._cancel_below_generation

        for position, address in enumerate(request.stores):
            if address.store in request.sealed_on:
                continue  # a copy the chain made
            if not self._still_placed(key, address.store):
                continue  # placed elsewhere since the snapshot was taken: lost, most likely
            rest = [a for a in request.stores[position + 1 :] if self._still_placed(key, a.store)] if self.chain else []
            with self._lock:
                conn = self._connections.get(address.store)
                if conn is None or conn.address != address:
                    if conn is not None:
                        conn.close()
                    conn = self._connections[address.store] = StoreConnection(
                        address, token=self.store_token, seal_key=self.seal_key
                    )
            try:
                self.sent_bytes += len(data)
                chained = conn.upload(
                    key, data, self.chunk_bytes, request.slot.meta, cancelled, [s.store for s in rest]
                )
                request.sealed_on += [address.store, *chained.sealed]
                if chained.stopped:
                    self.log.warning(
                        "snapshot chain stopped short", step=key.step, store=address.store, reason=chained.stopped
                    )
            except SnapshotCancelledError:
                return 0
            except StoreClientError as exc:
                self.log.warning("snapshot not stored", step=key.step, store=address.store, reason=str(exc))
        return len(data)

    def _still_placed(self, key: UploadKey, store: str) -> bool:
        placed = self._placed
        return placed is None or placed[0] != key.generation or store in placed[1]


def _pick(items: Sequence[torch.Tensor], positions: list[int]) -> list[torch.Tensor]:
    """`items` at `positions`; the list itself when they are all of it (the usual case, every tensor on
    one device: a capture on the training thread then builds no lists)."""
    if len(positions) == len(items) and isinstance(items, list):
        return items
    return [items[i] for i in positions]


def _cuda_views(plan: CopyPlan | None) -> list[torch.Tensor]:
    """The buffer views a plan fills from CUDA tensors."""
    if plan is None:
        return []
    return _pick(plan.early_views, plan.early_cuda) + _pick(plan.late_views, plan.late_cuda)
