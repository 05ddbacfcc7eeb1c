"""The store's RAM bookkeeping: verified chunks, sealed snapshots, generations, retention, capacity."""

from __future__ import annotations

import mmap

import pytest

from deadpool_protocol.dataplane import PutChunk, Seal, chunk_checksum, chunk_spans
from deadpool_store.memory import SnapshotMemory, StoreError

CHUNK = 4


def put_chunk(memory: SnapshotMemory, chunk: PutChunk, payload: bytes) -> None:
    """What the data-plane server does: receive into the chunk's target, then verify in place."""
    memory.chunk_target(chunk)[:] = payload
    memory.chunk_received(chunk)


def upload(
    memory: SnapshotMemory,
    step: int,
    data: bytes,
    rank: int = 0,
    generation: int = 1,
    member: str = "m0",
    job: str = "j",
) -> None:
    checksums = []
    for offset, n in chunk_spans(len(data), CHUNK):
        piece = data[offset : offset + n]
        checksums.append(chunk_checksum(piece))
        put_chunk(memory, PutChunk(job, generation, rank, member, step, offset, n, len(data)), piece)
    memory.seal(Seal(job, generation, rank, member, step, len(data), CHUNK, checksums, b"meta"))


def test_a_sealed_snapshot_is_served_byte_for_byte() -> None:
    memory = SnapshotMemory(capacity_bytes=1000)
    upload(memory, 5, b"0123456789")
    snap = memory.get("j", 0, 5)
    assert bytes(snap.data) == b"0123456789" and snap.meta == b"meta" and snap.sealed


def test_a_corrupted_chunk_makes_the_seal_fail_and_nothing_is_served() -> None:
    memory = SnapshotMemory(capacity_bytes=1000)
    put_chunk(memory, PutChunk("j", 1, 0, "m0", 5, 0, 4, 8), b"abcX")
    put_chunk(memory, PutChunk("j", 1, 0, "m0", 5, 4, 4, 8), b"efgh")
    with pytest.raises(StoreError, match="checksum"):
        memory.seal(Seal("j", 1, 0, "m0", 5, 8, 4, [chunk_checksum(b"abcd"), chunk_checksum(b"efgh")], b""))
    with pytest.raises(StoreError, match="no complete snapshot"):
        memory.get("j", 0, 5)
    assert memory.used_bytes == 0


def test_a_missing_chunk_makes_the_seal_fail() -> None:
    memory = SnapshotMemory(capacity_bytes=1000)
    put_chunk(memory, PutChunk("j", 1, 0, "m0", 5, 0, 4, 8), b"abcd")
    with pytest.raises(StoreError, match="1 of 2 chunks missing"):
        memory.seal(Seal("j", 1, 0, "m0", 5, 8, 4, [chunk_checksum(b"abcd"), 0], b""))


def test_a_newer_generation_replaces_a_step_and_an_older_one_is_refused() -> None:
    memory = SnapshotMemory(capacity_bytes=1000)
    upload(memory, 5, b"old-timeline", generation=1)
    upload(memory, 5, b"new-timeline", generation=2, member="m9")
    assert bytes(memory.get("j", 0, 5).data) == b"new-timeline"
    with pytest.raises(StoreError, match="stale"):
        upload(memory, 5, b"late-upload!", generation=1)
    assert bytes(memory.get("j", 0, 5).data) == b"new-timeline"


def test_the_last_two_committed_steps_and_newer_ones_are_kept() -> None:
    memory = SnapshotMemory(capacity_bytes=10_000, keep_committed=2, uncommitted_max=8)
    for step in range(1, 7):
        upload(memory, step, bytes([step]) * 8)
    memory.commit("j", 3)
    memory.commit("j", 5)
    kept = sorted(step for step in range(1, 7) if _has(memory, step))
    assert kept == [3, 5, 6]  # 4 was never committed and is older than the latest commit
    assert memory.used_bytes == 3 * 8
    assert memory.commit("j", 4) == []  # commits never go back


