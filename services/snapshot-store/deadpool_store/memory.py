"""RAM storage of snapshots: chunks checked on arrival, sealed by a manifest, freed after commits.

Pure bookkeeping, no I/O. One entry per (job, rank, step). A chunk's bytes are received straight into
the snapshot's memory (`chunk_target`, then `chunk_received` verifies them in place), so ingest costs
one kernel copy and one checksum pass per byte; the seal then compares the checksums with the
sender's manifest. Rules:
- a newer generation's upload of the same (job, rank, step) replaces the old one (the timeline after a
  rollback is the valid one); an older generation's upload is refused, and so is one of the same
  generation once a copy is sealed: a sealed copy, committed or not, is never replaced within its
  timeline (an upload with the job's token, or a byte-identical replay of an old upload's first frame,
  once dropped a committed copy without the swapper ever hearing of it);
- a snapshot is served only once sealed: every chunk present and every checksum verified;
- per job, the last `keep_committed` committed steps are kept, plus anything newer than the latest
  commit (bounded by `uncommitted_max` per rank: past it the oldest are freed, but never the oldest of
  all, which is the next step to commit); everything else is freed;
- an upload that is not sealed within `unsealed_max_s` (its sender died or gave up) is freed;
- a chunk that would take the bytes held past `capacity_bytes` is refused with a clear error (and so
  its upload); nothing committed is ever evicted to make room. An upload holds the bytes it has
  received, not the size it announces: one 14-byte frame announcing a store's whole capacity once
  reserved it all for 60 s, starving every other job. One job's uploads in progress hold at most
  `job_unsealed_share` of the capacity: with its token, one job could otherwise open an upload on every
  connection it may have and hold the rest of the store while they trickle;
- once a job has finished (`finished`), everything of it up to its last generation is freed: a new run
  of its name never restores from an ended run's copies (it starts afresh or from the durable tier, in
  a newer generation), and at GBs per rank they would leave the next job's snapshots no room.

Freed buffers are kept for reuse (a rank's snapshot has the same size every step), as long as stored
plus pooled bytes stay within `capacity_bytes`: fresh memory costs a page fault per 4 KiB on first
touch (~0.2 s per GB on this machine's VM, more than streaming the GB itself, and up to 3 s per GB for
memory the VM never touched), reused memory nothing. A buffer that a fetch is still sending from is
never reused. When a rank first uploads a snapshot of a size here, the buffers its next steps will
need (`keep_committed` more: a store holds that many committed steps and one in flight) are wanted
in the pool at once
(`prefault_wanted`): the store faults them in on a thread beside the upload (`offer_pooled`), so that only a
rank's first snapshot here pays for fresh memory, not its first three. When the swapper places a rank of
known size here (`Reserve`: a store lost or back, a rebuild), its buffers, the first upload's included,
are wanted then (`reserve`), and its first snapshot here lands in warm memory too.
"""

from __future__ import annotations

import mmap
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from deadpool_protocol.dataplane import PutChunk, Seal, chunk_checksum, chunk_spans
from deadpool_protocol.errors import DeadPoolError
from deadpool_store import host_memory

__all__ = ["SnapshotKey", "SnapshotMemory", "StoreError", "StoredSnapshot"]

SnapshotKey = tuple[str, int, int]
"""(job, rank, step)"""
RANKS_SEEN_MAX = 65_536
"""(job, rank, size) remembered as having uploaded here (each asks for its pool buffers once)."""
PREFAULT_QUEUE_MAX = 1024
"""Pool buffers waiting to be faulted in, at most (past it a new rank's are not asked for)."""
FINISHED_RUNS_KEPT_MAX = 65_536
"""Ended runs remembered (job -> the generation it ended in), the oldest forgotten past it."""


class StoreError(DeadPoolError):
    """A request the store refuses; the text goes back to the client."""


