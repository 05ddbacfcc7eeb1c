"""A warm spare's landing buffer: memory of the job's snapshot size, faulted in while the spare waits,
which its restore fetches straight into.

Memory a process has never touched costs a page fault per 4 KiB on first touch: about 3 s per GB on
this project's VMs, against 0.3 s to stream the GB from a store. A spare that allocated its buffer at
the moment of recovery restored at 0.36 GB/s; into memory faulted in beforehand it restores at the
data plane's pace. So a spare learns the largest snapshot a rank of its job streams (the swapper says
it in the hello's answer and in each `Commit`), and a thread of its own faults in a buffer that large,
a slice at a time, while the spare waits (`want`). The restore takes the buffer (`take`); it is then
the restored rank's (its optimizer state stays in it), and the landing is spent, unless the restore
gives it back unused (`give_back`: the ranks found no step in common in their own buffers, and the
swapper's next link fetches from a store into it). A spare that restores
from the crash copy a dead member left on its host reads that copy into the landing as it checks it
(`SnapshotWorker.local`): the copy's slot goes on being captured into, and the optimizer's state needs
memory of its own.

Bounds: the buffer is never larger than `limit_bytes`, the most a snapshot of the spare's model can
hold (`snapshot_bytes_max`), whatever size a message names; it grows (a larger snapshot was heard)
but never shrinks. Taking it stops the faulting within one slice (`FAULT_SLICE_BYTES`): a buffer not
yet wholly faulted in is taken all the same (its untouched rest faults as the fetch writes it), and
one smaller than the snapshot is not taken at all (the restore allocates, as before).
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Any

import torch

from deadpool.pinned_memory import pinned_bytes

__all__ = ["CLOSE_WAIT_S", "FAULT_SLICE_BYTES", "SpareLanding"]

CLOSE_WAIT_S = 5.0
"""How long `close` waits for the faulting thread (it stops within one slice)."""
FAULT_SLICE_BYTES = 16 << 20
"""Faulted in at a time (about 50 ms on a cold VM page): the longest `take` waits for the faulting."""


class SpareLanding:
    """One spare's landing buffer (thread-safe: `want` from the control thread, `take` from the
    training thread, the faulting on a daemon thread of its own)."""

    def __init__(self, limit_bytes: int, pin: bool, log: Any) -> None:
        if limit_bytes < 0:
            raise ValueError("limit_bytes is a number of bytes")
        self.limit_bytes = limit_bytes
        self.pin = pin
        self.log = log
        self._cond = threading.Condition()
        self._wanted = 0
        """Bytes the buffer should hold (the largest snapshot heard, within `limit_bytes`)."""
        self._buffer: torch.Tensor | None = None
        self._faulted = 0
        """Bytes of `_buffer` touched so far."""
        self._started = False
        self._spent = False
        self._lent: torch.Tensor | None = None
        """The buffer a restore took, until it is given back or the landing is closed."""
        self._thread = threading.Thread(target=self._fault_in, name="deadpool-landing", daemon=True)

    @property
    def faulted_bytes(self) -> int:
        with self._cond:
            return self._faulted if not self._spent else 0

    def wait_faulted(self, nbytes: int, timeout_s: float) -> bool:
        """Wait until `nbytes` of the landing are faulted in (benchmarks and tests), at most `timeout_s`."""
        with self._cond:
            return self._cond.wait_for(lambda: self._spent or self._faulted >= nbytes, timeout_s) and not self._spent

    def start(self) -> None:
        """Begin faulting in (after the spare's warm-up, whose imports would otherwise share the CPU)."""
        with self._cond:
            if self._started:
                return
            self._started = True
        self._thread.start()

    def want(self, nbytes: int) -> bool:
        """A rank of the job streamed a snapshot of `nbytes`: hold a buffer at least that large. Returns
        whether sizes are still wanted (False once the landing is spent: taken, or closed)."""
        with self._cond:
            if self._spent:
                return False
            if nbytes <= self._wanted:
                return True
            if nbytes > self.limit_bytes:
                if self._wanted < self.limit_bytes:
                    self.log.warning(
                        "a snapshot larger than this model's can be was announced; the landing stops at the bound",
                        announced_bytes=nbytes,
                        limit_bytes=self.limit_bytes,
                    )
                nbytes = self.limit_bytes
            if nbytes <= self._wanted:
                return True
            self._wanted = nbytes
            self._cond.notify_all()
            return True

    def take(self, nbytes: int) -> torch.Tensor | None:
        """The landing buffer for a snapshot of `nbytes`, exactly that long (a view of it), or None when
        it is smaller (or already taken). Once taken it is the caller's: the landing is spent, and any
        later call gets None."""
        with self._cond:
            if self._spent:
                return None
            self._spent = True
            self._cond.notify_all()
            buffer, faulted = self._buffer, self._faulted
            self._buffer = None
        if buffer is None or buffer.numel() < nbytes:
            self.log.info("no landing buffer for this snapshot", snapshot_bytes=nbytes, landing_bytes=faulted)
            return None
        with self._cond:
            self._lent = buffer
        self.log.info("restore lands in the warm buffer", snapshot_bytes=nbytes, faulted_bytes=faulted)
        return buffer[:nbytes]

    def give_back(self) -> None:
        """The restore that took the buffer used none of it: the next one takes it again (no more is
        faulted in; a larger size heard meanwhile makes `take` refuse it, as before)."""
        with self._cond:
            if self._lent is not None:
                self._buffer, self._lent, self._spent = self._lent, None, False
                self.log.info("the landing was given back unused")

    def close(self) -> None:
        """Free the buffer and end the faulting thread, waiting for it (at most `CLOSE_WAIT_S`): a thread
        still inside a torch op while the interpreter exits aborts the process ("terminate called
        without an active exception": a spare exited with SIGABRT at the job's end)."""
        with self._cond:
            self._spent = True
            self._buffer = self._lent = None
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(CLOSE_WAIT_S)

    def _holds(self, nbytes: int) -> bool:
        return self._buffer is not None and self._buffer.numel() >= nbytes

    def _fault_in(self) -> None:
        """The faulting thread: allocate `_wanted` bytes, touch them a slice at a time, then wait for a
        larger size or the end."""
        while True:
            with self._cond:
                while not self._spent and (self._wanted == 0 or self._holds(self._wanted)):
                    self._cond.wait()
                if self._spent:
                    return
                size = self._wanted
                self._buffer, self._faulted = None, 0  # a smaller one is dropped before the larger is made
            started = time.monotonic()
            try:
                buffer = pinned_bytes(size) if self.pin else torch.empty(size, dtype=torch.uint8)
            except (MemoryError, RuntimeError) as exc:  # torch's allocator raises RuntimeError
                self.log.warning("no memory for a landing buffer: restores allocate", bytes=size, error=str(exc))
                with self._cond:
                    self._spent = True
                return
            with self._cond:
                if self._spent:
                    return
                self._buffer = buffer
            for offset in range(0, size, FAULT_SLICE_BYTES):
                with self._cond:  # `take` waits at most this slice
                    if self._spent or self._buffer is not buffer:
                        return
                    # memset, not a torch op: no intra-op threads, and the GIL dropped while it runs
                    ctypes.memset(buffer.data_ptr() + offset, 0, min(FAULT_SLICE_BYTES, size - offset))
                    self._faulted = min(size, offset + FAULT_SLICE_BYTES)
                    self._cond.notify_all()
            self.log.info("landing buffer warm", bytes=size, took_s=round(time.monotonic() - started, 3))