def test_a_commit_that_goes_back_in_a_newer_generation_frees_the_abandoned_timeline() -> None:
    """A durable restore, or a new run of the job's name, commits an older step in a newer generation:
    the old timeline above it is void. Before, every such commit was ignored (commits never go back),
    and nothing of the job was freed until it passed the old timeline's newest step."""
    memory = SnapshotMemory(capacity_bytes=10_000, keep_committed=2, uncommitted_max=8)
    for step in range(1, 9):
        upload(memory, step, bytes([step]) * 8, generation=1)
    memory.commit("j", 7, generation=1)
    upload(memory, 3, b"resumed!", generation=2)  # the step the job went back to, sealed again
    freed = memory.commit("j", 3, generation=2)  # back to step 3, in generation 2
    assert sorted(key[2] for key in freed) == [7, 8]
    assert memory.committed_steps("j") == [3] and _has(memory, 3)
    for step in range(4, 7):
        upload(memory, step, bytes([step]) * 8, generation=2)
    memory.commit("j", 4, generation=2)
    memory.commit("j", 6, generation=2)
    assert [s for s in range(1, 9) if _has(memory, s)] == [4, 6]
    assert memory.commit("j", 8, generation=1) == [] and memory.committed_steps("j") == [4, 6], "a late old commit"


def test_a_finished_job_frees_its_run_and_leaves_other_jobs_and_a_newer_run_alone() -> None:
    """Seen with GBs per rank: a store kept each ended job's last commits until it restarted, and the
    next job's snapshots were refused as the store was full."""
    memory = SnapshotMemory(capacity_bytes=10_000, keep_committed=2, uncommitted_max=8)
    for step in range(1, 4):
        upload(memory, step, bytes([step]) * 8, generation=2)
        upload(memory, step, bytes([step]) * 8, job="other")
    memory.commit("j", 2, generation=2)
    upload(memory, 9, b"newerrun", generation=3)  # a new run of the name, already started
    freed = memory.finished("j", 2)
    assert sorted(key[2] for key in freed) == [2, 3]  # step 1 went with the commit of 2
    assert [s for s in range(1, 10) if _has(memory, s)] == [9], "the newer run's snapshot stays"
    assert all(_has(memory, step, job="other") for step in range(1, 4))
    assert memory.finished("j", 2) == [], "a repeated notice frees nothing more"
    assert memory.commit("j", 2, generation=2) == [], "a late commit of the ended run is still ignored"
    assert memory.used_bytes == 8 + 3 * 8


def test_an_upload_of_an_ended_run_that_comes_after_its_end_is_refused_and_a_newer_run_is_not() -> None:
    """Seen in CI: a run's last step streamed after the store heard the run end, and stayed."""
    memory = SnapshotMemory(capacity_bytes=10_000)
    memory.finished("j", 2)
    for generation in (1, 2):
        with pytest.raises(StoreError, match="ended in generation 2"):
            upload(memory, 40, b"late!", generation=generation)
    assert memory.used_bytes == 0 and not _has(memory, 40)
    memory.finished("j", 1)  # a late notice of an older end
    upload(memory, 1, b"newerrun", generation=3)
    assert _has(memory, 1), "the name's next run stores"
    upload(memory, 1, b"other", job="other")


def test_uncommitted_snapshots_per_rank_are_bounded_and_the_next_commit_candidate_stays() -> None:
    memory = SnapshotMemory(capacity_bytes=10_000, uncommitted_max=2)
    for step in range(1, 5):
        upload(memory, step, b"x" * 8)
    # Step 1 is the next to commit (other ranks may still be streaming it): it is never the one freed.
    assert [s for s in range(1, 5) if _has(memory, s)] == [1, 4]
    memory.commit("j", 1)
    upload(memory, 5, b"x" * 8)
    upload(memory, 6, b"x" * 8)
    assert [s for s in range(1, 7) if _has(memory, s)] == [1, 4, 6]


def test_an_upload_never_sealed_is_freed_after_its_bound() -> None:
    memory = SnapshotMemory(capacity_bytes=100)
    put_chunk(memory, PutChunk("j", 1, 0, "m0", 5, 0, 4, 40), b"abcd")  # 40 bytes announced, 4 sent
    assert memory.unsealed == 1 and memory.used_bytes == 4
    started = memory._snapshots[("j", 0, 5)].started_t
    assert memory.expire_unsealed(started + 1.0, max_age_s=5.0) == []
    assert memory.expire_unsealed(started + 6.0, max_age_s=5.0) == [("j", 0, 5)]
    assert memory.unsealed == 0 and memory.used_bytes == 0
    upload(memory, 6, b"y" * 8)
    assert memory.expire_unsealed(started + 100.0, max_age_s=5.0) == [], "a sealed snapshot is not an upload"


