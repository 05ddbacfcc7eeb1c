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
The stream thread the stream thread copies the buffer (a memory copy) and a writer thread of its own writes the
files, so neither the training thread nor a step ever waits for the disk. A persist still running
when the next is due makes that one skipped (counted); resuming takes the newest step every rank has.

Resuming (`deadpool launch --resume-from DIR`) happens when the job forms: the ranks agree on the
newest step that each of them has complete and intact (`agree_on_step`, a few integer all-reduces in the
new group), each loads its own files and verifies every tensor's checksum, and training goes on from
there exactly as after a swap, so the result equals a run that never stopped.
"""

from __future__ import annotations

import base64
import contextlib
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
import torch.distributed as dist
import xxhash
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from deadpool.snapshot_layout import FlatBuffer
from deadpool.training_state import SnapshotMeta

__all__ = [
    "DurableError",
    "DurableWriter",
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


class DurableError(RuntimeError):
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
    """Keep this rank's newest `keep` persisted steps (a step's directory goes with its last rank)."""
    steps = sorted(_steps_with_manifest(directory, rank), reverse=True)
    for step in steps[keep:]:
        checkpoint, manifest = rank_files(directory, step, rank)
        manifest.unlink(missing_ok=True)
        shutil.rmtree(checkpoint, ignore_errors=True)
        with contextlib.suppress(OSError):  # other ranks' files are still there
            step_dir(directory, step).rmdir()


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
    loaded. Returns (step, buffer, meta, what was refused on this rank); step is NO_STEP if none.

    Each round, every rank proposes its newest verified step at or below the bound, and the minimum
    becomes the bound; when every rank proposes the same step, that is the one.
    """
    candidates = complete_steps(directory, world_size)
    refused: list[str] = []
    loaded: dict[int, tuple[FlatBuffer, SnapshotMeta]] = {}
    bound = candidates[0] if candidates else NO_STEP
    while True:
        mine = NO_STEP
        for step in (s for s in candidates if s <= bound):
            if step in loaded:
                mine = step
                break
            try:
                loaded[step] = load_rank(directory, step, rank, world_size)
            except DurableError as exc:
                refused.append(str(exc))
                continue
            mine = step
            break
        low = torch.tensor([mine], dtype=torch.int64, device=device)
        high = low.clone()
        dist.all_reduce(low, op=dist.ReduceOp.MIN, group=group)
        dist.all_reduce(high, op=dist.ReduceOp.MAX, group=group)
        agreed, top = int(low.item()), int(high.item())
        if agreed == NO_STEP:
            return NO_STEP, None, None, refused
        if agreed == top:
            buffer, meta = loaded[agreed]
            return agreed, buffer, meta, refused
        bound = agreed


@dataclass
class _Job:
    step: int
    rank: int
    world_size: int
    generation: int
    meta: bytes
    buffer: FlatBuffer


class DurableWriter:
    """Persists snapshots on a thread of its own; `offer` is called by the stream thread."""

    def __init__(
        self,
        directory: str,
        job: str,
        every_steps: int,
        keep: int,
        log: Any,
        every_s: float = 0.0,
        grid_steps: int = 10,
    ) -> None:
        if every_steps < 0 or keep < 1 or every_s < 0 or grid_steps < 1 or not (every_steps or every_s):
            raise ValueError("persist every N steps or T seconds (N or T positive), keeping at least 1")
        self.directory = Path(directory)
        self.job = job
        self.every_steps = every_steps
        self.every_s = every_s
        self.grid_steps = grid_steps
        self._last_t = time.monotonic()
        self.keep = keep
        self.log = log
        self.persisted = 0
        self.skipped = 0
        self.bytes_written = 0
        self.seconds = 0.0
        self._copy: FlatBuffer | None = None
        self._queue: queue.Queue[_Job | None] = queue.Queue(maxsize=1)
        self._busy = threading.Event()
        self._thread = threading.Thread(target=self._run, name="deadpool-durable", daemon=True)
        self._thread.start()

    def due(self, step: int) -> bool:
        """Whether `step` is persisted (asked once per captured step, on the training thread)."""
        if step <= 0:
            return False
        if self.every_steps and step % self.every_steps == 0:
            self._last_t = time.monotonic()
            return True
        if self.every_s and step % self.grid_steps == 0 and time.monotonic() - self._last_t >= self.every_s:
            self._last_t = time.monotonic()
            return True
        return False

    def offer(self, step: int, rank: int, world_size: int, generation: int, buffer: FlatBuffer, meta: bytes) -> bool:
        """Copy `buffer` aside and persist it in the background; False (counted) if the last persist
        is still being written."""
        if self._busy.is_set():
            self.skipped += 1
            self.log.warning("durable persist skipped: the previous one is still being written", step=step)
            return False
        if self._copy is None or self._copy.layout != buffer.layout:
            self._copy = FlatBuffer(buffer.layout)
        self._copy.data[: buffer.layout.total_bytes].copy_(buffer.data[: buffer.layout.total_bytes])
        self._busy.set()
        self._queue.put(_Job(step, rank, world_size, generation, meta, self._copy))
        return True

    def close(self, timeout_s: float = 30.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            started = time.perf_counter()
            try:
                write_step(
                    self.directory, self.job, job.step, job.rank, job.world_size, job.generation, job.buffer, job.meta
                )
                prune(self.directory, job.rank, self.keep)
                self.persisted += 1
                self.bytes_written += job.buffer.layout.total_bytes
                self.seconds += time.perf_counter() - started
                self.log.info("step persisted", step=job.step, took_s=round(time.perf_counter() - started, 4))
            except Exception:
                self.log.exception("durable persist failed", step=job.step, directory=str(self.directory))
            finally:
                self._busy.clear()