@dataclass
class StoredSnapshot:
    job: str
    rank: int
    step: int
    generation: int
    member: str
    total_bytes: int
    data: mmap.mmap
    chunk_checksums: dict[int, int] = field(default_factory=dict)
    """offset -> checksum of each chunk received and verified."""
    error: str = ""
    """The first problem seen while receiving; a snapshot with an error cannot be sealed."""
    sealed: bool = False
    chunk_bytes: int = 0
    checksums: list[int] = field(default_factory=list)
    meta: bytes = b""
    signature: bytes = b""
    """The uploader's seal signature, kept for whoever fetches or replicates the copy."""
    readers: int = 0
    """Fetches sending from `data`, and connections receiving a chunk into it, right now; while any
    are, the buffer is not reused."""
    started_t: float = 0.0
    """When the upload began (monotonic clock), for freeing uploads that are never sealed."""
    charged: int = 0
    """Bytes of it counted in the store's `used_bytes`: those received so far, all of it once sealed."""
    charged_offsets: set[int] = field(default_factory=set)
    """The chunks (by offset) counted in `charged` while it is unsealed: a chunk sent again is not."""
    writer: object = None
    """The connection whose chunks are being received into it (unsealed only): when that connection
    closes, or starts another upload, this one is freed at once (`abandon`)."""
    unfilled: int = 0
    """Bytes of a fresh buffer (not from the pool) no chunk has touched yet: memory the host still owes."""

    @property
    def key(self) -> SnapshotKey:
        return (self.job, self.rank, self.step)