def test_a_snapshot_that_would_exceed_capacity_is_refused_and_committed_data_stays() -> None:
    memory = SnapshotMemory(capacity_bytes=20, job_unsealed_share=1.0)  # the capacity alone
    upload(memory, 1, b"a" * 12)
    memory.commit("j", 1)
    with pytest.raises(StoreError, match="store full"):
        upload(memory, 2, b"b" * 12)
    assert bytes(memory.get("j", 0, 1).data) == b"a" * 12


def test_a_freed_buffer_is_reused_for_the_next_snapshot_of_its_size() -> None:
    memory = SnapshotMemory(capacity_bytes=100, keep_committed=1)
    upload(memory, 1, b"a" * 16)
    first = memory.get("j", 0, 1).data
    memory.commit("j", 1)
    upload(memory, 2, b"b" * 16)
    memory.commit("j", 2)  # frees step 1 into the pool
    assert memory.pooled_bytes == 16
    upload(memory, 3, b"c" * 16)
    assert memory.get("j", 0, 3).data is first and bytes(first) == b"c" * 16
    assert memory.used_bytes + memory.pooled_bytes <= memory.capacity_bytes


def test_a_buffer_still_being_served_is_not_reused() -> None:
    memory = SnapshotMemory(capacity_bytes=100, keep_committed=1)
    upload(memory, 1, b"a" * 16)
    memory.commit("j", 1)
    memory.get("j", 0, 1).readers += 1  # a fetch is sending it
    upload(memory, 2, b"b" * 16)
    memory.commit("j", 2)
    assert memory.pooled_bytes == 0


def test_pooled_buffers_give_way_to_a_snapshot_of_another_size() -> None:
    memory = SnapshotMemory(capacity_bytes=40, keep_committed=1, job_unsealed_share=1.0)
    upload(memory, 1, b"a" * 16)
    memory.commit("j", 1)
    upload(memory, 2, b"b" * 16)
    memory.commit("j", 2)
    assert memory.pooled_bytes == 16
    upload(memory, 3, b"c" * 24)  # 16 stored + 16 pooled + 24 > 40: the pooled buffer is dropped
    assert memory.pooled_bytes == 0 and memory.used_bytes == 40


def _has(memory: SnapshotMemory, step: int, job: str = "j") -> bool:
    try:
        memory.get(job, 0, step)
    except StoreError:
        return False
    return True


@pytest.mark.parametrize("committed", [False, True])
def test_a_sealed_copy_is_never_replaced_within_its_timeline(committed: bool) -> None:
    """An upload of a sealed step in the same generation (a job's token was enough), or a replay of the
    honest upload's first chunk, once dropped the copy, committed or not: now both are refused and the
    copy stays byte for byte. A newer generation still replaces it (the timeline after a rollback)."""
    memory = SnapshotMemory(capacity_bytes=1000)
    upload(memory, 5, b"honest-bytes")
    if committed:
        memory.commit("j", 5, generation=1)
    replay = PutChunk("j", 1, 0, "m0", 5, 0, CHUNK, 12)
    for chunk in (replay, PutChunk("j", 1, 0, "forger", 5, 0, CHUNK, 12), PutChunk("j", 1, 0, "m0", 5, 0, CHUNK, 8)):
        with pytest.raises(StoreError, match="sealed copy is never replaced"):
            memory.chunk_target(chunk)
    assert bytes(memory.get("j", 0, 5).data) == b"honest-bytes"
    upload(memory, 5, b"rolled-back!", generation=2)
    assert bytes(memory.get("j", 0, 5).data) == b"rolled-back!" and memory.get("j", 0, 5).generation == 2


