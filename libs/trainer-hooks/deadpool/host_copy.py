"""The host-local crash copy: a member's snapshot buffers, kept in the host's shared memory.

A member's buffers (`snapshot_worker`) are files in a directory its launcher made for the
job (`DEADPOOL_HOST_COPY_DIR`, under /dev/shm), mapped into the member. They outlive the member: a
SIGKILLed member leaves its last captured steps on its host, and the member that takes its rank on
the same host (a spare there, or a respawn) moves them into its own directory and restores from them
at memory speed, with no store and no network (`inherit`). The launcher removes the directory when
the job ends or the launcher exits; a later launcher removes the directory of one that was killed
(`sweep_stale`). Nothing outlives a job on a host.

Each slot is two files, `slot-<i>.bin` (the buffer's bytes) and `slot-<i>.head` (what they hold: job,
rank, generation, step, the snapshot's meta, and an XXH3-64 checksum per chunk). A capture removes
the head before its copy writes a byte and writes it anew (whole, by rename) once the copy is done,
so a head names bytes that were completely written; the checksums catch anything else, and a copy
that fails them is refused with its reason. The space is reserved when a buffer is made
(`posix_fallocate`): a full /dev/shm then refuses the buffer at once (the member keeps its buffers in
its own memory, without a crash copy, and says so) instead of a SIGBUS on a later write.

Memory: `SLOTS` buffers of the rank's snapshot per live member, made at its first capture, plus those
of each dead member whose rank has not yet been taken on this host, until the job ends. On CUDA the
mapping is registered with the driver (`cudaHostRegister`), so the device-to-host copies run at pinned
speed.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack
import torch

from deadpool.pinned_memory import register_with_cuda
from deadpool.snapshot_layout import FlatBuffer, SnapshotLayout
from deadpool.training_state import SnapshotMeta
from deadpool_protocol.dataplane import chunk_checksum, chunk_hasher

__all__ = [
    "CHECKSUM_BYTES",
    "HEAD_BYTES_MAX",
    "HostCopy",
    "InheritedSlot",
    "SlotHead",
    "read_checked",
]

HEAD_VERSION = 1
READ_PIECE_BYTES = 8 * 1024 * 1024
"""A crash copy is read back this much at a time (`read_checked`): each piece is hashed from the cache."""
HEAD_BYTES_MAX = 64 * 1024 * 1024
"""The largest head read back (a layout of a million tensors fits): a bigger file is refused unread."""
SLOTS = 3
"""Slots a member may keep: two it captures into in turn, and a third while one is being streamed
(`snapshot_worker`: at the adaptive interval a capture goes on beside a busy stream)."""
CHECKSUM_BYTES = 64 * 1024 * 1024
"""The span of one checksum of a crash copy. Large on purpose: each call takes the GIL once (XXH3 itself
runs without it), and every acquisition competes with the training thread. With the stream's 4 MiB,
the GPU check on an H200 (an 86 MB snapshot per step of 62-72 ms) measured the training thread's time
in the hooks at p50 10.4 ms; with 64 MiB, 4.4 ms (docs/performance.md §12)."""


@dataclass(frozen=True)
class SlotHead:
    """What a slot's bytes hold; written only once they are all written."""

    job: str
    member: str
    rank: int
    generation: int
    step: int
    meta: bytes
    chunk_bytes: int
    checksums: list[int]

    def encode(self) -> bytes:
        fields = {
            "version": HEAD_VERSION,
            "job": self.job,
            "member": self.member,
            "rank": self.rank,
            "generation": self.generation,
            "step": self.step,
            "meta": self.meta,
            "chunk_bytes": self.chunk_bytes,
            "checksums": self.checksums,
        }
        data: bytes = msgpack.packb(fields, use_bin_type=True)
        return data

    @classmethod
    def decode(cls, data: bytes) -> SlotHead:
        """Raises ValueError on anything but a head `encode` wrote."""
        try:
            f = msgpack.unpackb(data, raw=False)
            head = cls(
                str(f["job"]),
                str(f["member"]),
                int(f["rank"]),
                int(f["generation"]),
                int(f["step"]),
                bytes(f["meta"]),
                int(f["chunk_bytes"]),
                [int(c) for c in f["checksums"]],
            )
            version = f["version"]
        except (ValueError, TypeError, KeyError, msgpack.UnpackException) as exc:
            raise ValueError(f"malformed slot head: {exc}") from None
        if version != HEAD_VERSION or head.chunk_bytes <= 0 or head.rank < 0 or head.step < 0:
            raise ValueError(f"slot head refused: version {version}, chunk {head.chunk_bytes}, rank {head.rank}")
        return head


