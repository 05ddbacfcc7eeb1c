"""Errors out of a step are classified by type and origin, not by the words in their message: a data
loader that times out is the step's own failure, though it says "timed out" as gloo does. (A real
gloo error from a peer's loss is classified in tests/integration/test_group_abort.py.)"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

from deadpool.failure_origin import is_collective_error


class Slow(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(30)
        return torch.zeros(1)


def test_a_data_loader_timeout_is_the_steps_own_failure() -> None:
    loader = DataLoader(Slow(), num_workers=1, timeout=0.5)
    with pytest.raises(RuntimeError, match="timed out") as caught:
        next(iter(loader))
    assert not is_collective_error(caught.value)


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("process group timed out: connection reset by peer (gloo)"),  # words alone mean nothing
        ValueError("nccl"),
        KeyError("x"),
    ],
)
def test_user_errors_that_sound_like_collectives_are_not_collective_errors(error: Exception) -> None:
    try:
        raise error
    except Exception as exc:
        assert not is_collective_error(exc)


def test_a_backend_error_is_a_collective_error_and_so_is_one_raised_while_handling_it() -> None:
    backend = dist.DistBackendError("NCCL communicator was aborted")
    assert is_collective_error(backend)
    try:
        try:
            raise backend
        except dist.DistError as exc:
            raise ValueError("while handling it") from exc
    except ValueError as outer:
        assert is_collective_error(outer)


def test_an_error_from_the_backends_cpp_code_is_known_by_its_source_location() -> None:
    gloo = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error: Connection reset"
    assert is_collective_error(RuntimeError(gloo))
    assert is_collective_error(RuntimeError("[../torch/csrc/distributed/c10d/ProcessGroupGloo.cpp:2311] timed out"))
    assert not is_collective_error(RuntimeError("[my_loader.py:12] gloo"))
