"""What the control plane's per-message and per-save work costs, one piece at a time, at the sizes of
`control_plane_scale.py`: decoding a launcher's batch of 8 whole beats, of 8 names and of 8 acks (the
detector's and the swapper's work per host and period), the detector's whole work (decode and take) per
member and second of real members' beats (`real_beats`) as their launcher's `BeatCompaction` batches
them, with the beats it sends whole, decoding and encoding a rebuild of N ranks, placing a rebuild's
snapshots after a swap, the swapper's whole decision of a swap (the tick after the last call that builds
its rebuild), the detector's passes over every member (its review of stragglers and stalls, its hang
rules, the pass that finds a sixteenth of the hosts silent), the detector's whole work per member and
second for a job of N ranks (10 s of its launchers' real batches decoded and taken, its passes at their
periods; and of it the decode, msgpack's unpacking, the take, the passes), the swapper's work of a committed step (the
stores' reports) and of a tick with no replica to make, and saving a job record of N ranks: at a
commit, while a rebuild is pending (an ack, a store report), both without the memo of its large
fields (`section_memo.SectionMemo`), while the job forms (16 members more since the last save), once
a swap is decided, at the first commit after a swap, and while a swap's acks come in (a save after
each 64 ack batches: their sum and the slowest); a swap's rebuild as its delta (`RebuildDelta`): its
bytes, the swapper's work to make it, a member's to take it (where it decoded the whole rebuild
before); the same for a store lost, its new placement as its delta (`PlacementDelta`).

    .venv/bin/python bench/control_plane_costs.py [--ranks 8192 16384] [--repeats 5]

Each figure is the fastest of `--repeats` runs (one process, nothing else should run). Prints a row
per figure and ends with one JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
import time
import timeit
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from detector_scale import HOST_MEMBERS, host_batches, job_rebuild
from detector_scale import JOB as SCALE_JOB
from real_beats import real_beat

from deadpool.beat_compaction import BeatCompaction
from deadpool.launcher import HEARTBEAT_BATCH_PERIOD_S
from deadpool_detector.core import BUSY_SAMPLES_PER_BEAT_MAX, DetectorConfig, DetectorCore, _sample_busy
from deadpool_detector.service import HANG_RULES_PERIOD_S, REVIEW_PERIOD_S, DetectorServiceConfig
from deadpool_protocol import (
    Failure,
    FailureReason,
    Heartbeat,
    HeartbeatBatch,
    Placement,
    PlacementDelta,
    Rebuild,
    RebuildAck,
    RebuildAckBatch,
    RebuildDelta,
    RebuildMarks,
    RestoreSource,
    SnapshotComplete,
    StoreAddress,
    StoreStatus,
    encode,
)
from deadpool_protocol.codec import decode, decode_on
from deadpool_protocol.messages import MemberPhase
from deadpool_protocol.placement_delta import placement_applied, placement_delta_of
from deadpool_protocol.rebuild_delta import applied, delta_of
from deadpool_protocol.subjects import Subjects
from deadpool_protocol.timeouts import HEARTBEAT_PERIOD_S_DEFAULT
from deadpool_swapper.core import JobState, SwapperConfig, SwapperCore
from deadpool_swapper.job_parts import Membership, PendingRebuild, Recovery
from deadpool_swapper.job_records import JobRecords
from deadpool_swapper.placement import StoreInfo, place_snapshots
from deadpool_swapper.section_memo import SectionMemo
from tests.integration.test_job_record_sections import STORES, commit, large_job, swap
from tests.integration.test_job_record_sections import member as member_info
from tests.unit.test_detector_core import formed


def fastest_ms(work: Callable[[], Any], repeats: int, number: int = 1) -> float:
    return min(timeit.repeat(work, number=number, repeat=repeats)) / number * 1e3


def batches(repeats: int) -> dict[str, float]:
    now = time.time()
    beats = [
        Heartbeat("scale", 1, f"sim-{k:05d}", k, 1000 + k, 5, True, now, now, host="host-1", local_step=4,
                  phase=MemberPhase.TRAINING, step_completed_t=now, where="train.py:123 step")
        for k in range(8)
    ]  # fmt: skip
    whole = encode(HeartbeatBatch("scale", 1, "l-host-00012", beats, [], [10] * 8))
    named = encode(HeartbeatBatch("scale", 1, "l-host-00012", [], [b.member for b in beats], [10] * 8))
    marks = RebuildMarks(received=1.0, out=1.1, begin=1.2, restored=1.3, rendezvous=1.4, ready=1.5)
    acks = [RebuildAck("scale", 3, f"sim-{i:05d}", i, 10, 11, RestoreSource.LOCAL, marks, 2.0) for i in range(8)]
    acked = encode(RebuildAckBatch("scale", 3, "l-host-00012", acks))
    on_beats, on_acks = "deadpool.scale.launcher.heartbeats", "deadpool.scale.launcher.acks"

    def us(data: bytes, subject: str, kind: type[Any]) -> float:
        return 1e3 * fastest_ms(lambda: decode_on(subject, data, kind), repeats, 2000)

    return {
        "decode_8_whole_beats_us": us(whole, on_beats, HeartbeatBatch),
        "decode_8_names_us": us(named, on_beats, HeartbeatBatch),
        "decode_8_acks_us": us(acked, on_acks, RebuildAckBatch),
    }


def real_host(repeats: int, seconds: float = 20.0, step_s: float = 2.0) -> dict[str, float]:
    """A host of 8 real members beating at 10 Hz for `seconds`, 2 s steps, each at its own phase: the
    batches their launcher's compaction makes every period, and the detector's decode and take of them."""
    members = [f"sim-{k:05d}" for k in range(8)]
    compaction = BeatCompaction()
    sent: list[bytes] = []
    whole = 0
    for i in range(int(seconds / HEARTBEAT_BATCH_PERIOD_S)):
        t = i * HEARTBEAT_BATCH_PERIOD_S
        received = {}
        for k, member in enumerate(members):
            at = t + k * 0.0123  # each member a little off the others
            step, into = int(at / step_s), (at % step_s) / step_s
            received[member] = (real_beat("j", 1, member, k, 1000 + k, "host-1", step, into, step_s, 0.0, at), at)
        batch = compaction.batch("j", 1, "l-host-1", received, t)
        whole += len(batch.beats)
        sent.append(encode(batch))
    subject = "deadpool.j.launcher.heartbeats"

    def detect() -> None:
        core = DetectorCore(DetectorConfig())
        formed(core, 0.0, ranks=tuple(members), spares=())
        for i, data in enumerate(sent):
            core.on_batch(decode_on(subject, data, HeartbeatBatch), i * HEARTBEAT_BATCH_PERIOD_S)

    member_seconds = len(members) * seconds
    return {
        "detector_us_per_member_s_real_beats": 1e3 * fastest_ms(detect, repeats) / member_seconds,
        "whole_beats_per_member_s_real": whole / member_seconds,
    }


def rebuild_of(state: JobState) -> Rebuild:
    addresses = [StoreAddress(name, "10.0.0.1", 7000 + s) for s, name in enumerate(STORES)]
    who = state.membership
    return Rebuild(
        "big", state.generation + 1, who.world_size, list(who.ranks), list(who.spares), who.ranks[0],
        "10.0.0.1", 29_500, state.ledger.committed_step, addresses, state.stores.placement, "", time.time(),
    )  # fmt: skip


def rebuild_delta_costs(base: Rebuild, spare: str, repeats: int) -> dict[str, float]:
    """A swap of rank 100 to `spare` (its stores changed too) as its delta: its bytes, the swapper's
    work to make it (`delta_of`, at each decision), and a member's to take it (decode and `applied`,
    where it decoded the whole command before)."""
    ranks = list(base.ranks)
    ranks[100] = spare
    placement = list(base.placement)
    placement[100] = list(reversed(placement[100]))
    spares = [s for s in base.spares if s != spare]
    swapped = dataclasses.replace(base, generation=base.generation + 1, ranks=ranks, spares=spares, placement=placement)
    swapped.check()
    delta = delta_of(swapped, base.generation, 0, list(base.ranks), base.placement)
    data = encode(delta)
    assert applied(decode(data, RebuildDelta), base, 0, base.placement) == swapped
    return {
        "rebuild_delta_bytes": float(len(data)),
        "make_rebuild_delta_ms": fastest_ms(
            lambda: delta_of(swapped, base.generation, 0, list(base.ranks), base.placement), repeats
        ),
        "take_rebuild_delta_ms": fastest_ms(
            lambda: applied(decode(data, RebuildDelta), base, 0, base.placement), repeats
        ),
    }


def placement_delta_costs(state: JobState, base: Rebuild, repeats: int) -> dict[str, float]:
    """A store lost (the first of `STORES`): the swapper's new placement (`place_snapshots`, its lost
    store's ranks moved) whole and as its delta from the rebuild's (`base`): their bytes, the
    swapper's work to make the delta (at the decision), a member's to take it (decode and
    `placement_applied`) against decoding the whole placement, which every member did before."""
    live = [StoreInfo(name, "10.0.0.1", 7000 + s, 0.0, node=f"host-{s}") for s, name in enumerate(STORES)][1:]
    moved = place_snapshots(base.ranks, state.membership.members, live, 2, state.ledger.rank_bytes, base.placement)
    addresses = [StoreAddress(s.store, s.host, s.port) for s in live]
    whole = Placement(base.job, base.generation, 1, addresses, moved, f"stores lost: ['{STORES[0]}']")
    delta = placement_delta_of(whole, 0, base.placement)
    data, whole_data = encode(delta), encode(whole)
    assert placement_applied(decode(data, PlacementDelta), base, 0, base.placement) == whole
    return {
        "placement_bytes": float(len(whole_data)),
        "placement_delta_bytes": float(len(data)),
        "placement_delta_ranks": float(len(delta.replaced)),
        "decode_placement_ms": fastest_ms(lambda: decode(whole_data, Placement, 1 << 25), repeats),
        "make_placement_delta_ms": fastest_ms(lambda: placement_delta_of(whole, 0, base.placement), repeats),
        "take_placement_delta_ms": fastest_ms(
            lambda: placement_applied(decode(data, PlacementDelta), base, 0, base.placement), repeats
        ),
    }


def at_size(ranks: int, repeats: int) -> dict[str, float]:
    state = large_job(ranks)
    rebuild = rebuild_of(state)
    data = encode(rebuild)
    addresses = [StoreInfo(name, "10.0.0.1", 7000 + s, 0.0, node=f"host-{s}") for s, name in enumerate(STORES)]
    swapped = list(state.membership.ranks)
    swapped[100] = state.membership.spares[0]
    records = JobRecords(None, None)  # type: ignore[arg-type]  # encoding only: no KV
    stored = records._encode("big", state, 100.0, {}, SectionMemo())

    def save_after(change: Callable[[JobState], None], memo: SectionMemo | None) -> Callable[[], Any]:
        """A save after `change`, with `memo` as the last save left it (None: a save without one)."""
        kept = memo or SectionMemo()
        records._encode("big", state, 100.0, stored.sections, kept)

        def work() -> None:
            change(state)
            records._encode("big", state, 100.0, stored.sections, kept if memo else SectionMemo())

        return work

    def a_commit(state: JobState) -> None:
        commit(state, state.ledger.committed_step + 1)

    def nothing(_state: JobState) -> None:
        """An ack or a store report changes none of the large fields."""

    figures = {
        "rebuild_bytes": float(len(data)),
        "decode_rebuild_ms": fastest_ms(lambda: decode(data, Rebuild, 1 << 25), repeats),
        "encode_rebuild_ms": fastest_ms(lambda: encode(rebuild), repeats),
        "place_after_a_swap_ms": fastest_ms(
            lambda: place_snapshots(swapped, state.membership.members, addresses, 2, previous=state.stores.placement),
            repeats,
        ),
        "save_at_a_commit_ms": fastest_ms(save_after(a_commit, SectionMemo()), repeats),
        "save_at_a_commit_no_memo_ms": fastest_ms(save_after(a_commit, None), repeats),
    }
    figures |= rebuild_delta_costs(rebuild, state.membership.spares[0], repeats)
    figures |= placement_delta_costs(state, rebuild, repeats)
    figures["decide_a_swap_ms"] = decide_a_swap_ms(ranks, repeats)
    figures["save_in_formation_ms"] = save_in_formation_ms(ranks, repeats)
    figures["save_after_a_swap_ms"] = save_after_a_swap_ms(ranks, repeats)
    figures["save_at_a_commit_after_a_swap_ms"] = save_at_a_commit_after_a_swap_ms(ranks, repeats)
    figures |= step_reports_ms(ranks, repeats)
    figures |= saves_while_acked_ms(ranks)
    state.recovery.pending = PendingRebuild(rebuild, 100.0)
    figures["save_while_pending_ms"] = fastest_ms(save_after(nothing, SectionMemo()), repeats)
    figures["save_while_pending_no_memo_ms"] = fastest_ms(save_after(nothing, None), repeats)
    return figures


FORMATION_BATCH = 16
"""Members that register between two saves of a forming job (hellos decided together, one save)."""


def save_in_formation_ms(ranks: int, repeats: int) -> float:
    """A save of a job that forms, `ranks` members registered, `FORMATION_BATCH` of them since the
    last save (fastest of `repeats`; each save's new sections compressed, as a save writes them)."""
    state = JobState("big", run="run-1", membership=Membership(world_size=ranks), recovery=Recovery())
    infos = [member_info(i, ranks) for i in range(ranks + (repeats + 1) * FORMATION_BATCH)]
    state.membership.members = {info.member: info for info in infos[:ranks]}

    def joined(start: int) -> None:
        state.membership.members |= {info.member: info for info in infos[start : start + FORMATION_BATCH]}

    starts = range(ranks, ranks + repeats * FORMATION_BATCH, FORMATION_BATCH)
    return fastest_save_after_ms(state, (functools.partial(joined, start) for start in starts))


def fastest_save_after_ms(state: JobState, changes: Iterable[Callable[[], None]], follow: bool = False) -> float:
    """The fastest save of `state`, with the memo of the saves before, after each of `changes` in turn.
    Each save knows the sections the first one stored, or (`follow`) those of the save before it."""
    records = JobRecords(None, None)  # type: ignore[arg-type]  # encoding only: no KV
    memo = SectionMemo()
    stored = records._encode("big", state, 100.0, {}, memo).sections
    times = []
    for change in changes:
        change()
        started = time.perf_counter()
        saved = records._encode("big", state, 100.0, stored, memo).sections
        times.append(1e3 * (time.perf_counter() - started))
        stored = saved if follow else stored
    return min(times)


def save_at_a_commit_after_a_swap_ms(ranks: int, repeats: int) -> float:
    """The save of the first commit after a swap that moved a rank's copies: the holders of the
    committed step differ at that rank, and those of the step before at the rank of the swap before
    (fastest of `repeats`, each after a swap of its own)."""
    state = large_job(ranks)

    def moved_then_committed(rank: int) -> None:
        state.stores.placement[rank] = [STORES[(rank + 5) % 32], STORES[(rank + 6) % 32]]
        commit(state, state.ledger.committed_step + 1)

    ranks_moved = range(100, 100 + repeats)
    return fastest_save_after_ms(state, (functools.partial(moved_then_committed, r) for r in ranks_moved), True)


def save_after_a_swap_ms(ranks: int, repeats: int) -> float:
    """The save of a job of `ranks` ranks once a swap is decided: a spare holds the failed rank, its
    stores changed, the rebuild command is new (fastest of `repeats`, each a swap of its own)."""
    state = large_job(ranks)

    def swapped(rank: int) -> None:
        swap(state, rank)
        state.recovery.pending = PendingRebuild(rebuild_of(state), 100.0)
        state.generation += 1

    return fastest_save_after_ms(state, (functools.partial(swapped, r) for r in range(100, 100 + repeats)))


SAVE_EVERY_ACK_BATCHES = 64
"""Ack batches (of a host's 8 acks) the swapper takes between two saves while a rebuild's acks come in
(its worker saves after each batch of inputs, 50 ms of deciding at most: about 64 of 0.8 ms here)."""


def saves_while_acked_ms(ranks: int) -> dict[str, float]:
    """The saves of a job of `ranks` ranks while the acks of a swap's rebuild come in, a host's 8 at a
    time, a save after each `SAVE_EVERY_ACK_BATCHES` of them: their sum and the slowest (one run: each
    save is of its own acks)."""
    state = large_job(ranks)
    core = a_core_with(state)
    victim = state.membership.ranks[100]
    core.on_failure(Failure("big", state.generation, victim, 100, FailureReason.HEARTBEAT, {}, 1.0, 1.0), 1.0)
    core.tick(1.0 + core.config.last_call_s)
    assert state.recovery.pending is not None, "the swap is decided"
    command = state.recovery.pending.command
    records, memo = JobRecords(None, None), SectionMemo()  # type: ignore[arg-type]  # encoding only: no KV
    stored = records._encode("big", state, 2.0, {}, memo).sections
    times = []
    t = time.time()
    marks = RebuildMarks(received=t, begin=t, restored=t, rendezvous=t, ready=t)
    for batch, host in enumerate(range(0, ranks, 8)):
        acks = [
            RebuildAck(
                "big", command.generation, command.ranks[r], r, command.restore_step, 5, RestoreSource.LOCAL, marks, t
            )
            for r in range(host, min(host + 8, ranks))
        ]
        launcher = state.membership.members[command.ranks[host]].launcher
        core.on_ack_batch(RebuildAckBatch("big", command.generation, launcher, acks), 2.0)
        if state.recovery.pending is None:
            break  # every rank acked: the rebuild is done
        if batch % SAVE_EVERY_ACK_BATCHES == SAVE_EVERY_ACK_BATCHES - 1:
            started = time.perf_counter()
            stored = records._encode("big", state, 2.0, stored, memo).sections
            times.append(1e3 * (time.perf_counter() - started))
    return {"saves_while_acked_ms": sum(times), "save_while_acked_ms_max": max(times)}


def a_core_with(state: JobState) -> SwapperCore:
    """A swapper core that knows `STORES`, live, and holds `state` (formed, a step committed)."""
    core = SwapperCore(SwapperConfig(replication=2, store_timeout_s=1e9))
    for s, name in enumerate(STORES):
        core.on_store_status(StoreStatus(name, "10.0.0.1", 7000 + s, 0, 1 << 50, 0, 0.0, node=f"host-{s}"), 0.0)
    core.jobs[state.job] = state
    return core


def step_reports_ms(ranks: int, repeats: int) -> dict[str, float]:
    """The swapper's work of one committed step of a job of `ranks` ranks: each store's report of the
    ranks it sealed (one per store), the last one committing the step; and a tick that finds no
    replica to make (every rank's stores hold its copy), which every tick asks (fastest of `repeats`)."""
    state = large_job(ranks)
    core = a_core_with(state)
    by_store: dict[str, list[int]] = {}
    for rank, stores in enumerate(state.stores.placement):
        for store in stores:
            by_store.setdefault(store, []).append(rank)
    times = []
    for _ in range(repeats):
        step = state.ledger.committed_step + 1
        reports = [
            SnapshotComplete("big", state.generation, store, step, ranks_there, [1000] * len(ranks_there))
            for store, ranks_there in by_store.items()
        ]
        started = time.perf_counter()
        for report in reports:
            core.on_snapshot_complete(report, 1.0)
        times.append(1e3 * (time.perf_counter() - started))
        assert state.ledger.committed_step == step
    return {
        "a_steps_store_reports_ms": min(times),
        "a_tick_with_no_replica_to_make_ms": fastest_ms(lambda: core._replicas_wanted(state, 1.0), repeats),
    }


def decide_a_swap_ms(ranks: int, repeats: int) -> float:
    """The swapper's tick that turns one rank's failure into its rebuild, after the last call: the
    spare chosen, the restore link, the placement, the command built and checked (fastest of
    `repeats`, each on a job of its own)."""
    times = []
    for i in range(repeats):
        state = large_job(ranks)
        core = a_core_with(state)
        victim = state.membership.ranks[100 + i]
        core.on_failure(Failure("big", state.generation, victim, 100 + i, FailureReason.HEARTBEAT, {}, 1.0, 1.0), 1.0)
        started = time.perf_counter()
        decision = core.tick(1.0 + core.config.last_call_s)
        times.append(1e3 * (time.perf_counter() - started))
        assert state.recovery.pending is not None, decision.reason
    return min(times)


def detector_review_ms(ranks: int, repeats: int) -> dict[str, float]:
    """The detector's passes over every member of a job of `ranks` ranks whose straggler windows are
    full: the review once a second (stragglers, stalls) and the hang rules four times a second."""
    core = DetectorCore(DetectorConfig())
    members = tuple(f"sim-{k:05d}" for k in range(ranks))
    formed(core, 0.0, ranks=members, spares=())
    periods = BUSY_SAMPLES_PER_BEAT_MAX
    for k, watched in enumerate(core.jobs["j"].members.values()):
        for i in range(core.config.straggler_window // periods + 1):
            _sample_busy(watched, (i + k) % 3 != 0, (i + 1) * periods * HEARTBEAT_PERIOD_S_DEFAULT)
    now = 1.0  # every member heard at 0: none silent, none stalled
    return {
        "detector_review_ms": fastest_ms(lambda: (core.stragglers(now), core.stalls(now)), repeats),
        "detector_hang_rules_ms": fastest_ms(lambda: core.check(now, hang_rules=True), repeats),
    }


def detector_at_size_us(ranks: int, repeats: int, seconds: float = 10.0) -> dict[str, float]:
    """The detector's whole work per member and second for a job of `ranks` members, in one process
    (no NATS): `seconds` of its launchers' real beat batches (`detector_scale.host_batches`: hosts of 8,
    a batch every 0.25 s, a whole beat at each step and every second) decoded and taken, and its passes
    over the members at their periods on the same clock (the silence check every 50 ms, the hang rules
    every 0.25 s, the review every second; heartbeat timeout 1 s, as issue 26 sets it); and of it,
    msgpack's unpacking alone. Each part is the fastest of `repeats` (the passes: the batches taken
    with them, less without), and the whole their sum. No pass may declare anyone."""
    periods = int(seconds / HEARTBEAT_BATCH_PERIOD_S)
    planned = sorted(
        ((at, data) for host in range(-(-ranks // HOST_MEMBERS)) for at, data, _ in host_batches(host, ranks, periods)),
        key=lambda batch: batch[0],
    )
    subject = Subjects.for_job(SCALE_JOB).heartbeat_batch
    member_s = ranks * seconds
    decoded: list[tuple[float, HeartbeatBatch]] = []
    check_s = DetectorServiceConfig.check_period_s
    hang_every, review_every = round(HANG_RULES_PERIOD_S / check_s), round(REVIEW_PERIOD_S / check_s)

    def decode_all() -> None:
        decoded[:] = [(at, decode_on(subject, data, HeartbeatBatch)) for at, data in planned]

    def passes_at(core: DetectorCore, now: float, i: int) -> None:
        declared = core.check(now, i % hang_every == 0, timeouts=core.overdue(now))
        assert declared == [], [(f.member, f.reason) for f in declared[:5]]
        core.repeats(now)
        if i % review_every == 0:
            core.prune(now)
            core.stragglers(now)
            core.stalls(now)

    def take_all(with_passes: bool) -> None:
        core = DetectorCore(DetectorConfig(heartbeat_timeout_s=1.0, hang_floor_s=3.0))
        core.on_rebuild(job_rebuild(ranks), 0.0)
        i = 0
        for at, batch in decoded:
            while with_passes and i * check_s <= at:
                passes_at(core, i * check_s, i)
                i += 1
            core.on_batch(batch, at)

    decode_ms = fastest_ms(decode_all, repeats)
    take_ms = fastest_ms(lambda: take_all(False), repeats)
    passes_ms = fastest_ms(lambda: take_all(True), repeats) - take_ms
    unpack_ms = fastest_ms(lambda: [msgpack.unpackb(data) for _, data in planned], repeats)
    per_member_s = {"decode": decode_ms, "unpack": unpack_ms, "take": take_ms, "passes": passes_ms}
    figures = {f"detector_{part}_us_per_member_s": 1e3 * ms / member_s for part, ms in per_member_s.items()}
    figures["detector_us_per_member_s"] = 1e3 * (decode_ms + take_ms + passes_ms) / member_s
    return figures


def detector_lost_rack_ms(ranks: int, repeats: int) -> float:
    """The detector's pass that finds a sixteenth of a job's hosts of 8 silent at once (a rack, a
    switch): every silent member declared, with its host's count (fastest of `repeats`)."""
    times = []
    for _ in range(repeats):
        core = DetectorCore(DetectorConfig())
        formed(core, 0.0, ranks=tuple(f"sim-{k:05d}" for k in range(ranks)), spares=())
        for k, watched in enumerate(core.jobs["j"].members.values()):
            watched.host = f"host-{k // 8}"
            watched.last_seen = -5.0 if k // 8 % 16 == 0 else 0.5
        started = time.perf_counter()
        declared = core.check(1.0, hang_rules=False)
        times.append(1e3 * (time.perf_counter() - started))
        assert len(declared) == len(range(0, ranks, 128)) * 8, len(declared)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    per_batch = batches(args.repeats) | real_host(args.repeats)
    for name, value in per_batch.items():
        print(f"{name:>36}: {value:8.2f}")
    sizes = []
    for ranks in args.ranks:
        figures = at_size(ranks, args.repeats) | detector_review_ms(ranks, args.repeats)
        figures["detector_lost_rack_ms"] = detector_lost_rack_ms(ranks, args.repeats)
        figures |= detector_at_size_us(ranks, min(args.repeats, 3))
        for name, value in figures.items():
            print(f"{ranks:>6} ranks {name:>31}: {value:10.1f}")
        sizes.append({"ranks": ranks, **{k: round(v, 2) for k, v in figures.items()}})
    print(json.dumps({"repeats": args.repeats, **{k: round(v, 2) for k, v in per_batch.items()}, "sizes": sizes}))


if __name__ == "__main__":
    main()
