"""The durable tier: snapshots persisted to a directory as `torch.distributed.checkpoint` files, off the
training thread, and a whole job resumed from them when no RAM copy is left.

    DIR/step_000000120/rank_00003/       a DCP checkpoint of rank 3's snapshot of step 120 (`.metadata`,
                                         `__0_0.distcp`): its tensors by name (`param.0`, `buffer.2`,
                                         `optim.5.exp_avg`, ...), readable with `dcp.load` or
                                         `torch.distributed.checkpoint.format_utils.dcp_to_torch_save`
    DIR/step_000000120/rank_00003.json   its manifest, written last and atomically: job, step, rank,
                                         world size, generation, the XXH3-64 of every tensor's bytes, and
                                         the snapshot's own manifest (RNG states, hyper-parameters,
                                         optimizer scalars, layout) in base64

A step is complete when every rank's manifest is there. Every rank persists the same steps, from the
snapshot it has just streamed to its stores. Every `every_steps` steps is a rule every rank applies
alike. Every `every_s` seconds cannot be one (the ranks' clocks differ), so a time-based persist waits
for the next step on a grid (`grid_steps`): ranks in lockstep reach the same grid step, and the rare
pair that straddles a grid step differs once, which resuming copes with (the newest step all have).
The stream thread copies the buffer (a memory copy) and a writer thread of its own writes the files,
so neither the training thread nor a step ever waits for the disk. A persist still running when the
next is due makes that one skipped (counted); resuming takes the newest step every rank has. A persist
that fails (a full disk above all: DCP raises its `CheckpointException`, a BaseException) is logged with
its reason, its partial files are removed, and the next due persist is tried as usual.

Resuming (`deadpool launch --resume-from DIR`) happens when the job forms: the ranks agree on the
newest step that each of them has complete and intact (`agree_on_step`, a few integer all-reduces in the
new group), each loads its own files and verifies every tensor's checksum, and training goes on from
there exactly as after a swap, so the result equals a run that never stopped.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import os
import queue
import shutil
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from deadpool.snapshot_layout import FlatBuffer
from deadpool.step_agreement import agree_on_newest
from deadpool.training_state import SnapshotMeta
from deadpool_protocol.errors import DeadPoolError

__all__ = [
    "DurableError",
    "DurableWriter",
    "PersistFailure",
    "agree_on_step",
    "complete_steps",
    "load_rank",
    "rank_files",
]

FORMAT_VERSION = 2
"""2: the metadata carries the state tree (param groups, non-tensor optimizer state, registered objects)."""
MANIFEST_BYTES_MAX = 64 * 1024 * 1024
"""A manifest holds one checksum per tensor and the snapshot's layout: far below this."""
NO_STEP = -1

warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


class DurableError(DeadPoolError, RuntimeError):
    """A persisted step cannot be used (missing, of another job or world, or failing its checksums)."""


def step_dir(directory: Path, step: int) -> Path:
    return directory / f"step_{step:09d}"


def rank_files(directory: Path, step: int, rank: int) -> tuple[Path, Path]:
    """(the DCP checkpoint directory, the manifest) of one rank's persisted step."""
    base = step_dir(directory, step)
    return base / f"rank_{rank:05d}", base / f"rank_{rank:05d}.json"


def _checksums(buffer: FlatBuffer) -> dict[str, int]:
    data = buffer.bytes_view()
    return {s.name: xxhash.xxh3_64_intdigest(data[s.offset : s.offset + s.nbytes]) for s in buffer.layout.specs}


