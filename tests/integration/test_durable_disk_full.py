"""The durable tier on a disk that fills up: a real tmpfs of a few MiB, mostly taken by a file, so the
second snapshot persisted does not fit. The writer must live through DCP's failure, remove the partial
files, say "disk full" with the path and the bytes, persist again once the file is deleted, and still
leave its member's exit bounded when a write hangs.
"""

from __future__ import annotations

import os
import select
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs
from torch import nn

from deadpool.durable_tier import DurableWriter, complete_steps, load_rank, rank_files, step_dir
from deadpool.snapshot_layout import FlatBuffer
from deadpool.training_state import snapshot_now
from deadpool_runtime.logs import get_logger

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")

DISK_BYTES = 4 * 1024 * 1024
SNAPSHOT_INPUTS = 65536
"""A Linear(65536, 4): 1 MiB of weights, so about one and a half snapshots fit beside the filler."""
STEPS_MAX = 8
"""Persists tried before the disk must have been found full."""
PERSIST_WAIT_S = 30.0
CLOSE_WAIT_S = 0.5
CLOSE_SLACK_S = 5.0
"""What `close` may take beyond its own bound on a loaded 2-core CI machine (a sanity bound, not a goal)."""


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    mount = tmp_path / "disk"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        if subprocess.run(["umount", str(mount)]).returncode != 0:
            subprocess.run(["umount", "--lazy", str(mount)], check=True)  # a writer thread still holds a file


def snapshot(step: int) -> tuple[FlatBuffer, bytes]:
    torch.manual_seed(step)
    model = nn.Sequential(nn.Linear(SNAPSHOT_INPUTS, 4))
    buffer, meta = snapshot_now(model, None, step)
    return buffer, meta.encode()


def persist(writer: DurableWriter, step: int) -> FlatBuffer:
    buffer, meta = snapshot(step)
    assert writer.offer(step, 0, 1, 1, buffer, meta), "tried, not skipped as still being written"
    assert writer.wait_idle(PERSIST_WAIT_S)
    return buffer


def drain_until_closed(fifo: Path, timeout_s: float) -> None:
    """Read `fifo` until its writer closes it (opening it is what the writer was stuck on)."""
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        poller = select.poll()
        poller.register(reader, select.POLLIN)
        deadline = time.monotonic() + timeout_s
        while (left_s := deadline - time.monotonic()) > 0:
            if poller.poll(left_s * 1000) and not os.read(reader, 1 << 16):
                return  # end of file: the writer closed it
        raise AssertionError(f"nothing closed {fifo} within {timeout_s} s")
    finally:
        os.close(reader)


def test_the_durable_tier_survives_a_full_disk_and_persists_again_once_it_has_room(small_disk: Path) -> None:
    needed = snapshot(1)[0].layout.total_bytes
    filler = small_disk / "filler"
    filler.write_bytes(b"\0" * (shutil.disk_usage(small_disk).free - needed * 3 // 2))
    writer = DurableWriter(
        str(small_disk), "j", every_steps=1, keep=STEPS_MAX, log=get_logger(test="disk"), close_wait_s=CLOSE_WAIT_S
    )
    stuck = small_disk / "never"
    try:
        with capture_logs() as logs:
            step = 0
            while writer.disk_full == 0 and step < STEPS_MAX:
                step += 1
                persist(writer, step)
            assert writer.disk_full == 1 and writer.persisted >= 1, "some steps fit, then the disk was full"
            assert writer.running, "DCP's CheckpointException did not end the writer"
            full_step = step
            assert not step_dir(small_disk, full_step).exists(), "the failed step's partial files are removed"
            assert all((d / "rank_00000.json").is_file() for d in small_disk.glob("step_*")), "no partial step left"

            checkpoint, _ = rank_files(small_disk, full_step, 0)
            (said,) = [line for line in logs if line["event"] == "durable persist failed: disk full"]
            assert said["path"] == str(checkpoint) and said["bytes_needed"] == needed
            assert 0 <= said["bytes_free"] < needed, "the free bytes, read after the partial files went"
            assert said["reason"].startswith(f"disk full: {needed} bytes needed") and str(checkpoint) in said["reason"]
            failure = writer.last_failure
            assert failure is not None and failure.disk_full and failure.path == str(checkpoint)

            persist(writer, full_step + 1)
            assert writer.disk_full == 2, "still full: tried again and failed again, the writer alive"

            filler.unlink()  # room again
            room_step = full_step + 2
            buffer = persist(writer, room_step)
            assert writer.persisted == full_step and writer.skipped == 0
            assert complete_steps(small_disk, 1)[0] == room_step
            loaded, loaded_meta = load_rank(small_disk, room_step, 0, 1)  # dcp.load, then every tensor's checksum
            assert loaded_meta.step == room_step
            assert all(torch.equal(loaded.by_name[name], view) for name, view in buffer.by_name.items())

            # A write that hangs (opening a FIFO waits for a reader) still leaves close() bounded.
            stuck = rank_files(small_disk, room_step + 1, 0)[1].with_suffix(".json.partial")
            stuck.parent.mkdir()
            os.mkfifo(stuck)
            hung, hung_meta = snapshot(room_step + 1)
            assert writer.offer(room_step + 1, 0, 1, 1, hung, hung_meta)
            started = time.monotonic()
            assert not writer.close(), "the hung write is abandoned"
            assert time.monotonic() - started < CLOSE_WAIT_S + CLOSE_SLACK_S
    finally:
        if stuck.exists():
            drain_until_closed(stuck, PERSIST_WAIT_S)
        assert writer.close(timeout_s=PERSIST_WAIT_S), "the writer ends once its write returns"
