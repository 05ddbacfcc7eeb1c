"""Snapshots of model and optimizer state: capture into a flat buffer and restore, bit for bit."""

from __future__ import annotations

import random
import struct

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from deadpool.ddp_check import BucketRebuildError, check_wrapped, find_ddp
from deadpool.snapshot_layout import ALIGN_BYTES, FlatBuffer, SnapshotLayout, plan_layout
from deadpool.training_state import (
    SnapshotMeta,
    check_fits,
    collect_sources,
    load_module,
    load_optimizer,
    restore_rng,
    snapshot_now,
    state_device,
)


def model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Linear(16, 3, bias=False))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: nn.Module, optimizer: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        x = torch.randn(4, 8)
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def capture(model: nn.Module, optimizer: torch.optim.Optimizer, step: int) -> tuple[FlatBuffer, SnapshotMeta]:
    return snapshot_now(model, optimizer, step, extra={"epoch": 1})


def assert_train_on_alike(
    model: nn.Module, optimizer: torch.optim.Optimizer, twin: nn.Module, twin_opt: torch.optim.Optimizer
) -> None:
    """Two more steps on the same inputs leave both with equal state, bit for bit."""
    for m, o in ((model, optimizer), (twin, twin_opt)):
        torch.manual_seed(7)
        train(m, o, steps=2)
    for a, b in zip(model.state_dict().values(), twin.state_dict().values(), strict=True):
        assert torch.equal(a, b)


def test_layout_aligns_every_tensor_and_survives_the_manifest() -> None:
    layout = plan_layout(
        [("a", torch.zeros(3)), ("b", torch.zeros(2, 5, dtype=torch.bfloat16)), ("c", torch.zeros(()))]
    )
    assert all(spec.offset % ALIGN_BYTES == 0 for spec in layout.specs)
    assert SnapshotLayout.from_fields(layout.to_fields()) == layout
    with pytest.raises(ValueError, match="malformed"):
        SnapshotLayout.from_fields({"total_bytes": 4, "specs": [["a", "float32", [8], 0, 32]]})


def test_a_restored_copy_continues_exactly_like_the_original() -> None:
    original, original_opt = model_and_optimizer(seed=0)
    train(original, original_opt, steps=3)
    random.seed(5)
    buffer, meta = capture(original, original_opt, step=3)
    expected_python_random = random.random()

    replica, replica_opt = model_and_optimizer(seed=1)  # built differently: everything must come from the snapshot
    load_module(replica, [buffer])
    load_optimizer(replica, replica_opt, [buffer], meta.decode_tree(buffer))
    torch.manual_seed(123)  # RNG state must come from the snapshot too
    restore_rng(meta.rng)
    assert random.random() == expected_python_random
    torch.manual_seed(7)
    train(original, original_opt, steps=2)
    restore_rng(meta.rng)
    random.random()
    torch.manual_seed(7)
    train(replica, replica_opt, steps=2)
    for a, b in zip(original.state_dict().values(), replica.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert meta.step == 3 and meta.extra == {"epoch": 1}


def test_a_survivor_rolled_back_reuses_its_state_tensors_and_goes_on_exactly_like_the_original() -> None:
    """A rank restoring from its own buffers (a survivor rolled back) copies the state into the tensors
    its optimizer already holds, not into fresh ones, and trains on bit for bit as from the snapshot."""
    model, optimizer = model_and_optimizer(seed=0)
    train(model, optimizer, steps=3)
    buffer, meta = capture(model, optimizer, step=3)
    twin, twin_opt = model_and_optimizer(seed=0)
    train(twin, twin_opt, steps=3)
    train(model, optimizer, steps=1)  # one step past the snapshot: rolled back below
    held = {id(t) for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)}

    load_module(model, [buffer])
    load_optimizer(model, optimizer, [buffer], meta.decode_tree(buffer))

    now = {id(t) for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)}
    assert now == held, "every state tensor is the one held before, the snapshot's values copied into it"
    for state, twin_state in zip(optimizer.state.values(), twin_opt.state.values(), strict=True):
        assert all(torch.equal(state[k], twin_state[k]) for k in twin_state)
    assert_train_on_alike(model, optimizer, twin, twin_opt)


