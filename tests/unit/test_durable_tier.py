"""The durable tier's files: DCP checkpoints with manifests, verified on load, pruned, and when a step
is due (every rank must decide alike); and a writer that survives failed writes and never holds up its
member's exit. (A full disk, on a real small file system: tests/integration/test_durable_disk_full.py.)"""

from __future__ import annotations

import contextlib
import os
import resource
import select
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from structlog.testing import capture_logs
from torch import nn

from deadpool.durable_tier import (
    DurableError,
    DurableWriter,
    complete_steps,
    load_rank,
    prune,
    rank_files,
    step_dir,
    write_step,
)
from deadpool.snapshot_layout import FlatBuffer
from deadpool.training_state import snapshot_now
from deadpool_runtime.logs import get_logger

PERSIST_WAIT_S = 30.0
"""Bound on one persist of a small snapshot to a local directory."""
CLOSE_SLACK_S = 5.0
"""What `close` may take beyond its own bound on a loaded 2-core CI machine (a sanity bound, not a goal)."""


def snapshot(seed: int, inputs: int = 8) -> tuple[FlatBuffer, bytes]:
    """A small model's snapshot of step `seed` (`inputs` * 16 bytes of weights)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(inputs, 4), nn.LayerNorm(4))
    buffer, meta = snapshot_now(model, None, seed, extra={"note": "x"})
    return buffer, meta.encode()


def test_a_persisted_step_loads_back_byte_for_byte_with_its_manifest(tmp_path: Path) -> None:
    buffer, meta = snapshot(6)
    write_step(tmp_path, "j", 6, 1, 2, 3, buffer, meta)
    assert complete_steps(tmp_path, 2) == [], "rank 0's files are missing: not complete"
    write_step(tmp_path, "j", 6, 0, 2, 3, buffer, meta)
    assert complete_steps(tmp_path, 2) == [6]
    loaded, loaded_meta = load_rank(tmp_path, 6, 1, 2)
    assert all(torch.equal(loaded.by_name[name], view) for name, view in buffer.by_name.items())
    assert loaded_meta.step == 6 and loaded_meta.extra == {"note": "x"}
    with pytest.raises(DurableError, match="not"):
        load_rank(tmp_path, 6, 1, 4)  # a job of another size


def test_a_flipped_byte_in_the_files_is_refused_with_the_tensor_named(tmp_path: Path) -> None:
    buffer, meta = snapshot(4)
    write_step(tmp_path, "j", 4, 0, 1, 1, buffer, meta)
    checkpoint, _ = rank_files(tmp_path, 4, 0)
    (data,) = checkpoint.glob("*.distcp")
    raw = bytearray(data.read_bytes())
    spec = buffer.layout.specs[0]
    at = raw.find(bytes(buffer.bytes_view()[spec.offset : spec.offset + spec.nbytes]))
    assert at >= 0
    raw[at + spec.nbytes // 2] ^= 0x01  # inside the first tensor's bytes
    data.write_bytes(bytes(raw))
    with pytest.raises(DurableError, match=rf"tensor {spec.name} fails its checksum"):
        load_rank(tmp_path, 4, 0, 1)


def test_each_rank_keeps_its_newest_steps_and_a_step_goes_with_its_last_rank(tmp_path: Path) -> None:
    buffer, meta = snapshot(1)
    for step in (10, 20, 30):
        for rank in (0, 1):
            write_step(tmp_path, "j", step, rank, 2, 1, buffer, meta)
    prune(tmp_path, 0, keep=2)
    assert complete_steps(tmp_path, 2) == [30, 20]
    assert (tmp_path / "step_000000010").is_dir(), "rank 1's files of step 10 are still there"
    prune(tmp_path, 1, keep=2)
    assert not (tmp_path / "step_000000010").exists()


def test_persists_are_due_every_n_steps_or_after_t_seconds_on_the_grid(tmp_path: Path) -> None:
    log = get_logger(test="durable")
    by_steps = DurableWriter(str(tmp_path), "j", every_steps=5, keep=2, log=log)
    by_time = DurableWriter(str(tmp_path), "j", every_steps=0, keep=2, log=log, every_s=60.0, grid_steps=4)
    try:
        assert [s for s in range(12) if by_steps.due(s)] == [5, 10]
        assert [s for s in range(12) if by_time.due(s)] == [], "60 s have not passed"
        by_time._last_t = time.monotonic() - 61.0  # a minute went by
        assert [s for s in range(1, 13) if by_time.due(s)] == [4], "the next grid step, then wait again"
    finally:
        by_steps.close()
        by_time.close()
    with pytest.raises(ValueError):
        DurableWriter(str(tmp_path), "j", every_steps=0, keep=2, log=log)


def test_streamed_every_k_steps_the_first_streamed_step_past_each_rule_step_is_persisted(tmp_path: Path) -> None:
    """Only streamed steps are asked (every K-th, `snapshot_cadence`): a rule step that is not streamed
    is persisted at the next streamed one, the same on every rank; a rollback persists again."""
    writer = DurableWriter(str(tmp_path), "j", every_steps=10, keep=2, log=get_logger(test="durable"))
    try:
        assert [s for s in range(4, 44, 4) if writer.due(s)] == [12, 20, 32, 40]
        assert [s for s in (16, 20, 24) if writer.due(s)] == [20], "rolled back to 16: step 20 persisted again"
    finally:
        writer.close()


@contextlib.contextmanager
def file_size_limit(nbytes: int) -> Iterator[None]:
    """Writes that would grow any file of this process past `nbytes` fail with EFBIG ("File too large"),
    as under `ulimit -f`: a real write error that is not a full disk."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the signal ends the process
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, handler)