def write_step(
    directory: Path, job: str, step: int, rank: int, world_size: int, generation: int, buffer: FlatBuffer, meta: bytes
) -> None:
    """Persist one rank's snapshot of `step`: the DCP files, then the manifest that makes them count."""
    checkpoint, manifest = rank_files(directory, step, rank)
    if checkpoint.exists():
        shutil.rmtree(checkpoint)  # a partial write of an earlier attempt (it has no manifest)
    checkpoint.mkdir(parents=True)
    dcp_save(dict(buffer.by_name), checkpoint_id=str(checkpoint), no_dist=True)
    body = {
        "format": FORMAT_VERSION,
        "job": job,
        "step": step,
        "rank": rank,
        "world_size": world_size,
        "generation": generation,
        "checksums": _checksums(buffer),
        "meta": base64.b64encode(meta).decode(),
        "t": time.time(),
    }
    partial = manifest.with_suffix(".json.partial")
    with open(partial, "w") as out:
        json.dump(body, out)
        out.flush()
        os.fsync(out.fileno())
    os.replace(partial, manifest)


def prune(directory: Path, rank: int, keep: int) -> None:
    """Keep this rank's newest `keep` persisted steps (a step's directory goes with its last rank), and
    none of its partial ones."""
    remove_partials(directory, rank)
    steps = sorted(_steps_with_manifest(directory, rank), reverse=True)
    for step in steps[keep:]:
        checkpoint, manifest = rank_files(directory, step, rank)
        manifest.unlink(missing_ok=True)
        shutil.rmtree(checkpoint, ignore_errors=True)
        with contextlib.suppress(OSError):  # other ranks' files are still there
            step_dir(directory, step).rmdir()


def remove_partials(directory: Path, rank: int) -> list[Path]:
    """Remove this rank's files of steps it never finished (a write that failed or a process that died
    mid-write): a step counts only once its manifest is there. Other ranks' files are theirs to remove:
    they may be writing them now. Returns what was removed."""
    removed: list[Path] = []
    for entry in sorted(directory.glob("step_*")) if directory.is_dir() else []:
        checkpoint, manifest = entry / f"rank_{rank:05d}", entry / f"rank_{rank:05d}.json"
        partial = manifest.with_suffix(".json.partial")
        leftovers = [partial] if partial.exists() else []
        if checkpoint.exists() and not manifest.is_file():
            leftovers.append(checkpoint)
        for path in leftovers:
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):  # best effort, as rmtree's: the next persist tries again
                    path.unlink()
        if leftovers:
            with contextlib.suppress(OSError):  # other ranks' files are still there
                entry.rmdir()
        removed += leftovers
    return removed


def _steps_with_manifest(directory: Path, rank: int) -> list[int]:
    steps = []
    for entry in directory.glob("step_*") if directory.is_dir() else []:
        if (entry / f"rank_{rank:05d}.json").is_file():
            try:
                steps.append(int(entry.name.removeprefix("step_")))
            except ValueError:
                continue
    return steps


def complete_steps(directory: Path, world_size: int) -> list[int]:
    """Steps every rank of a `world_size` job has a manifest for, newest first."""
    steps = []
    for entry in directory.glob("step_*") if directory.is_dir() else []:
        try:
            step = int(entry.name.removeprefix("step_"))
        except ValueError:
            continue
        if all((entry / f"rank_{r:05d}.json").is_file() for r in range(world_size)):
            steps.append(step)
    return sorted(steps, reverse=True)