def test_an_upload_holds_the_bytes_it_received_not_those_it_announces() -> None:
    """One 14-byte frame announcing a store's whole capacity once reserved all of it for 60 s, and every
    other job's upload was refused: now it holds the byte it sent. Bytes past the capacity are still
    refused, at the chunk that would cross it, and a chunk sent again is counted once."""
    memory = SnapshotMemory(capacity_bytes=100, job_unsealed_share=1.0)  # the capacity alone
    hog = PutChunk("other", 1, 0, "m9", 1, 0, 1, 100)
    put_chunk(memory, hog, b"x")
    put_chunk(memory, hog, b"x")  # the same chunk again
    assert memory.used_bytes == 1
    upload(memory, 5, b"a" * 60)  # another job's honest upload fits
    assert memory.used_bytes == 61 and bytes(memory.get("j", 0, 5).data) == b"a" * 60
    put_chunk(memory, PutChunk("other", 1, 0, "m9", 1, 1, 39, 100), b"y" * 39)  # up to the capacity
    with pytest.raises(StoreError, match="store full"):
        memory.chunk_target(PutChunk("other", 1, 0, "m9", 1, 40, 1, 100))
    with pytest.raises(StoreError, match="can never fit"):
        memory.chunk_target(PutChunk("other", 1, 0, "m9", 2, 0, 1, 101))


def test_one_jobs_uploads_in_progress_hold_at_most_its_share_and_give_it_back() -> None:
    """With its token, one job could open an upload on every connection it may have and hold the rest of
    the store while they trickle: its unsealed bytes stop at its share, and another job still fits.
    A seal or a drop gives the bytes back to the share."""
    memory = SnapshotMemory(capacity_bytes=100, job_unsealed_share=0.5)
    for rank in range(5):  # five uploads of 10 of 30 bytes each: 50, the share
        put_chunk(memory, PutChunk("hog", 1, rank, "m9", 1, 0, 10, 30), b"x" * 10)
    with pytest.raises(StoreError, match="its share of this store"):
        memory.chunk_target(PutChunk("hog", 1, 5, "m9", 1, 0, 1, 30))
    with pytest.raises(StoreError, match="its share of this store"):
        memory.chunk_target(PutChunk("hog", 1, 0, "m9", 1, 10, 1, 30))
    assert memory.unsealed_bytes["hog"] == 50
    upload(memory, 5, b"a" * 40)  # another job: sealed, it holds no unsealed share
    assert bytes(memory.get("j", 0, 5).data) == b"a" * 40 and "j" not in memory.unsealed_bytes
    memory.finished("hog", 1)  # dropped: the share is free again
    assert "hog" not in memory.unsealed_bytes and memory.used_bytes == 40
    upload(memory, 6, b"b" * 50, job="hog", generation=2)  # the name's next run
    assert "hog" not in memory.unsealed_bytes and memory.used_bytes == 90


def test_an_abandoned_upload_is_freed_at_once_by_its_own_connection_only() -> None:
    memory = SnapshotMemory(capacity_bytes=100)
    mine, other = object(), object()
    memory.chunk_target(PutChunk("j", 1, 0, "m0", 5, 0, 4, 40), writer=mine)
    assert not memory.abandon(("j", 0, 5), other) and memory.unsealed == 1
    assert memory.abandon(("j", 0, 5), mine) and memory.unsealed == 0 and memory.used_bytes == 0
    upload(memory, 6, b"z" * 8)
    assert not memory.abandon(("j", 0, 6), None), "a sealed copy is no upload to abandon"
    assert memory.used_bytes == 8


def test_a_ranks_first_upload_asks_for_its_next_steps_buffers_and_they_are_reused_within_capacity() -> None:
    memory = SnapshotMemory(capacity_bytes=35, keep_committed=2)
    upload(memory, 1, b"0123456789")
    assert memory.prefault_wanted() == [10, 10], "the two more buffers a rank holds at once"
    assert memory.prefault_wanted() == [], "handed over once"
    faulted = [mmap.mmap(-1, 10) for _ in range(3)]
    assert memory.offer_pooled(faulted[0]) and memory.offer_pooled(faulted[1])
    assert not memory.offer_pooled(faulted[2]) and faulted[2].closed, "past the capacity: 10 stored + 20 pooled"
    upload(memory, 2, b"abcdefghij")
    assert memory.prefault_wanted() == [], "the same rank asks once"
    assert memory.get("j", 0, 2).data in faulted[:2], "the next step lands in a faulted-in buffer"
    upload(memory, 1, b"0123", rank=1)
    assert memory.prefault_wanted() == [4, 4], "another rank asks for its own"
    memory.finished("j", 1)
    upload(memory, 1, b"0123456789", generation=2)
    assert memory.prefault_wanted() == [10, 10], "a new run of the job asks again"