def read_checked(path: Path, into: memoryview, chunk_bytes: int, checksums: Sequence[int]) -> bool:
    """Read the first `len(into)` bytes of the slot file at `path` into `into`, checking each
    `chunk_bytes` of them against `checksums` as they arrive; False at the first that fails, or a file
    too short. One pass over the bytes, each hashed while still in the cache, and no page table filled
    for a mapping: for a 1 GB crash copy, a check of its mapping (0.10-0.12 s) and a copy out of it
    (0.09 s) cost about twice this."""
    if len(checksums) != -(-len(into) // chunk_bytes):
        return False
    with open(path, "rb", buffering=0) as f:
        for index, start in enumerate(range(0, len(into), chunk_bytes)):
            hasher = chunk_hasher()
            for piece in range(start, min(start + chunk_bytes, len(into)), READ_PIECE_BYTES):
                view = into[piece : min(piece + READ_PIECE_BYTES, start + chunk_bytes, len(into))]
                filled = 0
                while filled < len(view):
                    got = f.readinto(view[filled:])
                    if not got:
                        return False
                    filled += got
                hasher.update(view)
            if hasher.intdigest() != checksums[index]:
                return False
    return True


def checksums_of(data: memoryview, chunk_bytes: int = CHECKSUM_BYTES) -> list[int]:
    """XXH3-64 of each `chunk_bytes` chunk of `data` (the data plane's checksum, at ~15-20 GB/s)."""
    return [chunk_checksum(data[i : i + chunk_bytes]) for i in range(0, len(data), chunk_bytes)]


@dataclass
class InheritedSlot:
    """A dead member's slot, moved into the newcomer's directory (its bytes not yet checked)."""

    index: int
    buffer: FlatBuffer
    head: SlotHead


class HostCopy:
    """One member's slot files in its launcher's job directory (`<dir>/<member>/`)."""

    def __init__(self, job_dir: Path, job: str, member: str, log: Any) -> None:
        self.job_dir = job_dir
        self.job = job
        self.member = member
        self.log = log
        self.dir = job_dir / member
        self.dir.mkdir(mode=0o700, exist_ok=True)

    def bin_path(self, index: int, member_dir: Path | None = None) -> Path:
        return (member_dir or self.dir) / f"slot-{index}.bin"

    def head_path(self, index: int, member_dir: Path | None = None) -> Path:
        return (member_dir or self.dir) / f"slot-{index}.head"

    def buffer(self, index: int, layout: SnapshotLayout, pin: bool) -> FlatBuffer:
        """Slot `index`'s buffer for `layout`, mapped from its file (made, or resized, to fit). Raises
        OSError when /dev/shm cannot hold it."""
        self.invalidate(index)
        return map_buffer(self.bin_path(index), layout, pin, create=True)

    def discard(self, index: int) -> None:
        """Remove slot `index`'s files (its buffer unmapped first: the space goes back to /dev/shm)."""
        for path in (self.head_path(index), self.bin_path(index)):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()

    def invalidate(self, index: int) -> None:
        """The slot's bytes are about to change: its head no longer describes them."""
        with contextlib.suppress(FileNotFoundError):
            self.head_path(index).unlink()

    def publish(self, index: int, head: SlotHead) -> None:
        """The slot's bytes are whole: say what they hold (atomically, by rename)."""
        path = self.head_path(index)
        temporary = path.with_suffix(".tmp")
        temporary.write_bytes(head.encode())
        os.replace(temporary, path)

    def inherit(self, rank: int, usable: Callable[[SlotHead], bool] = lambda _h: True) -> list[InheritedSlot]:
        """Move into this member's directory the newest copies of `rank` a dead member of this host
        left (up to `SLOTS`); a head that cannot be read is logged and left. Their bytes are checked
        against their heads' checksums when a restore first asks for one (`SnapshotWorker.local`), not
        here: a restore takes one copy of the three."""
        found: list[tuple[SlotHead, Path, int]] = []
        for member_dir in sorted(p for p in self.job_dir.iterdir() if p.is_dir() and p != self.dir):
            for index in range(SLOTS):
                head = self._read_head(self.head_path(index, member_dir))
                if head is not None and head.job == self.job and head.rank == rank and usable(head):
                    found.append((head, member_dir, index))
        found.sort(key=lambda f: (f[0].generation, f[0].step), reverse=True)
        taken: list[InheritedSlot] = []
        for head, member_dir, index in found:
            if len(taken) == SLOTS or any(t.head.step == head.step for t in taken):
                continue
            slot = self._take(head, member_dir, index, len(taken))
            if slot is not None:
                taken.append(slot)
        return taken

    def _take(self, head: SlotHead, member_dir: Path, index: int, into: int) -> InheritedSlot | None:
        try:
            meta = SnapshotMeta.decode(head.meta)
        except ValueError as exc:
            self.log.warning("host-local copy refused", member=head.member, step=head.step, reason=str(exc))
            return None
        self.invalidate(into)
        try:
            os.replace(self.bin_path(index, member_dir), self.bin_path(into))
            os.replace(self.head_path(index, member_dir), self.head_path(into))
            buffer = map_buffer(self.bin_path(into), meta.layout, pin=False, create=False)
        except OSError as exc:
            self.log.warning("host-local copy not taken", member=head.member, step=head.step, reason=str(exc))
            return None
        self.log.info("host-local copy taken", member=head.member, step=head.step, generation=head.generation)
        return InheritedSlot(into, buffer, head)

    def _read_head(self, path: Path) -> SlotHead | None:
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size > HEAD_BYTES_MAX:
                    raise ValueError(f"slot head of {os.fstat(f.fileno()).st_size} bytes, above {HEAD_BYTES_MAX}")
                return SlotHead.decode(f.read())
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            self.log.warning("host-local copy refused", path=str(path), reason=str(exc))
            return None


def map_buffer(path: Path, layout: SnapshotLayout, pin: bool, create: bool) -> FlatBuffer:
    """A `FlatBuffer` over the file at `path`, mapped shared. `create`: made (or resized) to fit, its
    space reserved now; else the file must hold the layout already."""
    size = max(layout.total_bytes, 1)
    flags = os.O_RDWR | (os.O_CREAT if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
        elif os.fstat(fd).st_size < size:
            raise OSError(f"{path} holds {os.fstat(fd).st_size} bytes, its layout {size}")
        # Its page table filled now too (`fallocate` made the pages): the first copy need not fault them in.
        mapped = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | (mmap.MAP_POPULATE if create else 0))
    finally:
        os.close(fd)
    data = torch.frombuffer(mapped, dtype=torch.uint8)
    if pin:
        register_with_cuda(data)
    return FlatBuffer(layout, data=data)
