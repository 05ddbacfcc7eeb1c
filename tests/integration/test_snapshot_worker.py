"""Every rank snapshots every step it is due. At a forced interval a capture waits for the previous
snapshot's stream, and a stream stuck on a store that never answers is abandoned after the bound (or at
once, when the store is no longer placed). At the adaptive interval a capture waits at most the budget,
then goes on without streaming: into a third buffer beside the one streaming where the member keeps a
crash copy, not at all where it keeps none."""

from __future__ import annotations

import contextlib
import socket
import threading
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deadpool.durable_tier import DurableWriter, complete_steps, load_rank
from deadpool.host_copy import HostCopy
from deadpool.snapshot_layout import plan_layout
from deadpool.snapshot_worker import SnapshotWorker
from deadpool.store_client import UploadKey
from deadpool.training_state import SnapshotMeta, capture_tree, collect_sources
from deadpool_protocol import StoreAddress
from deadpool_runtime.logs import get_logger

WAIT_S = 10.0


class SilentStore:
    """Accepts an upload, reads every byte, and never answers until `release()`; then hangs up."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.received = 0
        self.receiving = threading.Event()
        """Set at the first bytes received."""
        self._release = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        try:
            conn, _ = self.server.accept()
        except OSError:
            return  # released before anyone connected
        conn.settimeout(0.05)
        with conn:
            while not self._release.is_set():
                try:
                    self.received += len(conn.recv(1 << 20))
                    if self.received:
                        self.receiving.set()
                except TimeoutError:
                    continue

    def release(self) -> None:
        self._release.set()
        with contextlib.suppress(OSError):
            self.server.shutdown(socket.SHUT_RDWR)  # wakes an accept still waiting
        self._thread.join(WAIT_S)
        self.server.close()


def model_and_plan() -> tuple[nn.Linear, Any, Any]:
    torch.manual_seed(0)
    first_layer = nn.Linear(64, 64)
    model = nn.Sequential(first_layer, nn.Linear(64, 8))
    sources = collect_sources(model, None)
    layout = plan_layout(list(zip(sources.names, sources.tensors, strict=True)))
    return first_layer, sources, layout


def test_a_capture_waits_for_the_previous_stream_and_abandons_a_stuck_one_after_its_bound() -> None:
    first_layer, sources, layout = model_and_plan()
    store = SilentStore()
    worker = SnapshotWorker(get_logger(test="worker"), chunk_bytes=4096, wait_s=0.3)
    stores = [StoreAddress("silent", "127.0.0.1", store.port)]
    try:
        first = worker.capture(UploadKey("j", 1, 0, "m", 1), layout, sources, b"", stores)
        assert first is not None
        assert worker.wait_captured(WAIT_S)  # the copy is done although the upload hangs
        slot = worker.local(1)
        assert slot is not None and slot.buffer is not None
        assert torch.equal(slot.buffer.views[0], first_layer.weight)

        with torch.no_grad():
            first_layer.weight.add_(1.0)  # training goes on while step 1 streams
        second = worker.capture(UploadKey("j", 1, 0, "m", 2), layout, sources, b"", stores)
        assert second is not None, "step 2 is captured, not skipped: every rank holds the same steps"
        assert worker.waits == 1 and worker.skipped == 0
        assert first.done.is_set() and first.sealed_on == [], "the stuck upload was abandoned"
        assert worker.wait_captured(WAIT_S)
        slot = worker.local(2)
        assert slot is not None and slot.buffer is not None
        assert torch.equal(slot.buffer.views[0], first_layer.weight)
        assert worker.local(1) is not None  # the older snapshot is the other ping-pong buffer
    finally:
        store.release()
        worker.close()


def test_dropping_a_store_that_is_no_longer_placed_frees_a_stream_blocked_on_it_at_once() -> None:
    _, sources, layout = model_and_plan()
    store = SilentStore()
    worker = SnapshotWorker(get_logger(test="worker"), chunk_bytes=4096, wait_s=60.0)
    try:
        request = worker.capture(
            UploadKey("j", 1, 0, "m", 1), layout, sources, b"", [StoreAddress("silent", "127.0.0.1", store.port)]
        )
        assert request is not None and not request.done.wait(0.3)  # blocked on the silent store
        worker.drop_stores(keep={"another"})
        assert request.done.wait(WAIT_S) and request.sealed_on == []
    finally:
        store.release()
        worker.close()


def test_a_snapshot_taken_before_its_generations_newest_placement_skips_the_stores_it_no_longer_names() -> None:
    _, sources, layout = model_and_plan()
    lost, placed = SilentStore(), SilentStore()
    worker = SnapshotWorker(get_logger(test="worker"), chunk_bytes=4096, wait_s=60.0)
    stores = [StoreAddress("lost", "127.0.0.1", lost.port), StoreAddress("placed", "127.0.0.1", placed.port)]
    try:
        worker.drop_stores(keep={"placed"}, generation=1)
        request = worker.capture(UploadKey("j", 1, 0, "m", 1), layout, sources, b"", stores)
        assert request is not None
        assert placed.receiving.wait(WAIT_S), "the silent lost store, first in the list, was not skipped"
        assert lost.received == 0
    finally:
        lost.release()
        placed.release()
        worker.close()


def test_adaptive_a_capture_beside_a_busy_stream_goes_into_a_third_buffer_and_keeps_the_newest(
    tmp_path: Path,
) -> None:
    first_layer, sources, layout = model_and_plan()
    store = SilentStore()
    log = get_logger(test="worker")
    worker = SnapshotWorker(log, chunk_bytes=4096, wait_s=60.0, host_copy=HostCopy(tmp_path, "j", "m", log))
    stores = [StoreAddress("silent", "127.0.0.1", store.port)]
    try:
        first = worker.capture(UploadKey("j", 1, 0, "m", 1), layout, sources, b"", stores, stream_wait_s=0.01)
        assert first is not None and first.streamed and not first.done.wait(0.2)  # stuck on the store
        made = [slot.buffer for slot in worker.slots]  # all three at the first capture, not in the steps after
        assert len(made) == 3 and all(b is not None and b.layout == layout for b in made)
        assert sorted(p.name for p in (tmp_path / "m").glob("slot-*.bin")) == [f"slot-{i}.bin" for i in range(3)]
        for step in (2, 3, 4):
            with torch.no_grad():
                first_layer.weight.add_(1.0)
            request = worker.capture(
                UploadKey("j", 1, 0, "m", step), layout, sources, b"", stores, stream=step == 2, stream_wait_s=0.01
            )
            assert request is not None and not request.streamed, "captured, not streamed: the stream is busy"
            assert worker.wait_captured(WAIT_S) and request.done.wait(WAIT_S)
            slot = worker.local(step)
            assert slot is not None and slot.buffer is not None
            assert torch.equal(slot.buffer.views[0], first_layer.weight)
            assert worker.local(step - 1) is not None, "the newest step before stays whole during the copy"
        assert [slot.buffer for slot in worker.slots] == made and worker.stream_skips == 1 and worker.skipped == 0
        assert worker.local(1) is not None, "the buffer being streamed is never captured into"
        assert worker.newest_local_step() == 4
    finally:
        store.release()
        worker.close()


def test_adaptive_a_durable_step_whose_stream_is_skipped_is_persisted_from_its_crash_copy(tmp_path: Path) -> None:
    """Every rank is told the same durable step; a rank whose stream of it was skipped (the previous one
    still ran) must persist it all the same, or no step is complete on every rank (a CI failure)."""
    first_layer, sources, layout = model_and_plan()
    store = SilentStore()
    log = get_logger(test="worker")
    durable = DurableWriter(str(tmp_path / "durable"), "j", every_steps=2, keep=2, log=log)
    worker = SnapshotWorker(
        log, chunk_bytes=4096, wait_s=60.0, host_copy=HostCopy(tmp_path, "j", "m", log), durable=durable
    )
    stores = [StoreAddress("silent", "127.0.0.1", store.port)]
    try:
        first = worker.capture(UploadKey("j", 1, 0, "m", 1), layout, sources, b"", stores, stream_wait_s=0.01)
        assert first is not None and not first.done.wait(0.2)  # stuck on the store
        with torch.no_grad():
            first_layer.weight.add_(1.0)
        meta = SnapshotMeta.capture(2, layout, capture_tree(nn.Linear(1, 1), None, {}), sources, {}).encode()
        second = worker.capture(UploadKey("j", 1, 0, "m", 2), layout, sources, meta, stores, 1, stream_wait_s=0.01)
        assert second is not None and not second.streamed and second.done.wait(WAIT_S)
    finally:
        store.release()
        worker.close()  # waits for the persist in hand
    assert complete_steps(tmp_path / "durable", 1) == [2] and durable.persisted == 1
    buffer, _ = load_rank(tmp_path / "durable", 2, 0, 1)
    assert torch.equal(buffer.views[0], first_layer.weight)


def test_adaptive_without_a_crash_copy_a_skipped_stream_captures_nothing() -> None:
    _, sources, layout = model_and_plan()
    store = SilentStore()
    worker = SnapshotWorker(get_logger(test="worker"), chunk_bytes=4096, wait_s=60.0)
    stores = [StoreAddress("silent", "127.0.0.1", store.port)]
    try:
        first = worker.capture(UploadKey("j", 1, 0, "m", 1), layout, sources, b"", stores, stream_wait_s=0.01)
        assert first is not None and worker.wait_captured(WAIT_S)
        second = worker.capture(UploadKey("j", 1, 0, "m", 2), layout, sources, b"", stores, stream_wait_s=0.01)
        assert second is None and worker.stream_skips == 1 and worker.waits == 1
        assert len(worker.slots) == 2 and worker.local(1) is not None
    finally:
        store.release()
        worker.close()


def test_of_two_copies_of_one_step_the_newer_generations_is_restored_and_the_older_overwritten() -> None:
    """A rebuild re-captures the step it restored in its new generation (its SEAL): the copy of the
    abandoned timeline must neither be the one a restore takes nor the one kept."""
    _, sources, layout = model_and_plan()
    worker = SnapshotWorker(get_logger(test="worker"), chunk_bytes=4096, wait_s=WAIT_S)
    try:
        for generation, step in ((1, 5), (2, 5), (2, 6)):
            request = worker.capture(UploadKey("j", generation, 0, "m", step), layout, sources, b"", [])
            assert request is not None and request.done.wait(WAIT_S)
            if generation == 2:
                slot = worker.local(5)
                assert slot is not None and slot.generation == 2, "the abandoned timeline's copy"
        assert sorted((s.step, s.generation) for s in worker.slots) == [(5, 2), (6, 2)]
    finally:
        worker.close()