def load_rank(directory: Path, step: int, rank: int, world_size: int) -> tuple[FlatBuffer, SnapshotMeta]:
    """Load and verify one rank's persisted step (of any job name: resuming is how a job continues
    under a new one). Raises DurableError saying what is wrong."""
    checkpoint, manifest = rank_files(directory, step, rank)
    try:
        if manifest.stat().st_size > MANIFEST_BYTES_MAX:
            raise DurableError(f"{manifest} is larger than {MANIFEST_BYTES_MAX} bytes")
        body = json.loads(manifest.read_text())
        meta = SnapshotMeta.decode(base64.b64decode(body["meta"]))
        checksums = {str(k): int(v) for k, v in body["checksums"].items()}
        fields = (int(body["format"]), int(body["step"]), int(body["rank"]), int(body["world_size"]))
    except DurableError:
        raise
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DurableError(f"{manifest}: unreadable manifest: {exc}") from exc
    if fields != (FORMAT_VERSION, step, rank, world_size) or meta.step != step:
        raise DurableError(
            f"{manifest} is format/step/rank/world {fields}, not {(FORMAT_VERSION, step, rank, world_size)}"
        )
    buffer = FlatBuffer(meta.layout)
    if set(checksums) != set(buffer.by_name):
        raise DurableError(f"{manifest}: its checksums do not name the layout's tensors")
    try:
        dcp_load(dict(buffer.by_name), checkpoint_id=str(checkpoint), no_dist=True)
    except Exception as exc:
        raise DurableError(f"{checkpoint}: cannot be read: {exc}") from exc
    for name, got in _checksums(buffer).items():
        if got != checksums[name]:
            raise DurableError(
                f"{checkpoint}: tensor {name} fails its checksum ({got:#018x}, manifest {checksums[name]:#018x})"
            )
    return buffer, meta


def agree_on_step(
    directory: Path, rank: int, world_size: int, group: Any, device: torch.device
) -> tuple[int, FlatBuffer | None, SnapshotMeta | None, list[str]]:
    """With every rank of `group`: the newest persisted step that each rank has complete and intact,
    loaded (`step_agreement`). Returns (step, buffer, meta, what was refused on this rank); step is
    NO_STEP if none."""
    refused: list[str] = []
    loaded: dict[int, tuple[FlatBuffer, SnapshotMeta]] = {}

    def intact(step: int) -> bool:
        if step not in loaded:
            try:
                loaded[step] = load_rank(directory, step, rank, world_size)
            except DurableError as exc:
                refused.append(str(exc))
                return False
        return True

    step = agree_on_newest(complete_steps(directory, world_size), group, device, intact)
    if step == NO_STEP:
        return NO_STEP, None, None, refused
    buffer, meta = loaded[step]
    return step, buffer, meta, refused


@dataclass(frozen=True)
class PersistFailure:
    """Why a persist failed, as the writer logged it."""

    step: int
    path: str
    """The rank's checkpoint directory of that step (removed again)."""
    reason: str
    disk_full: bool
    bytes_needed: int
    """The snapshot's size: what the persist tried to write."""
    bytes_free: int
    """Free bytes on the directory's file system after the partial files were removed; -1 if unknown."""


def _causes(exc: BaseException) -> list[BaseException]:
    """`exc` and every exception behind it: DCP's per-rank failures (`CheckpointException.failures`, each
    wrapping what that rank raised), exception groups, causes and contexts."""
    found: list[BaseException] = []
    pending = [exc]
    while pending:
        current = pending.pop(0)
        if any(current is seen for seen in found):
            continue
        found.append(current)
        if isinstance(current, CheckpointException):
            pending.extend(failure for failure, _trace in current.failures.values())
        if isinstance(current, BaseExceptionGroup):
            pending.extend(current.exceptions)
        pending.extend(e for e in (current.__cause__, current.__context__) if e is not None)
    return found


def _is_disk_full(causes: list[BaseException]) -> bool:
    """ENOSPC anywhere behind the failure. DCP's file writer can turn it into a RuntimeError of torch's
    own that names it only in its text."""
    no_space = os.strerror(errno.ENOSPC)
    return any((isinstance(e, OSError) and e.errno == errno.ENOSPC) or no_space in str(e) for e in causes)


def _cause_text(causes: list[BaseException]) -> str:
    """The most telling cause: the first OS error, else the deepest exception that is not DCP's wrapper."""
    for exc in causes:
        if isinstance(exc, OSError):
            return f"{type(exc).__name__}: {exc}"
    plain = [e for e in causes if not isinstance(e, CheckpointException)] or causes
    return f"{type(plain[-1]).__name__}: {plain[-1]}"


