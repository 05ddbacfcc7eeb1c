"""Every rank snapshots every step it is due: a capture waits for the previous snapshot's stream, and a
stream stuck on a store that never answers is abandoned after the bound (or at once, when the store is
no longer placed)."""

from __future__ import annotations

import socket
import threading
from typing import Any

import torch
from torch import nn

from deadpool.snapshot_layout import plan_layout
from deadpool.snapshot_worker import SnapshotWorker
from deadpool.store_client import UploadKey
from deadpool.training_state import collect_sources
from deadpool_protocol import StoreAddress
from deadpool_runtime.logs import get_logger

WAIT_S = 10.0


class SilentStore:
    """Accepts an upload, reads every byte, and never answers until `release()`; then hangs up."""

    def __init__(self) -> None:
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.received = 0
        self._release = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        conn, _ = self.server.accept()
        conn.settimeout(0.05)
        with conn:
            while not self._release.is_set():
                try:
                    self.received += len(conn.recv(1 << 20))
                except TimeoutError:
                    continue

    def release(self) -> None:
        self._release.set()
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