def test_a_fused_optimizer_restored_continues_exactly_like_the_original() -> None:
    torch.manual_seed(0)
    original = nn.Linear(8, 4)
    original_opt = torch.optim.AdamW(original.parameters(), lr=1e-2, fused=True)
    train(original, original_opt, steps=2)
    buffer, meta = capture(original, original_opt, step=2)
    replica = nn.Linear(8, 4)
    replica_opt = torch.optim.AdamW(replica.parameters(), lr=1e-2, fused=True)
    load_module(replica, [buffer])
    load_optimizer(replica, replica_opt, [buffer], meta.decode_tree(buffer))
    assert_train_on_alike(original, original_opt, replica, replica_opt)


def test_restored_optimizer_state_goes_where_torch_puts_it() -> None:
    """A fused or capturable group reads its step count on the parameter's device (a fused CUDA AdamW
    refuses one on the CPU); any other group keeps it on the CPU. The meta device stands in for a GPU."""
    param = nn.Parameter(torch.empty(3, device="meta"))
    step, moment = torch.tensor(4.0), torch.zeros(3)
    for group in ({"fused": True}, {"capturable": True}):
        assert state_device("step", step, param, group) == param.device
    for plain in ({}, {"fused": None, "capturable": False}):
        assert state_device("step", step, param, plain) == step.device
    for any_group in ({}, {"fused": True}):
        assert state_device("exp_avg", moment, param, any_group) == param.device
        assert state_device("max_lr", torch.tensor(1.0), param, any_group) == param.device


def test_the_snapshot_buffer_is_independent_of_later_training() -> None:
    model, optimizer = model_and_optimizer(seed=0)
    train(model, optimizer, steps=1)
    buffer, _ = capture(model, optimizer, step=1)
    frozen = buffer.by_name["param.0"].clone()
    train(model, optimizer, steps=1)
    assert torch.equal(buffer.by_name["param.0"], frozen)
    assert not torch.equal(next(model.parameters()).detach(), frozen)


def test_loading_into_a_model_of_another_shape_is_refused() -> None:
    model, optimizer = model_and_optimizer(seed=0)
    train(model, optimizer, steps=1)
    buffer, _ = capture(model, optimizer, step=1)
    with pytest.raises(ValueError, match=r"does not fit|holds"):
        load_module(nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4), nn.Linear(4, 3, bias=False)), [buffer])


def test_the_bytes_view_is_the_buffer_itself() -> None:
    buffer = FlatBuffer(plan_layout([("a", torch.arange(4, dtype=torch.float32))]))
    buffer.views[0].copy_(torch.arange(4, dtype=torch.float32))
    view = buffer.bytes_view()
    assert len(view) == buffer.layout.total_bytes
    assert bytes(view[:16]) == struct.pack("=4f", 0.0, 1.0, 2.0, 3.0)


def test_a_ddp_wrapper_that_rebuilds_buckets_is_refused(gloo_world_of_one: None) -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(BucketRebuildError, match="find_unused_parameters=True"):
        check_wrapped(DistributedDataParallel(model))
    check_wrapped(DistributedDataParallel(model, find_unused_parameters=True))


def test_a_compiled_ddp_is_found_and_checked(gloo_world_of_one: None) -> None:
    model = nn.Linear(4, 4)
    with pytest.raises(BucketRebuildError):
        check_wrapped(torch.compile(DistributedDataParallel(model)))  # type: ignore[arg-type]
    compiled = torch.compile(DistributedDataParallel(model, find_unused_parameters=True))
    assert find_ddp(compiled) is compiled._orig_mod  # type: ignore[arg-type,attr-defined]
    assert find_ddp(model) is None


def test_a_snapshot_of_another_model_is_refused_by_its_layout_before_any_byte_is_received() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3))
    sources = collect_sources(model, None)
    check_fits(model, plan_layout(list(zip(sources.names, sources.tensors, strict=True))))  # its own: fits

    wider = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5))
    other = collect_sources(wider, None)
    with pytest.raises(ValueError, match=r"param\.0 is \(5, 4\)/float32, the model's \(3, 4\)/float32"):
        check_fits(model, plan_layout(list(zip(other.names, other.tensors, strict=True))))
    halved = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3)).to(torch.float64)
    doubles = collect_sources(halved, None)
    with pytest.raises(ValueError, match="float64"):
        check_fits(model, plan_layout(list(zip(doubles.names, doubles.tensors, strict=True))))
    deeper = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 3))
    more = collect_sources(deeper, None)
    with pytest.raises(ValueError, match="which the model does not have"):
        check_fits(model, plan_layout(list(zip(more.names, more.tensors, strict=True))))