def test_a_write_dcp_fails_is_removed_and_logged_and_the_next_step_is_persisted(tmp_path: Path) -> None:
    failing, failing_meta = snapshot(1, inputs=16384)  # 256 KiB of weights
    buffer, meta = snapshot(2, inputs=16384)
    writer = DurableWriter(str(tmp_path), "j", every_steps=1, keep=2, log=get_logger(test="durable"))
    try:
        with capture_logs() as logs:
            with file_size_limit(64 * 1024):
                assert writer.offer(1, 0, 1, 1, failing, failing_meta)
                assert writer.wait_idle(PERSIST_WAIT_S)
            assert writer.running, "DCP's CheckpointException (a BaseException) did not end the writer"
            assert (writer.persisted, writer.failed, writer.disk_full) == (0, 1, 0)
            checkpoint, _ = rank_files(tmp_path, 1, 0)
            assert not step_dir(tmp_path, 1).exists(), "the failed step's partial files are removed"
            failure = writer.last_failure
            assert failure is not None and failure.path == str(checkpoint) and "File too large" in failure.reason
            (logged,) = [line for line in logs if line["event"] == "durable persist failed"]
            assert logged["step"] == 1 and logged["path"] == str(checkpoint) and "File too large" in logged["reason"]

            assert writer.offer(2, 0, 1, 1, buffer, meta), "tried again, not skipped as still being written"
            assert writer.wait_idle(PERSIST_WAIT_S)
        assert (writer.persisted, writer.failed, writer.skipped) == (1, 1, 0)
        assert complete_steps(tmp_path, 1) == [2]
        loaded, _ = load_rank(tmp_path, 2, 0, 1)  # verifies every tensor's checksum
        assert all(torch.equal(loaded.by_name[name], view) for name, view in buffer.by_name.items())
    finally:
        assert writer.close(timeout_s=PERSIST_WAIT_S)


def test_partial_steps_a_crash_left_are_removed_when_the_rank_persists_again(tmp_path: Path) -> None:
    buffer, meta = snapshot(2)
    write_step(tmp_path, "j", 2, 0, 2, 1, buffer, meta)
    # Rank 0 died writing step 4 (its DCP files, no manifest) and step 6 (a manifest never renamed).
    died_in_files, _ = rank_files(tmp_path, 4, 0)
    died_in_files.mkdir(parents=True)
    (died_in_files / "__0_0.distcp").write_bytes(b"\0" * 100)
    _, manifest = rank_files(tmp_path, 6, 0)
    manifest.parent.mkdir()
    manifest.with_suffix(".json.partial").write_text('{"format": 2')
    # Rank 1's step 4 has no manifest yet either, but rank 1 may be writing it right now.
    theirs, _ = rank_files(tmp_path, 4, 1)
    theirs.mkdir()

    buffer, meta = snapshot(8)
    write_step(tmp_path, "j", 8, 0, 2, 1, buffer, meta)
    prune(tmp_path, 0, keep=2)  # what the writer does after every persist
    assert not died_in_files.exists() and not step_dir(tmp_path, 6).exists()
    assert theirs.is_dir(), "another rank's files are its own to remove"
    assert sorted(p.relative_to(tmp_path).as_posix() for p in tmp_path.glob("step_*/rank_00000*")) == [
        "step_000000002/rank_00000",
        "step_000000002/rank_00000.json",
        "step_000000008/rank_00000",
        "step_000000008/rank_00000.json",
    ]


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


def test_close_abandons_a_write_stuck_on_the_disk_within_its_bound(tmp_path: Path) -> None:
    buffer, meta = snapshot(3)
    _, manifest = rank_files(tmp_path, 3, 0)
    manifest.parent.mkdir()
    stuck = manifest.with_suffix(".json.partial")
    os.mkfifo(stuck)  # opening it to write waits for a reader: a write that hangs, as on a dead mount
    close_wait_s = 0.5
    writer = DurableWriter(
        str(tmp_path), "j", every_steps=1, keep=2, log=get_logger(test="durable"), close_wait_s=close_wait_s
    )
    try:
        with capture_logs() as logs:
            assert writer.offer(3, 0, 1, 1, buffer, meta)
            assert not writer.offer(4, 0, 1, 1, buffer, meta), "step 3 is still being written"
            started = time.monotonic()
            stopped = writer.close()
            took_s = time.monotonic() - started
        assert not stopped and writer.running, "the write is still stuck: abandoned, not waited for"
        assert took_s < close_wait_s + CLOSE_SLACK_S
        abandoned = [line for line in logs if line["event"].startswith("durable writer abandoned")]
        assert abandoned and abandoned[0]["close_wait_s"] == close_wait_s
    finally:
        drain_until_closed(stuck, PERSIST_WAIT_S)  # the write goes on, fails (a pipe cannot be fsynced), and ends
        assert writer.close(timeout_s=PERSIST_WAIT_S), "the writer ends once its write returns"
    assert writer.persisted == 0 and writer.failed == 1 and not step_dir(tmp_path, 3).exists()