def test_a_rank_placed_here_of_known_size_wants_its_first_uploads_buffer_too_once_and_within_the_capacity() -> None:
    """The swapper's `Reserve`: the buffers are wanted before the rank's first upload here, its own
    included, so that upload lands in warm memory; sent again, or followed by the upload, nothing more."""
    memory = SnapshotMemory(capacity_bytes=35, keep_committed=2)
    assert memory.reserve("j", 0, 10)
    assert memory.prefault_wanted() == [10, 10, 10], "the first upload's buffer and the two a rank holds after"
    assert not memory.reserve("j", 0, 10) and memory.prefault_wanted() == [], "a reservation sent again"
    faulted = [mmap.mmap(-1, 10) for _ in range(3)]
    assert all(memory.offer_pooled(buffer) for buffer in faulted)
    upload(memory, 1, b"0123456789")
    assert memory.prefault_wanted() == [], "the reserved rank's upload asks for nothing more"
    assert memory.get("j", 0, 1).data in faulted, "its first upload here lands in a faulted-in buffer"
    assert not memory.reserve("j", 1, 36) and memory.prefault_wanted() == [], "a size that can never fit"
    assert not memory.reserve("j", 1, 0), "a size of nothing"


def test_a_rank_whose_snapshots_grow_asks_again_for_the_new_size() -> None:
    memory = SnapshotMemory(capacity_bytes=1000, keep_committed=2)
    upload(memory, 0, b"0123")  # the formation's: parameters only
    assert memory.prefault_wanted() == [4, 4]
    upload(memory, 1, b"0123456789ab")  # the optimizer's state appeared
    assert memory.prefault_wanted() == [12, 12]


def test_a_fresh_buffer_the_host_cannot_give_is_refused_whatever_the_capacity() -> None:
    """Seen in bench/scale.py: two stores with 8 GiB each on a 23 GB host, and the OOM killer ended one."""
    available = [100]
    memory = SnapshotMemory(capacity_bytes=10_000, host_available=lambda: available[0], host_reserve_bytes=20)
    memory.chunk_target(PutChunk("j", 1, 0, "m0", 1, 0, CHUNK, 40))  # 36 still promised: 100 - 36 - 20 = 44
    with pytest.raises(StoreError, match="host memory"):
        memory.chunk_target(PutChunk("j", 1, 1, "m0", 1, 0, CHUNK, 45))
    assert memory.unfilled_bytes == 40 - CHUNK, "the chunk received is taken from the host, not promised"
    memory.abandon(("j", 0, 1), None)
    memory.finished("j", 1)
    assert memory.unfilled_bytes == 0 and memory.host_room_for(80) and not memory.host_room_for(81)
    upload(memory, 1, b"x" * 40, generation=2)
    available[0] = 50  # the upload's 40 bytes are the host's now: a fresh 40 would not fit
    memory.commit("j", 1, generation=2)
    memory.finished("j", 2)  # its buffer goes to the pool: a next upload of that size takes no fresh memory
    upload(memory, 2, b"y" * 40, generation=3)
    assert memory.unfilled_bytes == 0
    memory = SnapshotMemory(capacity_bytes=10_000, host_available=lambda: None, host_reserve_bytes=20)
    upload(memory, 1, b"z" * 400)  # where the host's memory is unknown, only the capacity counts


def test_a_checksum_taken_as_bytes_arrived_counts_only_for_the_buffer_they_arrived_in() -> None:
    """An ingest thread checksums a chunk as it receives it; if the upload was replaced meanwhile (a
    fresh upload of the same key), the checksum is of the old buffer's bytes and must not count."""
    memory = SnapshotMemory(capacity_bytes=1000)
    data = b"abcdefgh"
    chunks = [PutChunk("j", 1, 0, "m0", 1, offset, n, len(data)) for offset, n in chunk_spans(len(data), CHUNK)]
    for chunk in chunks:
        target = memory.chunk_target(chunk)
        target[:] = data[chunk.offset : chunk.offset + chunk.nbytes]
        into = mmap.mmap(-1, 8) if chunk.offset else target.obj  # the second: a buffer no longer the upload's
        memory.chunk_received(chunk, chunk_checksum(target), into=into)
    checksums = [chunk_checksum(data[o : o + n]) for o, n in chunk_spans(len(data), CHUNK)]

    with pytest.raises(StoreError, match="1 of 2 chunks missing"):
        memory.seal(Seal("j", 1, 0, "m0", 1, len(data), CHUNK, checksums, b"meta"))