def _free_bytes(path: Path) -> int:
    """Free bytes on the file system of `path`, or of its nearest parent that exists; -1 if none."""
    for candidate in (path, *path.parents):
        with contextlib.suppress(OSError):
            return shutil.disk_usage(candidate).free
    return -1


@dataclass
class _Job:
    step: int
    rank: int
    world_size: int
    generation: int
    meta: bytes
    buffer: FlatBuffer


CLOSE_WAIT_S = 10.0
"""How long `close` gives a write still running; then it is abandoned (the writer is a daemon thread).
Well inside the launcher's `FINISH_GRACE_S` (30 s) for a member to exit once its job finished."""


class DurableWriter:
    """Persists snapshots on a thread of its own; `offer` is called by the worker's stream thread (or its
    copy thread, for a durable step whose stream was skipped).

    A persist that fails (a full disk, any other write error) is logged with its reason and counted
    (`failed`, `disk_full`, `last_failure`), its partial files are removed, and the next due persist is
    tried as usual: the writer lives on. Only SystemExit and KeyboardInterrupt (which DCP wraps in its
    `CheckpointException` too) end the thread; later persists are then refused as "the writer has
    stopped", never queued to no one.
    """

    def __init__(
        self,
        directory: str,
        job: str,
        every_steps: int,
        keep: int,
        log: Any,
        every_s: float = 0.0,
        grid_steps: int = 10,
        close_wait_s: float = CLOSE_WAIT_S,
    ) -> None:
        if every_steps < 0 or keep < 1 or every_s < 0 or grid_steps < 1 or not (every_steps or every_s):
            raise ValueError("persist every N steps or T seconds (N or T positive), keeping at least 1")
        if close_wait_s < 0:
            raise ValueError("close_wait_s must not be negative")
        self.directory = Path(directory)
        self.job = job
        self.every_steps = every_steps
        self.every_s = every_s
        self.grid_steps = grid_steps
        self._last_t = time.monotonic()
        self._last_step = 0
        """The step last asked about (`due`)."""
        self.keep = keep
        self.log = log
        self.close_wait_s = close_wait_s
        self.persisted = 0
        self.skipped = 0
        self.failed = 0
        """Persists that failed (all of them, a full disk included)."""
        self.disk_full = 0
        """Persists that failed for want of room."""
        self.last_failure: PersistFailure | None = None
        self.bytes_written = 0
        self.seconds = 0.0
        self._copy: FlatBuffer | None = None
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=1)
        """At most one persist is outstanding (`_idle`), so `offer` never finds it full."""
        self._idle = threading.Event()
        self._idle.set()
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deadpool-durable", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether the writer thread is alive (it may be inside a write that `close` abandoned)."""
        return self._thread.is_alive()

    def due(self, step: int) -> bool:
        """Whether `step` is persisted (asked once per streamed step, on the training thread). Steps are
        streamed every K-th (`snapshot_cadence`), so a rule's own step may not come: the first streamed
        step at or past it is taken instead (every rank streams the same steps: they all take it)."""
        if step <= self._last_step:  # a rollback: the steps after it are trained again
            self._last_step = step - 1
        last, self._last_step = self._last_step, step
        if step <= 0:
            return False
        if self.every_steps and step // self.every_steps > last // self.every_steps:
            self._last_t = time.monotonic()
            return True
        crossed_grid = step // self.grid_steps > last // self.grid_steps
        if self.every_s and crossed_grid and time.monotonic() - self._last_t >= self.every_s:
            self._last_t = time.monotonic()
            return True
        return False

    def offer(self, step: int, rank: int, world_size: int, generation: int, buffer: FlatBuffer, meta: bytes) -> bool:
        """Copy `buffer` aside and persist it in the background; False (counted) if the last persist
        is still being written or the writer has stopped. Never waits for the disk."""
        if not self._idle.is_set():
            self.skipped += 1
            self.log.warning("durable persist skipped: the previous one is still being written", step=step)
            return False
        if self._stopping.is_set() or not self._thread.is_alive():
            self.skipped += 1
            self.log.warning("durable persist skipped: the writer has stopped", step=step)
            return False
        if self._copy is None or self._copy.layout != buffer.layout:
            self._copy = FlatBuffer(buffer.layout)
        self._copy.data[: buffer.layout.total_bytes].copy_(buffer.data[: buffer.layout.total_bytes])
        self._idle.clear()
        self._queue.put_nowait(_Job(step, rank, world_size, generation, meta, self._copy))
        return True

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait up to `timeout_s` for the persist in hand to end (written or failed); whether it did."""
        return self._idle.wait(timeout_s)

    def close(self, timeout_s: float | None = None) -> bool:
        """Tell the writer to stop once the persist in hand is done, and give that persist `timeout_s`
        (default `close_wait_s`). Never blocks longer: past it the write is abandoned, and the thread
        with it. Returns whether the writer stopped."""
        wait_s = self.close_wait_s if timeout_s is None else timeout_s
        self._stopping.set()
        with contextlib.suppress(queue.Full):  # a persist not yet taken: the writer sees `_stopping` after it
            self._queue.put_nowait(None)
        self._thread.join(wait_s)
        if self._thread.is_alive():
            self.log.warning("durable writer abandoned: a persist is still being written", close_wait_s=wait_s)
            return False
        return True

    def _run(self) -> None:
        while (job := self._queue.get()) is not None:
            try:
                self._persist(job)
            except Exception:  # a bug, or a log stream gone: this persist is lost, not the writer
                self.log.exception("durable persist failed", step=job.step, directory=str(self.directory))
            except BaseException as exc:  # SystemExit, KeyboardInterrupt: they end this thread, said so
                self._stopping.set()  # before `_idle`: an offer that finds the writer idle sees it stopped
                self.log.error("durable writer stopped", reason=_cause_text(_causes(exc)))
                raise
            finally:
                self._idle.set()
            if self._stopping.is_set() and self._queue.empty():
                return

    def _persist(self, job: _Job) -> None:
        started = time.perf_counter()
        try:
            write_step(
                self.directory, self.job, job.step, job.rank, job.world_size, job.generation, job.buffer, job.meta
            )
        except (Exception, CheckpointException) as exc:  # DCP raises CheckpointException, a BaseException
            self._failed(job, exc)
            return
        self.persisted += 1
        self.bytes_written += job.buffer.layout.total_bytes
        self.seconds += time.perf_counter() - started
        self.log.info("step persisted", step=job.step, took_s=round(time.perf_counter() - started, 4))
        try:
            prune(self.directory, job.rank, self.keep)
        except Exception:
            self.log.exception("durable prune failed", directory=str(self.directory))

    def _failed(self, job: _Job, exc: BaseException) -> None:
        """Remove what the failed persist (and any earlier one) left, then log and count why it failed."""
        removed = remove_partials(self.directory, job.rank)
        checkpoint, _ = rank_files(self.directory, job.step, job.rank)
        causes = _causes(exc)
        disk_full = _is_disk_full(causes)
        needed, free = job.buffer.layout.total_bytes, _free_bytes(checkpoint)
        reason = _cause_text(causes)
        if disk_full:
            reason = f"disk full: {needed} bytes needed, {free} free at {checkpoint} ({reason})"
        self.last_failure = PersistFailure(job.step, str(checkpoint), reason, disk_full, needed, free)
        self.failed += 1
        self.disk_full += disk_full
        self.log.error(
            "durable persist failed: disk full" if disk_full else "durable persist failed",
            step=job.step,
            path=str(checkpoint),
            reason=reason,
            bytes_needed=needed,
            bytes_free=free,
            removed=[str(path) for path in removed],
        )
        fatal = [e for e in causes if not isinstance(e, (Exception, CheckpointException))]
        if fatal:  # SystemExit or KeyboardInterrupt inside DCP's wrapper: it ends this thread
            raise fatal[0]
