"""The host-local crash copy: a member's snapshot buffers are files in its launcher's directory, a
newcomer on the host takes a dead member's copies of its rank (verified), and nothing of a job
outlives its launcher."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from deadpool.host_copy import HEAD_BYTES_MAX, SLOTS, HostCopy, SlotHead
from deadpool.host_copy_dir import make_job_dir, sweep_stale
from deadpool.snapshot_layout import plan_layout
from deadpool.snapshot_worker import SnapshotWorker
from deadpool.store_client import UploadKey
from deadpool.training_state import SnapshotMeta, collect_sources
from deadpool_runtime.logs import get_logger

WAIT_S = 10.0
LOG = get_logger(test="host_copy")


def capture_steps(job_dir: Path, member: str, rank: int, steps: list[int]) -> tuple[nn.Module, dict[int, Any]]:
    """A member's worker captures `steps` (the model changed between them); returns the model and each
    step's weights as captured."""
    torch.manual_seed(rank)
    first = nn.Linear(64, 64)
    model = nn.Sequential(first, nn.Linear(64, 8))
    sources = collect_sources(model, None)
    layout = plan_layout(list(zip(sources.names, sources.tensors, strict=True)))
    worker = SnapshotWorker(LOG, chunk_bytes=4096, host_copy=HostCopy(job_dir, "j", member, LOG))
    weights = {}
    for step in steps:
        with torch.no_grad():
            first.weight.add_(1.0)
        meta = SnapshotMeta(step, layout, {}, b"", {}).encode()
        request = worker.capture(UploadKey("j", 3, rank, member, step), layout, sources, meta, [])
        assert request is not None and request.done.wait(WAIT_S)
        weights[step] = first.weight.detach().clone()
    return model, weights


def test_a_dead_members_last_captures_are_taken_whole_by_the_newcomer_of_its_rank(tmp_path: Path) -> None:
    job_dir = make_job_dir("j", "l0", tmp_path)
    _, weights = capture_steps(job_dir, "dead", 1, [1, 2, 3, 4])
    capture_steps(job_dir, "other-rank", 0, [1, 2, 3, 4])

    taken = HostCopy(job_dir, "j", "newcomer", LOG).inherit(1)

    assert sorted(t.head.step for t in taken) == [2, 3, 4], "one per slot (SLOTS), not the overwritten one"
    for copy in taken:
        assert copy.head.rank == 1 and copy.head.generation == 3
        assert torch.equal(copy.buffer.views[0], weights[copy.head.step])
    assert not list((job_dir / "dead").iterdir()), "the copies moved to the newcomer's own files"
    assert len(list((job_dir / "other-rank").iterdir())) == 2 * SLOTS, "another rank's copies are not touched"


def test_a_slot_being_overwritten_is_not_taken(tmp_path: Path) -> None:
    job_dir = make_job_dir("j", "l0", tmp_path)
    capture_steps(job_dir, "dead", 0, [1, 2])
    dead = HostCopy(job_dir, "j", "dead", LOG)
    dead.invalidate(0)  # what a capture does before its copy writes a byte

    taken = HostCopy(job_dir, "j", "newcomer", LOG).inherit(0)

    assert [t.head.step for t in taken] == [2]


def test_a_copy_that_fails_its_checksums_is_refused_when_a_restore_asks_for_it_and_the_other_is_used(
    tmp_path: Path,
) -> None:
    """A newcomer checks a dead member's copy when a restore first asks for its step (`local`), not when
    it takes the copies: only the one a restore uses is read."""
    job_dir = make_job_dir("j", "l0", tmp_path)
    _, weights = capture_steps(job_dir, "dead", 0, [1, 2])
    newest = next(p for p in (job_dir / "dead").glob("*.head") if SlotHead.decode(p.read_bytes()).step == 2)
    with open(newest.with_suffix(".bin"), "r+b") as f:  # one flipped byte in the newest step's bytes
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))

    host_copy = HostCopy(job_dir, "j", "newcomer", LOG)
    newcomer = SnapshotWorker(LOG, chunk_bytes=4096, host_copy=host_copy)
    newcomer.take_inherited(host_copy.inherit(0))
    assert newcomer.local_steps() == [2, 1] and all(s.unchecked for s in newcomer.slots if s.step >= 0), "not read"

    assert newcomer.local(2) is None, "the flipped byte is found when a restore asks for step 2"
    assert newcomer.local_steps() == [1] and not host_copy.head_path(0).exists()
    older = newcomer.local(1)
    assert older is not None and older.unchecked is None and older.buffer is not None
    assert torch.equal(older.buffer.views[0], weights[1])


