"""The snapshot thread never makes training wait on the network: a slow store makes captures skip."""

from __future__ import annotations

import socket
import threading

import torch
from torch import nn

from deadpool.snapshot_layout import plan_layout
from deadpool.snapshot_worker import SnapshotWorker
from deadpool.store_client import UploadKey
from deadpool.training_state import collect_sources
from deadpool_protocol import StoreAddress
from deadpool_protocol.logs import get_logger

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


def test_a_capture_is_skipped_while_the_previous_snapshot_still_streams() -> None:
    torch.manual_seed(0)
    first_layer = nn.Linear(64, 64)
    model = nn.Sequential(first_layer, nn.Linear(64, 8))
    sources = collect_sources(model, None)
    layout = plan_layout(list(zip(sources.names, sources.tensors, strict=True)))
    store = SilentStore()
    worker = SnapshotWorker(get_logger(test="worker"), chunk_bytes=4096)
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
        assert worker.capture(UploadKey("j", 1, 0, "m", 2), layout, sources, b"", stores) is None
        assert worker.skipped == 1
        worker.fence_optimizer_step()  # nothing to wait for: returns at once

        store.release()  # the store hangs up: the upload fails, reported, not raised
        assert first.done.wait(WAIT_S) and first.sealed_on == []
        third = worker.capture(UploadKey("j", 1, 0, "m", 3), layout, sources, b"", stores)
        assert third is not None and third.done.wait(WAIT_S)
        slot = worker.local(3)
        assert slot is not None and slot.buffer is not None
        assert torch.equal(slot.buffer.views[0], first_layer.weight)
        assert worker.local(1) is not None  # the older snapshot is the other ping-pong buffer
    finally:
        worker.close()
