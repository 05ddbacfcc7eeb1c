"""The record of a job of 16,384 ranks in a real JetStream KV: no value stored is larger than 256 kB,
a commit writes a small head and nothing of the membership or placement, a member who joins writes
the membership again and not the placement, and what a new leader and a detector read back is what
was saved.

Before, the whole record (about 6.5 MB packed at this size, 400 B per rank) was compressed and
written again at every commit, in parts of up to the server's 1 MiB payload."""

from __future__ import annotations

import time
from collections import Counter

from nats.aio.client import Client

from deadpool_protocol.job_record import JOBS_BUCKET, PART_SEPARATOR, RECORD_PART_BYTES_MAX, sections_of, unpack_record
from deadpool_runtime.job_record_kv import bucket_keys, read_record
from deadpool_runtime.logs import get_logger
from deadpool_swapper.core import JobState
from deadpool_swapper.job_parts import Membership, Recovery
from deadpool_swapper.job_records import JobRecords
from deadpool_swapper.placement import MemberInfo
from deadpool_swapper.restore_chain import CommittedCopies

RANKS = 16_384
SPARES = 64
STORES = [f"store-{i:02d}" for i in range(32)]
HEAD_BYTES_MAX = 8 * 1024


def member(i: int, ranks: int = RANKS) -> MemberInfo:
    name = f"gpu-node-{i // 8:05d}-rank-{i:05d}-a1b2c3d4e5"
    host = f"gpu-node-{i // 8:05d}.cluster.example"
    hint = i if i < ranks else -1
    return MemberInfo(name, host, 10_000 + i, f"{host}-launcher", hint, host, 29_500, 100.0 + i / 1000)


def large_job(ranks: int = RANKS) -> JobState:
    """A formed job of `ranks` ranks and `SPARES` spares, 8 per host, 2 of `STORES` per rank, a step
    committed (also `bench/control_plane_costs.py`'s job)."""
    members = [member(i, ranks) for i in range(ranks + SPARES)]
    placement = [[STORES[r % 32], STORES[(r + 1) % 32]] for r in range(ranks)]
    state = JobState(
        "big", run="run-1", generation=3, membership=Membership(world_size=ranks), recovery=Recovery(formed=True)
    )
    state.membership.members = {m.member: m for m in members}
    state.membership.ranks = [m.member for m in members[:ranks]]
    state.membership.spares = [m.member for m in members[ranks:]]
    state.stores.placement = placement
    state.ledger.rank_bytes = dict.fromkeys(range(ranks), 1_650_000_000)
    state.ledger.committed_step, state.ledger.committed_generation = 40, 3
    state.ledger.committed_holders = {r: set(placement[r]) for r in range(ranks)}
    state.ledger.previous_committed = CommittedCopies(39, 3, {r: set(placement[r]) for r in range(ranks)})
    return state


def commit(state: JobState, step: int) -> None:
    """What the swapper's commit changes: the step, the previous one, the holders (made afresh, in
    the order the stores' reports came, not rank order)."""
    state.ledger.previous_committed = state.ledger.committed_copies()
    state.ledger.committed_step = step
    state.ledger.committed_holders = {
        r: set(reversed(state.stores.placement[r])) for r in reversed(range(state.membership.world_size))
    }
    state.position.applied_seq += 64


def swap(state: JobState, rank: int) -> None:
    """What a swap changes in the membership and placement: the first spare takes `rank`, whose member
    is gone and failed, and the rank's stores change (the rebuild command is the caller's)."""
    who = state.membership
    failed = who.ranks[rank]
    del who.members[failed]
    who.ranks[rank] = who.spares.pop(0)
    who.failed.append(failed)
    state.stores.placement[rank] = state.stores.placement[rank][::-1]


async def fields_written(records: JobRecords) -> set[str]:
    """The fields whose sections the last save wrote, by the stored head's names for them."""
    return set(await sections_written(records))


async def sections_written(records: JobRecords) -> Counter[str]:
    """How many sections of each field the last save wrote, by the stored head's names for them."""
    head = (await records.kv.get("big")).value
    assert head is not None
    sectioned = sections_of(head)
    assert sectioned is not None
    written = {key.split(PART_SEPARATOR)[1].split(".")[0] for key, _ in records.written if PART_SEPARATOR in key}
    return Counter(field for _, field, digest, _ in sectioned[1] if digest in written)


async def test_a_commit_of_a_16384_rank_job_writes_a_small_head_and_no_membership(nc: Client) -> None:
    js = nc.jetstream(timeout=10.0)
    records = await JobRecords.open(js, get_logger(), payload_bytes=nc.max_payload)
    state = large_job()
    now = time.monotonic()

    await records.save(state, now)
    first = list(records.written)
    assert max(size for _, size in first) <= RECORD_PART_BYTES_MAX
    assert sum(size for _, size in first) > 2 * RECORD_PART_BYTES_MAX, "the job was meant to be large"

    commit(state, 41)
    await records.save(state, now + 2.0)
    assert [key for key, _ in records.written] == ["big"], await fields_written(records)  # the head alone
    assert records.written[0][1] <= HEAD_BYTES_MAX

    joined = member(RANKS + SPARES)
    state.membership.members[joined.member] = joined
    state.membership.spares.append(joined.member)
    await records.save(state, now + 3.0)
    # not the placement, nor the ranks; a chunk of the members, not all of them (a chunk's size follows
    # where this process's salted hash cuts the names: a byte bound once failed 2 seeds of 20)
    assert await sections_written(records) == {"hosts": 1, "member_rows": 1, "spares": 1}

    swap(state, 100)
    await records.save(state, now + 4.0)
    written = await sections_written(records)
    assert set(written) == {"hosts", "member_rows", "ranks", "spares", "placement"}
    # A chunk of each, not the membership (15 chunks here): the members' chunk that lost the failed one
    # and, where that chunk was cut by count (`CHUNK_ITEMS_MAX`, names that never hash to a cut), the
    # next one, whose first member moves (exactly one failed 3 seeds of 48: PYTHONHASHSEED 21, 22, 35).
    assert written["ranks"] == written["placement"] == 1, written
    assert max(written.values()) <= 2, ("a chunk or two of each, not the membership", written)

    loaded = await JobRecords(records.kv, get_logger()).load("big", now + 10.0)
    assert loaded is not None
    assert (loaded.ledger.committed_step, loaded.ledger.previous_committed.step) == (41, 40)
    assert (
        loaded.stores.placement == state.stores.placement
        and loaded.ledger.committed_holders == state.ledger.committed_holders
    )
    assert (
        loaded.membership.members.keys() == state.membership.members.keys()
        and loaded.membership.spares == state.membership.spares
    )
    kv = await js.key_value(JOBS_BUCKET)
    stored = await read_record(kv, "big", 5.0)  # as a detector reads it
    assert stored is not None
    summary, _ = unpack_record(stored.record)
    assert summary.ranks == state.membership.ranks and summary.hosts[joined.member] == joined.host
    assert set(await bucket_keys(kv, 10.0)) > {"big", *stored.part_keys}, "a save leaves the parts it stopped naming"
    await records.collect("big")  # what the job's worker does once what the save decided is out
    assert set(await bucket_keys(kv, 10.0)) == {"big", *stored.part_keys}, "the parts no head names are gone"
