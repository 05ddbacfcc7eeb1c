"""The durable tier's files: DCP checkpoints with manifests, verified on load, pruned, and when a step
is due (every rank must decide alike)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from torch import nn

from deadpool.durable_tier import DurableError, DurableWriter, complete_steps, load_rank, prune, rank_files, write_step
from deadpool.snapshot_layout import FlatBuffer
from deadpool.training_state import snapshot_now
from deadpool_protocol.logs import get_logger


def snapshot(seed: int) -> tuple[FlatBuffer, bytes]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 4), nn.LayerNorm(4))
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
