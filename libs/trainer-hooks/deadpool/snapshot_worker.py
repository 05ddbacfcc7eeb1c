"""Per-step snapshots off the training thread: two ping-pong buffers, a capture, a stream.

After optimizer step s the training thread calls `capture(s, …)`. The thread copies the state into the
buffer not holding the newest snapshot (`torch._foreach_copy_`, which releases the GIL) and then
streams it to the rank's stores. The next optimizer step waits in `wait_captured()` (an optimizer step
pre-hook) only if that copy is still running; it normally finished long before, during forward and
backward.

Every rank snapshots every step it is due, never skipping one. A step commits only once every rank's
snapshot of it is stored, so a skip decided by one rank alone (its stream still busy) left ranks
holding different steps, and on a saturated host an earlier 4-rank run fell 6 steps behind. Instead,
if the previous snapshot is still streaming when the next is due, the capture waits for it
(`wait_s`, then the stuck uploads are abandoned): the committed step then trails training by at most
one snapshot, and the price of a stream slower than a step is paid in step time, where it shows.

On CUDA the copy is issued on a side stream into pinned buffers and the pre-hook makes the compute
stream wait on the copy's event: the GPU orders the two, the CPU never blocks.

Two threads: the copy (the next optimizer step may wait for it) and the stream. The stream has a
whole step to finish; if it has not, the next capture waits for it. Both run at normal priority by
default. `stream_nice` lowers the stream's priority, for CPU training that keeps every core busy:
the stream then runs in the moments training leaves idle, which took the GPT-medium step-time ratio
from 1.056 to 1.023 on 2 cores. The price, on a saturated host: captures wait for the stream (before
captures waited, snapshots fell behind by several steps: at nice 19 a 4-rank tiny-GPT job that failed
after step 7 went back to step 1), and a
SIGKILLed member takes 1.5 s to die, because its low-priority thread must be scheduled to exit
(docs/performance.md).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from deadpool.durable_tier import DurableWriter
from deadpool.snapshot_layout import FlatBuffer, SnapshotLayout
from deadpool.store_client import SnapshotCancelledError, StoreClientError, StoreConnection, UploadKey
from deadpool.training_state import SnapshotSources
from deadpool_protocol import StoreAddress

__all__ = ["CaptureRequest", "SnapshotSlot", "SnapshotWorker"]

ABANDON_WAIT_S = 5.0
"""After abandoning a stuck stream's uploads, how long a capture waits for the stream to notice."""


@dataclass
class SnapshotSlot:
    """One of the two ping-pong buffers, and which step it holds (-1: nothing valid)."""

    buffer: FlatBuffer | None = None
    step: int = -1
    meta: bytes = b""
    early_views: list[torch.Tensor] = field(default_factory=list)
    late_views: list[torch.Tensor] = field(default_factory=list)
    sources: SnapshotSources | None = None
    """The sources the two view lists were selected for (rebuilt when the plan changes)."""