def test_malformed_and_oversized_heads_are_refused_unread(tmp_path: Path) -> None:
    job_dir = make_job_dir("j", "l0", tmp_path)
    capture_steps(job_dir, "dead", 0, [1, 2])
    heads = sorted((job_dir / "dead").glob("*.head"))
    heads[0].write_bytes(b"\x93not a head")
    with open(heads[1], "r+b") as f:
        f.truncate(HEAD_BYTES_MAX + 1)

    assert HostCopy(job_dir, "j", "newcomer", LOG).inherit(0) == []


def test_a_copy_of_another_job_or_rank_is_not_taken(tmp_path: Path) -> None:
    job_dir = make_job_dir("j", "l0", tmp_path)
    capture_steps(job_dir, "dead", 0, [1])

    assert HostCopy(job_dir, "j", "newcomer", LOG).inherit(1) == []
    assert HostCopy(job_dir, "other-job", "newcomer", LOG).inherit(0) == []


def test_the_directories_of_launchers_that_are_gone_are_swept_and_a_live_ones_kept(tmp_path: Path) -> None:
    live = make_job_dir("j", "live", tmp_path)
    dead_dir = tmp_path / "deadpool-copy-j-dead"
    dead_dir.mkdir()
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    (dead_dir / "launcher.pid").write_text(str(child.pid))  # a pid that has exited

    removed = sweep_stale(LOG, tmp_path)

    assert dead_dir in removed and not dead_dir.exists()
    assert live.exists() and int((live / "launcher.pid").read_text()) == os.getpid()


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
@pytest.mark.parametrize("features", [1024, 320], ids=["none-fits", "two-of-three-fit"])
def test_a_full_shared_memory_refuses_the_buffer_at_once_and_the_member_keeps_its_own(
    tmp_path: Path, features: int
) -> None:
    """posix_fallocate refuses what /dev/shm cannot hold: no SIGBUS later, the capture goes on in process
    memory, without a crash copy. A member that can hold only some of its buffers there holds none, and
    gives the space back to the host's other members."""
    shm = tmp_path / "shm"
    shm.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(shm)], check=True)
    try:
        job_dir = make_job_dir("j", "l0", shm)
        torch.manual_seed(0)
        model = nn.Linear(features, features)  # 4 MiB of weights (none fits), or 0.4 MB (two of three)
        sources = collect_sources(model, None)
        layout = plan_layout(list(zip(sources.names, sources.tensors, strict=True)))
        worker = SnapshotWorker(LOG, chunk_bytes=4096, host_copy=HostCopy(job_dir, "j", "m", LOG))
        meta = SnapshotMeta(1, layout, {}, b"", {}).encode()
        request = worker.capture(UploadKey("j", 1, 0, "m", 1), layout, sources, meta, [])
        assert request is not None and request.done.wait(WAIT_S)
        assert worker.host_copy is None, "the member said it has no crash copy and kept its buffers itself"
        assert len(worker.slots) == 2 and not list((job_dir / "m").glob("slot-*")), "nothing left in /dev/shm"
        slot = worker.local(1)
        assert slot is not None and slot.buffer is not None
        assert torch.equal(slot.buffer.by_name[sources.names[0]], model.weight)
    finally:
        subprocess.run(["umount", "--lazy", str(shm)], check=False)


def test_a_newcomer_reads_the_copy_it_restores_into_its_landing_as_it_checks_it(tmp_path: Path) -> None:
    """With a landing, the check reads the copy there (one pass), and `landed` hands it over without a
    second copy; a copy that fails its checksums leaves nothing landed, and another step is read over it."""
    job_dir = make_job_dir("j", "l0", tmp_path)
    _, weights = capture_steps(job_dir, "dead", 0, [1, 2])
    newest = next(p for p in (job_dir / "dead").glob("*.head") if SlotHead.decode(p.read_bytes()).step == 2)
    with open(newest.with_suffix(".bin"), "r+b") as f:  # the last byte of step 2's copy flipped
        f.seek(-1, os.SEEK_END)
        byte = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0xFF]))
    host_copy = HostCopy(job_dir, "j", "newcomer", LOG)
    newcomer = SnapshotWorker(LOG, chunk_bytes=4096, host_copy=host_copy)
    newcomer.take_inherited(host_copy.inherit(0))
    landing = torch.zeros(newcomer.slot_bytes(), dtype=torch.uint8)

    assert newcomer.local(2, into=landing) is None
    assert all(slot.landed_in is None for slot in newcomer.slots)
    older = newcomer.local(1, into=landing)
    assert older is not None and older.landed_in is landing and older.buffer is not None
    older.buffer.data.zero_()  # a second copy out of the slot would now land zeros
    landed = newcomer.landed(older, landing)

    assert landed is not None and landed.data is landing
    assert torch.equal(landed.views[0], weights[1])