class SnapshotMemory:
    def __init__(
        self,
        capacity_bytes: int,
        keep_committed: int = 2,
        uncommitted_max: int = 4,
        job_unsealed_share: float = 0.5,
        host_available: Callable[[], int | None] = host_memory.available_bytes,
        host_reserve_bytes: int | None = None,
    ) -> None:
        if capacity_bytes <= 0 or keep_committed < 1 or uncommitted_max < 1:
            raise ValueError("capacity_bytes, keep_committed and uncommitted_max must be positive")
        if not 0 < job_unsealed_share <= 1:
            raise ValueError("job_unsealed_share is a share of the capacity: above 0, at most 1")
        self.capacity_bytes = capacity_bytes
        self.host_available = host_available
        """The host's memory still available (None: unknown, not checked): a fresh buffer must fit it."""
        self.host_reserve_bytes = host_memory.reserve_bytes() if host_reserve_bytes is None else host_reserve_bytes
        """What the store leaves free on the host for everything else."""
        self.unfilled_bytes = 0
        """Bytes of fresh buffers of uploads in progress not received yet: not yet taken from the host's
        available memory, but promised."""
        self.job_unsealed_max_bytes = int(capacity_bytes * job_unsealed_share)
        """The bytes one job's unsealed uploads may hold. A store sized for its jobs (2 committed steps
        and one in flight per rank) has a job's in-flight step within a third of its capacity."""
        self.unsealed_bytes: Counter[str] = Counter()
        """job -> bytes its unsealed uploads hold (the chunks received so far)."""
        self.keep_committed = keep_committed
        self.uncommitted_max = uncommitted_max
        self._snapshots: dict[SnapshotKey, StoredSnapshot] = {}
        self._committed: dict[str, list[int]] = defaultdict(list)
        """job -> committed steps, ascending, at most keep_committed of them."""
        self._committed_generation: dict[str, int] = {}
        """job -> the generation of its newest commit: a commit of an older one is stale."""
        self._ended_in: dict[str, int] = {}
        """job -> the generation its last run ended in (`finished`): an upload of it or an older one
        comes late, and is refused (it would stay, as nothing of that run commits or ends again)."""
        self.used_bytes = 0
        self._pool: dict[int, list[mmap.mmap]] = defaultdict(list)
        self.pooled_bytes = 0
        self._ranks_seen: set[tuple[str, int, int]] = set()
        """(job, rank, snapshot size) uploaded here: their later steps' buffers were asked for already.
        By size too: a rank's formation snapshot (step 0) holds no optimizer state yet, its next ones
        do (358 MB, then 1.07 GB, for 1 GiB of state)."""
        self._prefault: list[int] = []
        """Buffer sizes wanted in the pool, not yet handed to the faulting (`prefault_wanted`)."""

    def __len__(self) -> int:
        return len(self._snapshots)

    def committed_steps(self, job: str) -> list[int]:
        return list(self._committed.get(job, []))

    def sealed_of(self, job: str, rank: int) -> list[StoredSnapshot]:
        return [v for (j, r, _), v in self._snapshots.items() if j == job and r == rank and v.sealed]

    @property
    def unsealed(self) -> int:
        return sum(not snap.sealed for snap in self._snapshots.values())

    def expire_unsealed(self, now: float, max_age_s: float) -> list[SnapshotKey]:
        """Free uploads begun more than `max_age_s` before `now` (monotonic) and never sealed."""
        stale = [k for k, v in self._snapshots.items() if not v.sealed and now - v.started_t > max_age_s]
        for key in stale:
            self._drop(key)
        return stale

    def chunk_target(self, chunk: PutChunk, writer: object = None) -> memoryview:
        """Where chunk `chunk`'s bytes go: its slice of the snapshot's memory. `writer` is the connection
        sending it (`StoredSnapshot.writer`).

        Raises StoreError if the upload is refused (stale generation, store full); the caller then
        discards the bytes and reports the reason at the seal.
        """
        snap = self._entry_for(chunk)
        if chunk.offset not in snap.charged_offsets:
            if self.used_bytes + chunk.nbytes > self.capacity_bytes:
                raise StoreError(
                    f"store full: {chunk.nbytes} more bytes would exceed the capacity of {self.capacity_bytes} "
                    f"({self.used_bytes} in use); start the store with a larger --capacity-bytes or add stores"
                )
            if self.unsealed_bytes[chunk.job] + chunk.nbytes > self.job_unsealed_max_bytes:
                raise StoreError(
                    f"job {chunk.job}'s uploads in progress would hold more than {self.job_unsealed_max_bytes} bytes, "
                    f"its share of this store ({self.unsealed_bytes[chunk.job]} held)"
                )
            snap.charged_offsets.add(chunk.offset)
            snap.charged += chunk.nbytes
            filled = min(snap.unfilled, chunk.nbytes)
            snap.unfilled -= filled
            self.unfilled_bytes -= filled
            self.used_bytes += chunk.nbytes
            self.unsealed_bytes[chunk.job] += chunk.nbytes
        snap.writer = writer
        return memoryview(snap.data)[chunk.offset : chunk.offset + chunk.nbytes]

    def abandon(self, key: SnapshotKey, writer: object) -> bool:
        """Free upload `key` if it is unsealed and `writer` is still the connection sending it (its
        connection closed, or went on to another upload): its reservation is not held for
        `unsealed_max_s` (one 14-byte frame once reserved a store's whole capacity for 60 s)."""
        snap = self._snapshots.get(key)
        if snap is None or snap.sealed or snap.writer is not writer:
            return False
        self._drop(key)
        return True

    def chunk_received(self, chunk: PutChunk, checksum: int | None = None, into: object = None) -> None:
        """The chunk's bytes are in place: checksum them (the seal compares with the sender's list).

        `checksum` is theirs when it was taken as they arrived (`ingest_thread`); then `into` is the
        buffer they arrived in, and the checksum counts only if it is still this upload's."""
        snap = self._snapshots.get((chunk.job, chunk.rank, chunk.step))
        if snap is None or snap.generation != chunk.generation or snap.member != chunk.member or snap.error:
            return
        if checksum is None:
            checksum = chunk_checksum(memoryview(snap.data)[chunk.offset : chunk.offset + chunk.nbytes])
        elif snap.data is not into:
            return  # replaced while a thread received: the chunk counts as missing
        snap.chunk_checksums[chunk.offset] = checksum

    def entry(self, key: SnapshotKey) -> StoredSnapshot | None:
        """The snapshot stored or being received under `key`, if any."""
        return self._snapshots.get(key)

    def seal(self, seal: Seal) -> StoredSnapshot:
        key = (seal.job, seal.rank, seal.step)
        snap = self._snapshots.get(key)
        if snap is None or snap.generation != seal.generation or snap.member != seal.member:
            raise StoreError(f"no upload in progress for {key} from {seal.member} in generation {seal.generation}")
        if snap.error:
            self._drop(key)
            raise StoreError(f"snapshot {key} refused: {snap.error}")
        if seal.total_bytes != snap.total_bytes:
            self._drop(key)
            raise StoreError(f"snapshot {key}: seal says {seal.total_bytes} bytes, chunks said {snap.total_bytes}")
        spans = chunk_spans(seal.total_bytes, seal.chunk_bytes)
        missing = [off for off, _ in spans if off not in snap.chunk_checksums]
        if missing:
            self._drop(key)
            raise StoreError(f"snapshot {key}: {len(missing)} of {len(spans)} chunks missing (first at {missing[0]})")
        if len(snap.chunk_checksums) != len(spans):
            self._drop(key)
            raise StoreError(f"snapshot {key}: chunk layout differs from the manifest")
        for (offset, _), want in zip(spans, seal.checksums, strict=True):
            got = snap.chunk_checksums[offset]
            if got != want:
                self._drop(key)
                raise StoreError(
                    f"snapshot {key}: chunk at {offset} has checksum {got:#018x}, the manifest {want:#018x}"
                )
        snap.sealed = True
        snap.writer = None
        self._release_unsealed(snap)
        self.used_bytes += snap.total_bytes - snap.charged  # every chunk is in: exactly 0
        snap.charged, snap.charged_offsets = snap.total_bytes, set()
        snap.chunk_bytes = seal.chunk_bytes
        snap.checksums = list(seal.checksums)
        snap.meta = seal.meta
        snap.signature = seal.signature
        self._bound_uncommitted(seal.job, seal.rank)
        return snap

    def get(self, job: str, rank: int, step: int) -> StoredSnapshot:
        snap = self._snapshots.get((job, rank, step))
        if snap is None or not snap.sealed:
            have = sorted(s for (j, r, s), v in self._snapshots.items() if j == job and r == rank and v.sealed)
            raise StoreError(f"no complete snapshot of job {job} rank {rank} step {step} (have steps {have})")
        return snap

    def commit(self, job: str, step: int, generation: int = 0) -> list[SnapshotKey]:
        """Record that `step` is committed for `job`; free what is no longer needed. Returns freed keys.

        A committed step never goes back within a timeline. It goes back only with a newer generation:
        the job restored an older step (from the durable tier) or its name started a new run. Then the
        old timeline's snapshots above it are void and freed, and commits count from it again; before,
        every commit below the old timeline's newest was ignored, so nothing of the job was freed
        again until it passed that step (a new run of the name would have filled the store)."""
        steps = self._committed[job]
        known = self._committed_generation.get(job, 0)
        if generation < known:
            return []  # a late commit of a timeline a newer one replaced
        abandoned: list[SnapshotKey] = []
        if steps and step <= steps[-1]:
            if generation <= known:
                return []
            steps.clear()
            abandoned = [k for k, snap in self._snapshots.items() if k[0] == job and snap.generation < generation]
            abandoned = [k for k in abandoned if k[2] > step]
            for key in abandoned:
                self._drop(key)
        self._committed_generation[job] = generation
        steps.append(step)
        del steps[: -self.keep_committed]
        keep_from = steps[0]
        latest = steps[-1]
        freed = [
            key
            for key in self._snapshots
            if key[0] == job and (key[2] < keep_from or (key[2] < latest and key[2] not in steps))
        ]
        for key in freed:
            self._drop(key)
        return abandoned + freed

    def finished(self, job: str, generation: int) -> list[SnapshotKey]:
        """`job` ended in `generation`: free every snapshot of it of that generation or an older one.
        Returns the freed keys. A repeated or late notice frees nothing more, and a newer run's snapshots
        (a newer generation) stay; the commit bookkeeping stays too, so a late commit of the ended run is
        still ignored as before. An upload of the ended run that comes after (its last steps' streams
        race the notice) is refused: nothing would ever free it."""
        freed = [key for key, snap in self._snapshots.items() if key[0] == job and snap.generation <= generation]
        for key in freed:
            self._drop(key)
        ended_in = max(generation, self._ended_in.pop(job, 0))  # re-inserted: the newest end is forgotten last
        self._ended_in[job] = ended_in
        if len(self._ended_in) > FINISHED_RUNS_KEPT_MAX:
            del self._ended_in[next(iter(self._ended_in))]
        self._ranks_seen = {seen for seen in self._ranks_seen if seen[0] != job}  # a new run asks again
        return freed

    def _entry_for(self, chunk: PutChunk) -> StoredSnapshot:
        key = (chunk.job, chunk.rank, chunk.step)
        ended_in = self._ended_in.get(chunk.job)
        if ended_in is not None and chunk.generation <= ended_in:
            raise StoreError(f"job {chunk.job}'s run ended in generation {ended_in}: it stores no more snapshots")
        snap = self._snapshots.get(key)
        if snap is not None:
            if chunk.generation < snap.generation:
                raise StoreError(
                    f"snapshot {key} from generation {chunk.generation} is stale: "
                    f"generation {snap.generation} already wrote it"
                )
            if snap.sealed and chunk.generation == snap.generation:
                raise StoreError(
                    f"snapshot {key} of generation {snap.generation} is sealed: a sealed copy is never replaced"
                )
            same_upload = chunk.generation == snap.generation and chunk.member == snap.member and not snap.sealed
            if same_upload and chunk.total_bytes == snap.total_bytes:
                return snap
            if chunk.generation == snap.generation and chunk.member != snap.member:
                raise StoreError(f"snapshot {key} in generation {chunk.generation} already belongs to {snap.member}")
            self._drop(key)  # a newer generation, or a fresh upload of the same one, replaces it
        if chunk.total_bytes > self.capacity_bytes:
            raise StoreError(
                f"a snapshot of {chunk.total_bytes} bytes can never fit the capacity of {self.capacity_bytes}; "
                "start the store with a larger --capacity-bytes"
            )
        fresh = not self._pool.get(chunk.total_bytes)
        if fresh and not self.host_room_for(chunk.total_bytes):
            raise StoreError(
                f"host memory: a snapshot of {chunk.total_bytes} bytes would leave less than "
                f"{self.host_reserve_bytes} bytes free on this store's host ({self.host_available()} available, "
                f"{self.unfilled_bytes} promised to uploads in progress), whatever its capacity"
            )
        snap = StoredSnapshot(
            job=chunk.job,
            rank=chunk.rank,
            step=chunk.step,
            generation=chunk.generation,
            member=chunk.member,
            total_bytes=chunk.total_bytes,
            data=self._allocate(chunk.total_bytes),
            started_t=time.monotonic(),
            unfilled=chunk.total_bytes if fresh else 0,
        )
        self.unfilled_bytes += snap.unfilled
        self._snapshots[key] = snap
        self._want_buffers(chunk.job, chunk.rank, chunk.total_bytes, self.keep_committed)
        return snap

    def reserve(self, job: str, rank: int, nbytes: int) -> bool:
        """The swapper placed `rank`'s snapshots of `nbytes` here: want the buffers its uploads will take
        (its next upload's and the committed steps' kept) before it uploads. Once per rank and size
        (a reservation sent again, or one for a rank already uploading here, wants nothing more); a
        size that can never fit is refused. Whether buffers were wanted."""
        if not 0 < nbytes <= self.capacity_bytes:
            return False
        return self._want_buffers(job, rank, nbytes, self.keep_committed + 1)

    def _want_buffers(self, job: str, rank: int, nbytes: int, count: int) -> bool:
        seen = (job, rank, nbytes)
        if seen in self._ranks_seen:
            return False
        if len(self._ranks_seen) >= RANKS_SEEN_MAX:
            self._ranks_seen.clear()  # at worst some rank's buffers are asked for once more
        self._ranks_seen.add(seen)
        if len(self._prefault) >= PREFAULT_QUEUE_MAX:
            return False
        self._prefault += [nbytes] * count
        return True

    def prefault_wanted(self) -> list[int]:
        """The buffer sizes to fault in for the pool (each once: the list is handed over and emptied)."""
        wanted, self._prefault = self._prefault, []
        return wanted

    def host_room_for(self, nbytes: int) -> bool:
        """Whether the host can give `nbytes` more of fresh memory and keep its reserve, beside what the
        uploads in progress will still take."""
        available = self.host_available()
        return available is None or nbytes <= available - self.unfilled_bytes - self.host_reserve_bytes

    def room_for_pooled(self, nbytes: int) -> bool:
        """Whether a buffer of `nbytes` more would fit in the pool now (stored + pooled within capacity)."""
        return self.used_bytes + self.pooled_bytes + nbytes <= self.capacity_bytes

    def offer_pooled(self, data: mmap.mmap) -> bool:
        """A buffer faulted in for the pool: kept if it fits (the upload it was for may have taken the
        room meanwhile), else closed. Whether it was kept."""
        nbytes = len(data)
        if not self.room_for_pooled(nbytes):
            data.close()
            return False
        self._pool[nbytes].append(data)
        self.pooled_bytes += nbytes
        return True

    def _bound_uncommitted(self, job: str, rank: int) -> None:
        latest = self._committed[job][-1] if self._committed.get(job) else -1
        newer = sorted(key for key in self._snapshots if key[0] == job and key[1] == rank and key[2] > latest)
        # The oldest is the next step to commit (the others ranks may still be streaming it): keep it.
        for key in newer[1:][: max(0, len(newer) - self.uncommitted_max)]:
            self._drop(key)

    def _release_unsealed(self, snap: StoredSnapshot) -> None:
        """`snap` is sealed or dropped: its bytes no longer count against its job's unsealed share,
        nor as memory the host still owes it."""
        self.unfilled_bytes -= snap.unfilled
        snap.unfilled = 0
        self.unsealed_bytes[snap.job] -= snap.charged
        if self.unsealed_bytes[snap.job] <= 0:
            del self.unsealed_bytes[snap.job]

    def _allocate(self, nbytes: int) -> mmap.mmap:
        """A buffer of `nbytes`: a pooled one of that size, else fresh (evicting pooled ones for room)."""
        pooled = self._pool.get(nbytes)
        if pooled:
            self.pooled_bytes -= nbytes
            return pooled.pop()
        for size in sorted(self._pool, reverse=True):
            while self._pool[size] and self.used_bytes + self.pooled_bytes + nbytes > self.capacity_bytes:
                self._pool[size].pop()
                self.pooled_bytes -= size
        return mmap.mmap(-1, max(nbytes, 1))

    def _drop(self, key: SnapshotKey) -> None:
        snap = self._snapshots.pop(key, None)
        if snap is None:
            return
        self.used_bytes -= snap.charged
        if not snap.sealed:
            self._release_unsealed(snap)
        fits = self.used_bytes + self.pooled_bytes + snap.total_bytes <= self.capacity_bytes
        if snap.readers == 0 and fits and snap.total_bytes > 0:
            self._pool[snap.total_bytes].append(snap.data)
            self.pooled_bytes += snap.total_bytes