@dataclass
class CaptureRequest:
    slot: SnapshotSlot
    key: UploadKey
    sources: list[torch.Tensor]
    views: list[torch.Tensor]
    stores: list[StoreAddress]
    cuda_event: Any = None
    done: threading.Event = field(default_factory=threading.Event)
    """Set when the upload to every store ended (sealed or failed)."""
    sealed_on: list[str] = field(default_factory=list)
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
    ) -> None:
        self.log = log
        self.durable = durable
        self.chunk_bytes = chunk_bytes
        self.stream_nice = stream_nice
        self.wait_s = wait_s
        self.slots = [SnapshotSlot(), SnapshotSlot()]
        self.skipped = 0
        """Captures given up: the stream stayed stuck even after its uploads were abandoned."""
        self.waits = 0
        """Captures that waited for the previous snapshot to finish streaming."""
        self._idle = threading.Event()
        self._idle.set()
        self._lock = threading.Lock()
        """Guards `_connections` (the stream thread adds, the control thread drops lost stores)."""
        self._captured = threading.Event()
        self._captured.set()
        self._cancel_below_generation = 0
        self._connections: dict[str, StoreConnection] = {}
        self._requests: queue.Queue[CaptureRequest | None] = queue.Queue(maxsize=1)
        self._uploads: queue.Queue[CaptureRequest | None] = queue.Queue(maxsize=1)
        self._side_stream: Any = None
        self._last_request: CaptureRequest | None = None
        self.captures = 0
        self.copy_cpu_s = 0.0
        """CPU time the copy thread spent copying, over all captures."""
        self.stream_cpu_s = 0.0
        """CPU time the stream thread spent streaming (socket copies, checksums), over all captures."""
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
    ) -> CaptureRequest | None:
        """Start snapshot `key.step`, first waiting for the previous one to finish streaming (bounded).
        Returns None only if the stream stayed stuck even after its uploads were abandoned."""
        if not self._idle.is_set():
            self.waits += 1
            if not self._idle.wait(self.wait_s):
                self.log.warning("snapshot stream still busy: abandoning its uploads", wait_s=self.wait_s)
                self.drop_stores(keep=set())
                if not self._idle.wait(ABANDON_WAIT_S):
                    self.skipped += 1
                    return None
        slot = min(self.slots, key=lambda s: s.step)  # overwrite the older of the two
        if slot.buffer is None or (slot.buffer.layout is not layout and slot.buffer.layout != layout):
            slot.buffer = FlatBuffer(layout, pin=_on_cuda(sources.tensors))
            slot.sources = None
        if slot.sources is not sources:
            views = slot.buffer.views
            slot.early_views = [views[i] for i in sources.early]
            slot.late_views = [views[i] for i in sources.late]
            slot.sources = sources
        slot.step = -1  # invalid until the copy is done
        slot.meta = meta
        early_views, early_sources = slot.early_views, sources.early_tensors
        request = CaptureRequest(
            slot=slot,
            key=key,
            sources=sources.late_tensors,
            views=slot.late_views,
            stores=list(stores),
            persist_world_size=persist_world_size,
        )
        if _on_cuda(sources.tensors):
            request.cuda_event = self._issue_cuda_copy(request, early_views, early_sources)
        elif early_views:
            with torch.no_grad():
                torch._foreach_copy_(early_views, early_sources)
        self._last_request = request
        self._idle.clear()
        self._captured.clear()
        self._requests.put(request)
        return request

    def wait_captured(self, timeout_s: float | None = None) -> bool:
        """Block until the last capture's copy finished (the optimizer pre-hook calls this)."""
        return self._captured.wait(timeout_s)

    def local(self, step: int) -> SnapshotSlot | None:
        """The local snapshot of `step`, if one of the buffers holds it."""
        self.wait_captured()
        for slot in self.slots:
            if slot.step == step and slot.buffer is not None:
                return slot
        return None

    def forget_after(self, step: int) -> None:
        """Invalidate local snapshots newer than `step` (their timeline was abandoned)."""
        self.wait_captured()
        for slot in self.slots:
            if slot.step > step:
                slot.step = -1

    def drop_stores(self, keep: set[str]) -> None:
        """Abandon the uploads to every store not in `keep` (from any thread): lost, or placed elsewhere.
        An upload blocked on one fails at once and the stream goes on with the next store."""
        with self._lock:
            dropped = [name for name in self._connections if name not in keep]
            connections = [self._connections.pop(name) for name in dropped]
        for conn in connections:
            conn.abort()
        if dropped:
            self.log.info("snapshot uploads to stores no longer placed abandoned", stores=dropped)

    def cancel_uploads_before(self, generation: int) -> None:
        """Abandon uploads of older generations: their steps will be recomputed."""
        self._cancel_below_generation = generation

    def close(self) -> None:
        self._requests.put(None)
        for thread in self._threads:
            thread.join(timeout=10)
        if self.durable is not None:
            self.durable.close()
        for conn in self._connections.values():
            conn.close()

    # ------------------------------------------------------------ CUDA path

    def _issue_cuda_copy(
        self, request: CaptureRequest, early_views: list[torch.Tensor], early_sources: list[torch.Tensor]
    ) -> Any:
        """Queue the device-to-host copies on a side stream; returns the event that marks their end.

        Buffers (which the next forward may change) are copied first and the compute stream waits for
        them at once; parameters and optimizer state follow, fenced later by `fence_optimizer_step`.
        """
        device = request.sources[0].device if request.sources else early_sources[0].device
        compute = torch.cuda.current_stream(device)
        if self._side_stream is None:
            self._side_stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        stream = self._side_stream
        stream.wait_stream(compute)
        with torch.cuda.stream(stream), torch.no_grad():
            if early_views:
                torch._foreach_copy_(early_views, early_sources, non_blocking=True)
                early_done = torch.cuda.Event()  # type: ignore[no-untyped-call]
                early_done.record(stream)
                compute.wait_event(early_done)
            if request.views:
                torch._foreach_copy_(request.views, request.sources, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        return event

    def fence_optimizer_step(self) -> None:
        """The optimizer step pre-hook: the step may not change what the capture still reads.

        CUDA: the compute stream waits on the copy's event (the CPU does not block). CPU: wait for the
        snapshot thread's copy, which has normally finished during forward and backward.
        """
        request = self._last_request
        if request is not None and request.cuda_event is not None:
            device = request.sources[0].device if request.sources else None
            torch.cuda.current_stream(device).wait_event(request.cuda_event)
            return
        self._captured.wait()

    # ------------------------------------------------------------ snapshot thread

    def _copy_loop(self) -> None:
        while True:
            request = self._requests.get()
            if request is None:
                self._uploads.put(None)
                return
            started = time.thread_time()
            try:
                self._copy(request)
            except Exception:
                self.log.exception("snapshot copy failed", step=request.key.step)
                self._captured.set()
                request.done.set()
                self._idle.set()
                continue
            finally:
                self.copy_cpu_s += time.thread_time() - started
            self._uploads.put(request)

    def _stream_loop(self) -> None:
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
                self._stream(request)
                self.captures += 1
                if request.persist_world_size and self.durable is not None and request.slot.buffer is not None:
                    key = request.key  # the buffer is this thread's until it is done: copy it aside now
                    self.durable.offer(
                        key.step,
                        key.rank,
                        request.persist_world_size,
                        key.generation,
                        request.slot.buffer,
                        request.slot.meta,
                    )
            except Exception:
                self.log.exception("snapshot stream failed", step=request.key.step)
            finally:
                self.stream_cpu_s += time.thread_time() - started
                request.done.set()
                self._idle.set()

    def _copy(self, request: CaptureRequest) -> None:
        if request.cuda_event is not None:
            request.cuda_event.synchronize()
        else:
            with torch.no_grad():
                torch._foreach_copy_(request.views, request.sources)
        request.slot.step = request.key.step
        self._captured.set()

    def _stream(self, request: CaptureRequest) -> None:
        buffer = request.slot.buffer
        assert buffer is not None
        data = buffer.bytes_view()
        key = request.key

        def cancelled() -> bool:
            return key.generation < self._cancel_below_generation

        for address in request.stores:
            with self._lock:
                conn = self._connections.get(address.store)
                if conn is None or conn.address != address:
                    if conn is not None:
                        conn.close()
                    conn = self._connections[address.store] = StoreConnection(address)
            try:
                conn.upload(key, data, self.chunk_bytes, request.slot.meta, cancelled)
                request.sealed_on.append(address.store)
            except SnapshotCancelledError:
                return
            except StoreClientError as exc:
                self.log.warning("snapshot not stored", step=key.step, store=address.store, reason=str(exc))


def _on_cuda(tensors: Sequence[torch.Tensor]) -> bool:
    return bool(tensors) and tensors[0].is_cuda
