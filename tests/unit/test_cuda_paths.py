"""The GPU paths' logic, without a GPU: which copy path each tensor takes, bounded waits on CUDA events,
torch's NCCL settings, and which group an abort hits.

The stand-ins below replace only what cannot exist here (a CUDA event, a CUDA tensor, an NCCL group);
the CUDA and NCCL calls themselves are checked by bench/gpu_check.sh on a GPU. Pinned buffers are
exactly their size: the host registration is recorded instead of made."""

from __future__ import annotations

import gc
import threading

import pytest
import torch

from deadpool.process_group import NCCL_ENVIRONMENT, GenerationGroup, apply_nccl_environment
from deadpool.snapshot_layout import FlatBuffer, plan_layout
from deadpool.snapshot_worker import CaptureRequest, SnapshotWorker, device_split, wait_for_event
from deadpool.spare_landing import SpareLanding
from deadpool.store_client import UploadKey
from deadpool_protocol.dataplane import chunk_spans
from deadpool_runtime.logs import get_logger


class NeverDone:
    """A CUDA event whose work never completes (it queued behind a collective with a dead peer)."""

    def __init__(self) -> None:
        self.polls = 0

    def query(self) -> bool:
        self.polls += 1
        return False


class DoneAfter:
    def __init__(self, polls: int) -> None:
        self.left = polls

    def query(self) -> bool:
        self.left -= 1
        return self.left <= 0


class OnDevice:
    """A tensor on a CUDA device, as far as the path choice looks."""

    is_cuda = True


class RecordedGroup:
    """An NCCL process group, as far as an abort goes."""

    def __init__(self) -> None:
        self.aborts = 0

    def abort(self) -> None:
        self.aborts += 1


def test_each_tensor_takes_its_own_devices_copy_path() -> None:
    tensors = [torch.zeros(2), OnDevice(), torch.zeros(1), OnDevice()]
    assert device_split(tensors) == ([1, 3], [0, 2])  # type: ignore[arg-type]
    assert device_split([torch.zeros(1)]) == ([], [0])


def test_a_wait_on_a_cuda_event_ends_when_abandoned_or_at_its_bound_not_never() -> None:
    assert wait_for_event(DoneAfter(3), bound_s=60.0, abandoned=lambda: False)
    stuck = NeverDone()
    superseded = threading.Event()
    threading.Timer(0.05, superseded.set).start()
    assert not wait_for_event(stuck, bound_s=60.0, abandoned=superseded.is_set)
    assert stuck.polls > 1
    assert not wait_for_event(NeverDone(), bound_s=0.02, abandoned=lambda: False)


def test_a_copy_still_waiting_on_the_gpu_is_given_up_when_its_generation_is_superseded() -> None:
    worker = SnapshotWorker(get_logger(test="cuda-paths"), chunk_bytes=4096)
    try:
        slot = worker.slots[0]
        request = CaptureRequest(slot=slot, key=UploadKey("job", 3, 0, "m0", 7), stores=[])
        request.cuda_event = NeverDone()
        worker.cancel_uploads_before(4)  # the rebuild of generation 4 began
        assert worker._copy(request) is False
        assert slot.step == -1  # never taken for the snapshot of step 7
        assert worker.local(7) is None
    finally:
        worker.close()


def test_nccl_settings_raise_in_survivors_instead_of_killing_them_and_yield_to_the_users() -> None:
    env = {"TORCH_NCCL_ENABLE_MONITORING": "1"}
    applied = apply_nccl_environment(env)
    assert applied["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # CleanUpOnly: abort and raise, never kill
    assert applied["TORCH_NCCL_ENABLE_MONITORING"] == "1"  # the user's own choice stays
    assert set(applied) == set(NCCL_ENVIRONMENT)


def test_an_nccl_abort_hits_the_recorded_group_once_and_only_when_it_is_older() -> None:
    group = GenerationGroup()
    recorded = RecordedGroup()
    group._group, group._backend, group._generation = recorded, "nccl", 3  # as create() leaves them
    assert not group.abort(below_generation=3)  # generation 3 is not older than 3
    assert group.abort(below_generation=4) and recorded.aborts == 1  # no sockets needed (NCCL has none)
    assert not group.abort() and recorded.aborts == 1  # once per group


def test_the_replica_exchange_is_staged_in_bounded_chunks() -> None:
    assert chunk_spans(10, 4) == [(0, 4), (4, 4), (8, 2)]  # (offset, nbytes): [0, 4), [4, 8), [8, 10)
    assert chunk_spans(8, 4) == [(0, 4), (4, 4)]
    assert chunk_spans(0, 4) == []
    spans = chunk_spans(3 << 30, 64 << 20)
    assert max(size for _, size in spans) == 64 << 20 and sum(spans[-1]) == 3 << 30


class RecordingCudart:
    """The CUDA runtime's host registration, as far as `pinned_memory` calls it."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []

    def cudaHostRegister(self, pointer: int, size: int, flags: int) -> int:
        assert flags == 0
        self.registered[pointer] = size
        return 0

    def cudaHostUnregister(self, pointer: int) -> int:
        self.unregistered.append(pointer)
        return 0


def test_a_pinned_buffer_is_exactly_its_size_registered_once_and_unregistered_when_freed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cudart = RecordingCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    layout = plan_layout([("param.0", torch.zeros(1_650_001, dtype=torch.uint8))])
    buffer = FlatBuffer(layout, pin=True)
    pointer = buffer.data.data_ptr()
    # torch's pin_memory would take 2 MiB (the next power of two) for these 1.65 MB
    assert buffer.data.numel() == layout.total_bytes and cudart.registered == {pointer: layout.total_bytes}
    buffer.views[0].fill_(7)  # the mapping is writable memory of its own
    assert int(buffer.data[: layout.total_bytes].sum()) == 7 * 1_650_001
    del buffer
    gc.collect()
    assert cudart.unregistered == [pointer]


def test_a_spare_landing_on_cuda_is_exactly_the_snapshots_size_and_pinned(monkeypatch: pytest.MonkeyPatch) -> None:
    cudart = RecordingCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    landing = SpareLanding(64 << 20, pin=True, log=get_logger(test="landing"))
    landing.want(3_000_001)
    landing.start()
    assert landing.wait_faulted(3_000_001, 30.0)
    got = landing.take(3_000_001)
    assert got is not None and list(cudart.registered.values()) == [3_000_001]
